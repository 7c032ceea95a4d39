"""The HTTP clients of ``benchmarks/serving.py``, run as a process of their own (own GIL).

Reads ``{"url", "token", "clients", "requests", "seconds", "tokens", "model"}`` as JSON on
stdin; each of ``clients`` threads sends a chat request, waits for its answer, and sends the
next (a closed loop; see :func:`closed_loop`); prints the latencies, the elapsed time and the
process's CPU time over the loop as JSON. Each client keeps one HTTP/1.1 connection alive
(:class:`Client`) and sends requests encoded before the clock starts (an application's own
work, not the endpoint's): the clients share the endpoint's cores, so they are kept lean (an
httpx client spent about 0.9 ms of CPU a request, ``http.client`` about 0.2). Imports the
standard library and Pillow only.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PIL import Image

QUESTION = "What colour is the shape?"
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")


def png(index: int) -> bytes:
    """Request ``index``'s image: a plain square of one of eight colours."""
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), COLOURS[index % len(COLOURS)]).save(buffer, format="PNG")
    return buffer.getvalue()


def closed_loop(
    clients: int, requests: int, seconds: float, one: Any, left: Any = None
) -> tuple[list[float], float]:
    """``clients`` threads in a closed loop; every answer's latency, and the elapsed seconds.

    Clients send at least ``requests`` requests in all, and keep sending until ``seconds``
    have passed (so a cell lasts long enough to average out a shared machine's other work).
    ``left`` (if given) is called by each client thread when it sends no more.
    """
    latencies: list[float] = []
    lock = threading.Lock()
    sent = 0

    def client() -> None:
        nonlocal sent
        while True:
            with lock:
                if sent >= requests and time.perf_counter() - began >= seconds:
                    break
                index, sent = sent, sent + 1
            started = time.perf_counter()
            one(index)
            with lock:
                latencies.append(time.perf_counter() - started)
        if left is not None:
            left()

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return latencies, time.perf_counter() - began


def body_of(job: dict[str, Any], index: int) -> bytes:
    """Request ``index``'s JSON body: its image as a data URI, the question."""
    uri = "data:image/png;base64," + base64.b64encode(png(index)).decode()
    body = {
        "model": job["model"],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": uri}},
        ]}],
        "max_tokens": job["tokens"],
    }  # fmt: skip
    return json.dumps(body).encode()


class Client:
    """One keep-alive HTTP/1.1 connection that posts chat requests and reads whole answers.

    Deliberately minimal, so that the clients' own CPU (they share the endpoint's cores) is
    small beside the endpoint's: each request leaves in one write (headers and body built
    before the clock starts), and an answer is read by its ``Content-Length``, which the
    endpoint sends with every non-streamed answer. ``http.client`` sends headers and body in
    two writes and parses headers with the ``email`` package: about twice this CPU a request.
    """

    def __init__(self, job: dict[str, Any]) -> None:
        url = urllib.parse.urlsplit(job["url"])
        self.host, self.port, self.path = url.hostname, url.port, url.path
        self.token = job["token"]
        self.sock = socket.create_connection((self.host, self.port), timeout=600)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def request(self, body: bytes) -> bytes:
        """The whole request (head and body) for ``body``, as it goes on the wire."""
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode("latin-1") + body

    def ask(self, request: bytes) -> None:
        """Send ``request`` (:meth:`request`) and read its whole answer; anything but 200 raises."""
        self.sock.sendall(request)
        head = self._read_until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = next(
            (int(line.split(":", 1)[1]) for line in lines[1:]
             if line.lower().startswith("content-length:")),
            None,
        )  # fmt: skip
        if length is None:
            raise RuntimeError(f"the endpoint's answer must carry Content-Length, got {head!r}.")
        answer = self._read_exactly(length)
        if status != 200:
            raise RuntimeError(f"the endpoint answered {status}: {answer[:200]!r}")

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            self._receive()
        head, self.buffer = self.buffer.split(marker, 1)
        return head

    def _read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._receive()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def _receive(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise RuntimeError("the endpoint closed the connection mid-answer.")
        self.buffer += data

    def close(self) -> None:
        self.sock.close()


def main() -> int:
    job = json.load(sys.stdin)
    local = threading.local()
    # Encoded before the clock starts: an application's own work, not the endpoint's.
    bodies = [body_of(job, index) for index in range(len(COLOURS))]

    def one(index: int) -> None:
        if not hasattr(local, "client"):
            local.client = Client(job)
            local.requests = [local.client.request(body) for body in bodies]
        local.client.ask(local.requests[index % len(bodies)])

    cpu = time.process_time()
    latencies, elapsed = closed_loop(job["clients"], job["requests"], job["seconds"], one)
    cpu = time.process_time() - cpu
    json.dump({"latencies": latencies, "elapsed": elapsed, "cpu": cpu}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

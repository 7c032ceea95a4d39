"""The HTTP clients of ``benchmarks/serving.py``, run as a process of their own (own GIL).

Reads ``{"url", "token", "clients", "requests", "seconds", "tokens", "model"}`` as JSON on
stdin; each of ``clients`` threads sends a chat request, waits for its answer, and sends the
next (a closed loop; see :func:`closed_loop`); prints the latencies, the elapsed time and the
process's CPU time over the loop as JSON. Each client keeps one ``http.client`` connection
alive and sends bodies encoded before the clock starts (an application's own work, not the
endpoint's): the clients share the endpoint's cores, and an httpx client spent about 0.9 ms
of CPU a request where these spend about 0.2. Imports the standard library and Pillow only.
"""

from __future__ import annotations

import base64
import http.client
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
    """One keep-alive connection to the endpoint that posts chat requests and reads answers."""

    def __init__(self, job: dict[str, Any]) -> None:
        url = urllib.parse.urlsplit(job["url"])
        self.path = url.path
        self.headers = {"Authorization": "Bearer " + job["token"],
                        "Content-Type": "application/json"}  # fmt: skip
        self.connection = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        self.connection.connect()
        # Headers and body leave in separate writes: without this, Nagle's algorithm holds the
        # body until the headers are acknowledged, and a delayed ACK stalls each request ~40 ms.
        self.connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ask(self, body: bytes) -> None:
        """Post ``body`` and read its whole answer; anything but 200 raises."""
        self.connection.request("POST", self.path, body, self.headers)
        reply = self.connection.getresponse()
        answer = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"the endpoint answered {reply.status}: {answer[:200]!r}")

    def close(self) -> None:
        self.connection.close()


def main() -> int:
    job = json.load(sys.stdin)
    local = threading.local()
    # Encoded before the clock starts: an application's own work, not the endpoint's.
    bodies = [body_of(job, index) for index in range(len(COLOURS))]

    def one(index: int) -> None:
        if not hasattr(local, "client"):
            local.client = Client(job)
        local.client.ask(bodies[index % len(bodies)])

    cpu = time.process_time()
    latencies, elapsed = closed_loop(job["clients"], job["requests"], job["seconds"], one)
    cpu = time.process_time() - cpu
    json.dump({"latencies": latencies, "elapsed": elapsed, "cpu": cpu}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

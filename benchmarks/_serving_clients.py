"""The HTTP clients of ``benchmarks/serving.py``, run as a process of their own (own GIL).

Reads ``{"url", "token", "clients", "requests", "seconds", "tokens", "model"}`` as JSON on
stdin; each of ``clients`` threads sends a chat request, waits for its answer, and sends the
next (a closed loop; see :func:`closed_loop`); prints the latencies, the elapsed time and the
process's CPU time over the loop as JSON.
Imports httpx and Pillow only, so its start costs nothing measured.
"""

from __future__ import annotations

import base64
import io
import json
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
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


def ask(client: httpx.Client, job: dict[str, Any], index: int) -> None:
    """Send request ``index`` (its image, the question) and wait for its answer."""
    uri = "data:image/png;base64," + base64.b64encode(png(index)).decode()
    body = {
        "model": job["model"],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": uri}},
        ]}],
        "max_tokens": job["tokens"],
    }  # fmt: skip
    reply = client.post(job["url"], json=body, headers={"Authorization": "Bearer " + job["token"]})
    reply.raise_for_status()


def main() -> int:
    job = json.load(sys.stdin)
    local = threading.local()
    # Made before the clock starts: an httpx client builds an SSL context (tens of ms).
    idle = queue.SimpleQueue[httpx.Client]()
    for _ in range(job["clients"]):
        idle.put(httpx.Client(timeout=600))

    def one(index: int) -> None:
        if not hasattr(local, "client"):
            local.client = idle.get()
        ask(local.client, job, index)

    cpu = time.process_time()
    latencies, elapsed = closed_loop(job["clients"], job["requests"], job["seconds"], one)
    cpu = time.process_time() - cpu
    json.dump({"latencies": latencies, "elapsed": elapsed, "cpu": cpu}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

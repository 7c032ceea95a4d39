"""Serving throughput and latency: the HTTP endpoint, its batcher alone, plain transformers.

On the tiny random LLaVA of the tests, for 1, 8 and 32 concurrent clients (closed loop: each
client sends its next request when the last is answered), every request a zero-shot image
query, greedy, exactly ``--max-tokens`` new tokens (end of sequence is suppressed in all
three, so every row does the same work):

- **plain**: ``transformers`` ``generate()`` on batches of ``min(clients, rows)`` prompts,
  padded to the longest, no patch; its latency is the batch's time (a lower bound: no queue).
- **batcher**: :class:`client.service.batching.Batcher`, every row patched with a stored
  release (all heads), fixed-shape passes of ``rows`` rows; the prompt is built in the
  client's thread, as the endpoint does.
- **http**: the whole endpoint (:class:`client.service.http_server.HttpEndpoint`) on 127.0.0.1,
  one ``httpx`` client a thread in a client process of its own (so the clients do not
  share the server's interpreter lock), the images as data URIs, the release as the model
  name.

The HTTP layer's own cost is ``http`` against ``batcher``. Writes
docs/benchmarks/serving.md::

    .venv/bin/python benchmarks/serving.py [--requests 96] [--rows 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import base64
import io
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import httpx
import numpy as np
import torch
from PIL import Image

from client.hooks import PatchPolicy
from client.models import Example, LoadedModel, Prompt, save_tiny_model
from client.service.batching import Batcher
from client.service.http_server import HttpEndpoint, HttpSettings
from client.service.releases import ReleaseCatalogue
from client.service.rows import prepare_row
from client.settings import SiteSettings
from client.site import Site
from dpmtv_common.artifact import ReleaseDescription, write_artifact
from dpmtv_common.crypto import SigningKey
from dpmtv_common.heads import HeadSet

CLIENTS = (1, 8, 32)
QUESTION = "What colour is the shape?"
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")


def _png(index: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), COLOURS[index % len(COLOURS)]).save(buffer, format="PNG")
    return buffer.getvalue()


def _make_site(root: Path, rows: int) -> Site:
    save_tiny_model("llava", root / "model", seed=0)
    key = SigningKey.generate()
    key.verify_key.save(root / "coordinator.pub")
    settings = SiteSettings(
        name="bench",
        model_path=root / "model",
        state_dir=root / "state",
        trusted_keys=(root / "coordinator.pub",),
        batch_size=rows,
        device="cpu",
    )
    site = Site(settings)
    loaded = site.model()
    shape = loaded.adapter.head_shape(loaded.model)
    heads = HeadSet.all_heads(num_layers=shape.num_layers, num_heads=shape.num_heads)
    values = np.random.default_rng(0).standard_normal((len(heads), shape.head_dim))
    release = ReleaseDescription(
        protocol_version="1.0", release_id="r1", created="2026-01-01T00:00:00Z",
        model_fingerprint=loaded.fingerprint, task="bench", plan={"bench": True},
        epsilon=1.0, delta=1e-5, accountant="rdp", accountant_parameters={}, num_chunks=1,
        shots=1, clip_norm=1.0, noise_std=1.0,
    )  # fmt: skip
    write_artifact(
        settings.artifacts_folder / "r1", heads=heads, values=values, release=release,
        signing_key=key,
    )  # fmt: skip
    (root / "token").write_text("bench-token-" + "z" * 32)
    (root / "token").chmod(0o600)
    return site


def _no_eos(loaded: LoadedModel) -> None:
    """Every row generates exactly max_tokens (same work in all three paths)."""
    loaded.model.generation_config.eos_token_id = None


def _percentiles(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return statistics.median(ordered), p95


def _closed_loop(clients: int, requests: int, one: Callable[[int], None]) -> dict[str, float]:
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            started = time.perf_counter()
            one(index)
            with lock:
                latencies.append(time.perf_counter() - started)

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    elapsed = time.perf_counter() - began
    p50, p95 = _percentiles(latencies)
    return {"throughput": requests / elapsed, "p50": p50, "p95": p95}


def _plain(loaded: LoadedModel, clients: int, requests: int, rows: int, tokens: int) -> Any:
    batch = min(clients, rows)
    prompts = [
        Prompt.of([], Example(Image.open(io.BytesIO(_png(i))).convert("RGB"), QUESTION))
        for i in range(requests)
    ]
    times: list[float] = []
    began = time.perf_counter()
    for start in range(0, requests, batch):
        started = time.perf_counter()
        part = prompts[start : start + batch]
        inputs = loaded.adapter.build_batch_inputs(loaded.processor, part)
        with torch.no_grad():
            loaded.model.generate(  # type: ignore[operator]
                **inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                pad_token_id=loaded.processor.tokenizer.pad_token_id,
            )  # fmt: skip
        times += [time.perf_counter() - started] * len(part)
    elapsed = time.perf_counter() - began
    p50, p95 = _percentiles(times)
    return {"throughput": requests / elapsed, "p50": p50, "p95": p95, "rows_per_pass": batch}


def _batcher(site: Site, clients: int, requests: int, rows: int, tokens: int) -> Any:
    loaded = site.model()
    patch, _ = ReleaseCatalogue(site).patch("r1", PatchPolicy.PROMPT_LAST_TOKEN)
    batcher = Batcher(loaded, threading.Lock(), rows=rows, max_queue=max(64, clients))
    batcher.start()

    class Done:
        def __init__(self) -> None:
            self.event = threading.Event()

        def token(self, token_id: int) -> None:
            pass

        def finish(self, reason: str) -> None:
            self.event.set()

        def fail(self, error: Exception) -> None:
            self.event.set()

    def one(index: int) -> None:
        batcher.expect()  # as the endpoint announces a row it is preparing
        image = Image.open(io.BytesIO(_png(index))).convert("RGB")
        row = prepare_row(
            loaded, Prompt.of([], Example(image, QUESTION)), instruction=None, patch=patch,
            max_new_tokens=tokens, temperature=0.0, seed=0,
        )  # fmt: skip
        sink = Done()
        batcher.submit(row, sink, expected=True)
        sink.event.wait()

    try:
        result = _closed_loop(clients, requests, one)
    finally:
        batcher.stop()
    return result | {"rows_per_pass": batcher.stats.rows_served / max(1, batcher.stats.passes)}


def _http_clients(url: str, token: str, clients: int, requests: int, tokens: int) -> Any:
    """The HTTP clients' closed loop (run in a process of its own: its own GIL)."""
    headers = {"Authorization": "Bearer " + token}
    local = threading.local()

    def one(index: int) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=600)
        uri = "data:image/png;base64," + base64.b64encode(_png(index)).decode()
        body = {
            "model": "r1",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": uri}},
            ]}],
            "max_tokens": tokens,
        }  # fmt: skip
        reply = local.client.post(url, json=body, headers=headers)
        reply.raise_for_status()

    return _closed_loop(clients, requests, one)


def _http(site: Site, root: Path, clients: int, requests: int, tokens: int) -> Any:
    settings = HttpSettings(
        address="127.0.0.1:0", token_file=root / "token", max_queue=max(64, clients)
    )
    endpoint = HttpEndpoint(site, threading.Lock(), settings)
    url = endpoint.start() + "/v1/chat/completions"
    token = (root / "token").read_text()
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            result = pool.submit(_http_clients, url, token, clients, requests, tokens).result()
    finally:
        endpoint.stop()
    stats = endpoint.batcher.stats
    return result | {"rows_per_pass": stats.rows_served / max(1, stats.passes)}


def main() -> int:
    """Measure every path at every concurrency; write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    results: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        site = _make_site(root, args.rows)
        loaded = site.model()
        _no_eos(loaded)
        _plain(loaded, 1, 4, args.rows, args.max_tokens)  # warm-up
        for clients in CLIENTS:
            n = args.requests
            results[("plain", clients)] = _plain(loaded, clients, n, args.rows, args.max_tokens)
            results[("batcher", clients)] = _batcher(site, clients, n, args.rows, args.max_tokens)
            results[("http", clients)] = _http(site, root, clients, n, args.max_tokens)
            print(clients, {k: v for k, v in results.items() if k[1] == clients}, flush=True)
    _write(results, args)
    return 0


def _write(results: dict[tuple[str, int], dict[str, float]], args: argparse.Namespace) -> None:
    lines = [
        "# Serving: the HTTP endpoint against plain generation",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/serving.py --requests {args.requests} --rows "
        f"{args.rows} --max-tokens {args.max_tokens}` (tiny random LLaVA, float32, CPU, one "
        "torch thread, a shared 2-core machine, one run). Closed loop: each client sends its "
        f"next request when the last is answered; {args.requests} requests a cell, each a "
        f"zero-shot image query answered with exactly {args.max_tokens} tokens. `plain`: "
        "`generate()` on batches of min(clients, rows), padded to the longest, unpatched (its "
        "latency is the batch's time, no queue). `batcher`: the endpoint's batcher, every row "
        f"patched with a release (all heads), passes of {args.rows} rows always. `http`: the "
        "whole endpoint on 127.0.0.1 (httpx clients in another process, data URIs). A pass "
        "waits up to 50 ms for rows announced (being prepared) to fill it. Throughput in "
        "requests/s; latency in ms.",
        "",
        "| clients | path | throughput | vs plain | p50 | p95 | rows a pass |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for clients in CLIENTS:
        plain = results[("plain", clients)]["throughput"]
        for path in ("plain", "batcher", "http"):
            r = results[(path, clients)]
            lines.append(
                f"| {clients} | {path} | {r['throughput']:.1f} | {r['throughput'] / plain:.2f} "
                f"| {1000 * r['p50']:.0f} | {1000 * r['p95']:.0f} | {r['rows_per_pass']:.1f} |"
            )
    met = all(
        results[(path, c)]["throughput"] >= 0.9 * results[("plain", c)]["throughput"]
        for path in ("batcher", "http")
        for c in CLIENTS
    )
    lines += [
        "",
        f"Goal, patched serving within 10 % of plain throughput at every concurrency: "
        f"{'met' if met else 'not met'} in this run. Where it falls short, the causes are "
        "structural: every pass runs all its rows (the copies that keep a row's answer "
        "independent of its batch-mates cost as much as real rows, so one client pays for "
        f"{args.rows}), and on this tiny model each generation step is mostly Python, which "
        "the endpoint's threads (HTTP, image decoding, tokenising) share with the generating "
        "thread under one interpreter lock. `http` against `batcher` is the HTTP layer's own "
        "cost. The machine is shared with other work: repeated runs differ by up to 2x.",
    ]
    out = REPO / "docs" / "benchmarks" / "serving.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

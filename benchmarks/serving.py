"""Serving throughput and latency: plain ``generate()``, the batcher, the HTTP endpoint.

For each model (``--model tiny``: the tests' tiny random LLaVA; ``--model pretrained``: the
assembled SmolLM2 LLaVA of ``client.models.pretrained``) and 1, 8 and 32 clients in a closed
loop (each client sends its next request when the last is answered), every request a
zero-shot image query answered greedily with exactly ``--max-tokens`` tokens (end of sequence
suppressed, so every path does the same work). The paths alternate within each repeat:

- **plain**: ``transformers`` ``generate()`` serving the same clients, unpatched: a worker
  runs the waiting prompts in batches of ``min(clients, rows)``, padded to the longest, and
  waits for exactly that many (an ideal static batcher that knows how many clients there are);
  a request's latency includes its wait for the batches before it, as the served paths' does.
- **batcher**: :class:`client.service.batching.Batcher` in-process, every row patched with a
  stored release (all heads); each client thread prepares its row, as the endpoint does.
- **http**: the whole endpoint (:class:`client.service.http_server.HttpEndpoint`) on
  127.0.0.1, every request patched, its clients in a process of their own
  (``benchmarks/_serving_clients.py``, keep-alive HTTP/1.1 connections, images as
  data URIs); its front process (HTTP, JSON, images) runs beside the service's (the model).
  ``http`` against ``batcher`` is the HTTP layer's own cost.
- **http-floor**: the same endpoint with the model taken out (:class:`AnsweringAtOnce`):
  every request parsed, checked, prepared and started as in ``http``, then answered at once
  without a forward pass. Its throughput is the most the endpoint's own work allows.
- **invariant**: the batcher in its batch-invariant mode (each row alone), patched; at 1 and 8
  clients only (from 8 on its throughput cannot change: one row a pass).

Where the time goes is measured, not inferred: hooks on the model time every forward pass
and count the rows of each decoding step, in every path; the worker's own time (plain: inside
``generate()``; served: the batcher's joins and steps) less its forward passes is the decoding
loop's Python; the rest of the wall time the model had nothing to do. Forward passes alone
are timed by batch size too. Ratios are medians over ``--repeats`` of each repeat's
side-by-side ratio. One torch thread in every path: the cores are shared with the clients, the
endpoint's front process and other work, and a pool of one thread a core then waits on its slowest
thread at every operation. Writes docs/benchmarks/serving.md::

    .venv/bin/python benchmarks/serving.py --model tiny pretrained [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy(1)  # before torch loads; one torch thread (see the docstring)

import io

import numpy as np
import torch
from _serving_clients import QUESTION, Client, body_of, closed_loop, png
from PIL import Image
from torch import nn
from transformers import DynamicCache

from client.activations.hooks import PatchPolicy
from client.models import Example, LoadedModel, Prompt, save_tiny_model
from client.models.pretrained import default_pretrained_model_dir
from client.release.site import Site
from client.service import http_backend, http_server
from client.service.batching import Batcher
from client.service.decoding import ContinuousBatch
from client.service.http_server import HttpEndpoint, HttpSettings
from client.service.preparation import RowRequest
from client.service.releases import ReleaseCatalogue
from client.service.rows import RowPatch, Ticket
from client.settings import SiteSettings
from dpmtv_common.artifact import ReleaseDescription, write_artifact
from dpmtv_common.crypto import SigningKey
from dpmtv_common.heads import HeadSet

CLIENTS = (1, 8, 32)
INVARIANT_CLIENTS = (1, 8)
PATHS = ("plain", "batcher", "http", "invariant", "http-floor")
TOKEN = "bench-token-" + "z" * 32
MODELS = {
    "tiny": "the tests' tiny random LLaVA (2 layers x 4 heads)",
    "pretrained": "the assembled pretrained-decoder LLaVA (SmolLM2-135M: 30 layers x 9 heads)",
}

Cell = dict[str, float]


# --- the model, timed ------------------------------------------------------------------------


@dataclass
class ForwardClock:
    """Hooks on the model: time in forward passes, and the rows of each decoding step."""

    seconds: float = 0.0
    passes: int = 0
    step_rows: collections.Counter[int] = field(default_factory=collections.Counter)
    _started: float = 0.0

    def install(self, model: nn.Module) -> None:
        """Hook ``model`` (for the whole run: the counters are read as differences)."""

        def before(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            self._started = time.perf_counter()
            self.passes += 1
            ids = kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor) and ids.shape[1] == 1:
                self.step_rows[int(ids.shape[0])] += 1

        def after(module: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
            self.seconds += time.perf_counter() - self._started

        model.register_forward_pre_hook(before, with_kwargs=True)
        model.register_forward_hook(after, with_kwargs=True)

    def snapshot(self) -> tuple[float, int, collections.Counter[int], float]:
        """The counters now, and this process's CPU time."""
        return self.seconds, self.passes, collections.Counter(self.step_rows), time.process_time()


def _profile(
    clock: ForwardClock, before: tuple[float, int, Any, float], wall: float, worker: float,
    answered: int,
) -> Cell:  # fmt: skip
    seconds, passes, rows, cpu = before
    forward = clock.seconds - seconds
    steps = clock.step_rows - rows
    count = sum(steps.values())
    mean_rows = sum(k * v for k, v in steps.items()) / count if count else 0.0
    return {
        "forward": forward / wall,
        "loop": max(0.0, worker - forward) / wall,
        "idle": max(0.0, 1 - worker / wall),
        "rows_a_step": mean_rows,
        "passes": (clock.passes - passes) / answered,
        "cpu": (time.process_time() - cpu) / answered,
    }


@dataclass
class RoundClock:
    """Between batches over HTTP: from a batch's last answer sent to its next batch's rows.

    Wraps the service side (its answers to the front, the batcher's submits and joins): a
    round starts with the first answer after the model starts rows, and ends when it starts
    rows again; its gap is from the round's last answer leaving the service to the last
    request submitted before those rows start. With every client answered together (a closed
    loop in step), that gap is the clients', the front's and the link's work on the next
    requests, with no forward pass meanwhile (the worker prepares those that have arrived).
    """

    gaps: list[float] = field(default_factory=list)
    _answered: float | None = None
    _submitted: float | None = None

    def install(self) -> contextlib.ExitStack:
        """Wrap the service side's answers, submits and joins (undone on leaving)."""
        stack = contextlib.ExitStack()
        wraps = (
            (http_backend._LinkSink, "finish", self._answer),
            (Batcher, "submit", self._submit),
            (ContinuousBatch, "join", self._join),
        )
        for owner, name, record in wraps:
            timed = _after(getattr(owner, name), record)
            stack.enter_context(mock.patch.object(owner, name, timed))
        return stack

    def _answer(self) -> None:
        self._answered = time.perf_counter()

    def _submit(self) -> None:
        if self._answered is not None:
            self._submitted = time.perf_counter()

    def _join(self) -> None:
        if self._answered is not None and self._submitted is not None:
            self.gaps.append(self._submitted - self._answered)
        self._answered = self._submitted = None


def _after(method: Any, record: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            record()

    return wrapped


def _timed(latencies: list[float], elapsed: float) -> Cell:
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"throughput": len(latencies) / elapsed, "p50": statistics.median(ordered), "p95": p95}


# --- the site ---------------------------------------------------------------------------------


def _make_site(root: Path, model: str, rows: int) -> Site:
    if model == "tiny":
        save_tiny_model("llava", root / "model", seed=0)
        model_path = root / "model"
    else:
        model_path = default_pretrained_model_dir()
        if not (model_path / "assembly.json").is_file():
            raise SystemExit(
                "the pretrained model is not assembled: scripts/assemble_pretrained_model"
            )
    key = SigningKey.generate()
    key.verify_key.save(root / "coordinator.pub")
    settings = SiteSettings(
        name="bench", model_path=model_path, state_dir=root / "state",
        trusted_keys=(root / "coordinator.pub",), batch_size=rows, device="cpu",
    )  # fmt: skip
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
    (root / "token").write_text(TOKEN)
    (root / "token").chmod(0o600)
    loaded.model.generation_config.eos_token_id = None  # every answer: exactly max_tokens
    return site


def _prompt(index: int) -> Prompt:
    image = Image.open(io.BytesIO(png(index))).convert("RGB")
    return Prompt.of([], Example(image, QUESTION))


# --- the paths --------------------------------------------------------------------------------


class PlainServer:
    """``generate()`` on batches of ``min(clients, rows)`` waiting prompts, one worker."""

    def __init__(self, loaded: LoadedModel, clients: int, rows: int, tokens: int) -> None:
        self.loaded, self.rows, self.tokens = loaded, rows, tokens
        self.active = clients
        self.worker_seconds = 0.0
        self.prepared: list[float] = []  # seconds a prompt, in its batch
        self.calls = 0  # preparation calls (one a batch)
        self._waiting: list[tuple[Prompt, threading.Event]] = []
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def one(self, index: int) -> None:
        """Client side: queue request ``index`` and wait for its batch."""
        done = threading.Event()
        with self._ready:
            self._waiting.append((_prompt(index), done))
            self._ready.notify_all()
        done.wait()

    def left(self) -> None:
        """Client side: this client sends no more (batches stop waiting for it)."""
        with self._ready:
            self.active -= 1
            self._ready.notify_all()

    def _run(self) -> None:
        while True:
            with self._ready:
                while self.active and len(self._waiting) < min(self.rows, self.active):
                    self._ready.wait()
                if not self.active:
                    return
                batch, self._waiting = self._waiting[: self.rows], self._waiting[self.rows :]
            started = time.perf_counter()
            loaded = self.loaded
            inputs = loaded.adapter.build_batch_inputs(loaded.processor, [p for p, _ in batch])
            self.prepared += [(time.perf_counter() - started) / len(batch)] * len(batch)
            self.calls += 1
            with torch.no_grad():
                loaded.model.generate(  # type: ignore[operator]
                    **inputs, max_new_tokens=self.tokens, do_sample=False,
                    pad_token_id=loaded.processor.tokenizer.pad_token_id,
                )  # fmt: skip
            self.worker_seconds += time.perf_counter() - started
            for _, done in batch:
                done.set()


def _plain(site: Site, clock: ForwardClock, clients: int, n: int, args: Any) -> Cell:
    before = clock.snapshot()
    server = PlainServer(site.model(), clients, args.rows, args.max_tokens)
    latencies, elapsed = closed_loop(clients, n, args.seconds, server.one, server.left)
    profile = _profile(clock, before, elapsed, server.worker_seconds, len(latencies))
    prepared = _preparation(sum(server.prepared), len(server.prepared), server.calls)
    return _timed(latencies, elapsed) | profile | prepared


class _Done:
    def __init__(self) -> None:
        self.event = threading.Event()

    def token(self, token_id: int) -> None:
        pass

    def finish(self, reason: str) -> None:
        self.event.set()

    def fail(self, error: Exception) -> None:
        self.event.set()


def _release(site: Site) -> RowPatch | None:
    patch, _ = ReleaseCatalogue(site).patch("r1", PatchPolicy.PROMPT_LAST_TOKEN, instruction=None)
    return patch


def _batcher(
    site: Site, clock: ForwardClock, clients: int, n: int, args: Any, *, invariant: bool = False
) -> Cell:
    loaded, patch = site.model(), _release(site)
    batcher = Batcher(
        loaded, threading.Lock(), rows=args.rows, max_queue=max(64, clients),
        batch_invariant=invariant,
    )  # fmt: skip
    batcher.start()

    def one(index: int) -> None:
        batcher.expect()  # as the endpoint announces a request it is parsing
        request = RowRequest(
            loaded, _prompt(index), instruction=None, patch=patch,
            max_new_tokens=args.max_tokens, temperature=0.0, seed=0,
        )  # fmt: skip
        sink = _Done()
        batcher.submit(request, sink, expected=True).result()  # the worker prepares it
        sink.event.wait()

    before, stats = clock.snapshot(), batcher.stats
    try:
        latencies, elapsed = closed_loop(clients, n, args.seconds, one)
    finally:
        batcher.stop()
    cell = _timed(latencies, elapsed) | _profile(
        clock, before, elapsed, stats.worker_seconds, len(latencies)
    )
    return cell | _preparation(stats.prepare_seconds, stats.prepared, stats.prepare_calls)


def _preparation(seconds: float, prepared: int, calls: int) -> Cell:
    """Seconds of preparation a request, and requests a preparation call (the worker's)."""
    return {"prepare": seconds / max(1, prepared), "prepared_together": prepared / max(1, calls)}


class AnsweringAtOnce(Batcher):
    """The endpoint's batcher with the model taken out (``http-floor``).

    Rows are prepared and started exactly as the batcher prepares and starts them, then each
    is answered at once with ``max_new_tokens`` copies of one token, no forward pass: the
    throughput the endpoint's own work (HTTP, JSON, images, preparation, answers) allows.
    """

    def _run(self) -> None:
        token = int(self.loaded.processor.tokenizer(" red")["input_ids"][-1])
        while True:
            self._prepare_pending()
            if (tickets := self._take()) is None:
                return
            if not tickets:  # requests arrived to be prepared first
                continue
            started = time.monotonic()
            for ticket in tickets:
                _answer_at_once(ticket, token)
            self._ended = (started, time.monotonic())
            self.stats.worker_seconds += time.monotonic() - started


def _answer_at_once(ticket: Ticket, token: int) -> None:
    for _ in range(ticket.row.max_new_tokens):
        ticket.sink.token(token)
    ticket.sink.finish("length")


def _http(
    site: Site, root: Path, clock: ForwardClock, clients: int, n: int, args: Any,
    *, model: bool = True,
) -> Cell:  # fmt: skip
    settings = HttpSettings(
        address="127.0.0.1:0", token_file=root / "token", max_queue=max(64, clients),
        max_connections=max(256, 2 * clients),
    )  # fmt: skip
    with mock.patch.object(http_server, "Batcher", Batcher if model else AnsweringAtOnce):
        endpoint = HttpEndpoint(site, threading.Lock(), settings)
    rounds = RoundClock()
    url = endpoint.start() + "/v1/chat/completions"
    job = {"url": url, "token": TOKEN, "clients": clients, "requests": n,
           "seconds": args.seconds, "tokens": args.max_tokens, "model": "r1"}  # fmt: skip
    try:
        client = Client(job)  # untimed: the release is verified on first use
        client.ask(client.request(body_of(job, 0)))
        client.close()
        stats = endpoint.batcher.stats
        before, worked = clock.snapshot(), stats.worker_seconds
        prep = (stats.prepare_seconds, stats.prepared, stats.prepare_calls)
        front = _process_cpu(endpoint.front)
        with rounds.install():
            done = subprocess.run(  # noqa: S603 (our own script, no input of anyone's)
                [sys.executable, str(REPO / "benchmarks" / "_serving_clients.py")],
                input=json.dumps(job), capture_output=True, text=True, check=True,
            )  # fmt: skip
        front = _process_cpu(endpoint.front) - front
    finally:
        endpoint.stop()
    result = json.loads(done.stdout)
    worker = endpoint.batcher.stats.worker_seconds - worked
    elapsed = result["elapsed"]
    answered = len(result["latencies"])
    profile = _profile(clock, before, elapsed, worker, answered)
    prepared = _preparation(
        stats.prepare_seconds - prep[0], stats.prepared - prep[1], stats.prepare_calls - prep[2]
    )
    cell = _timed(result["latencies"], elapsed) | profile | prepared
    service = cell["cpu"]  # this process: the model, the batcher, the link's reader
    gap = statistics.median(rounds.gaps) if rounds.gaps else float("nan")
    return cell | {
        "client_cpu": result["cpu"] / answered, "front_cpu": front / answered,
        "service_cpu": service, "cpu": service + front / answered, "round_gap": gap,
    }  # fmt: skip


def _process_cpu(process: subprocess.Popen[bytes] | None) -> float:
    """CPU seconds (user and system) ``process`` has used so far (Linux /proc)."""
    if process is None:
        raise RuntimeError("the endpoint's front process must be running.")
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- forward passes alone ---------------------------------------------------------------------


def _pass_costs(site: Site, tokens: int) -> dict[str, float]:
    """Median ms of one forward pass: prefills of 1 and 8 prompts, steps of 1, 8 and 32 rows."""
    loaded = site.model()
    model = loaded.model
    out: dict[str, float] = {}
    for rows in (1, 8, 32):
        inputs = loaded.adapter.build_batch_inputs(
            loaded.processor, [_prompt(i) for i in range(rows)]
        )
        times: dict[str, list[float]] = {"prefill": [], "step": []}
        for _ in range(3):
            with torch.no_grad():
                cache = DynamicCache()
                started = time.perf_counter()
                output = model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
                times["prefill"].append(time.perf_counter() - started)
                length = int(inputs["input_ids"].shape[1])
                step = {
                    "input_ids": output.logits[:, -1].argmax(-1, keepdim=True),
                    "position_ids": torch.full((rows, 1), length),
                    "cache": cache,
                    "use_cache": True,
                    "logits_to_keep": 1,
                }
                started = time.perf_counter()
                model(**step)
                times["step"].append(time.perf_counter() - started)
        if rows in (1, 8):
            out[f"prefill {rows}"] = 1000 * statistics.median(times["prefill"])
        out[f"step {rows}"] = 1000 * statistics.median(times["step"])
    return out


# --- the run ----------------------------------------------------------------------------------


def _requests(clients: int, args: Any) -> int:
    return max(args.min_requests, args.per_client * clients)


def _run_model(model: str, args: Any) -> dict[str, Any]:
    results: dict[tuple[str, int], list[Cell]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        site = _make_site(root, model, args.rows)
        clock = ForwardClock()
        clock.install(site.model().model)
        costs = _pass_costs(site, args.max_tokens)
        warm = argparse.Namespace(**(vars(args) | {"seconds": 0.0}))
        _plain(site, clock, 1, 2, warm)  # warm-up
        _batcher(site, clock, 1, 2, warm)
        for clients in CLIENTS:
            n = _requests(clients, args)
            for repeat in range(args.repeats):
                results[("plain", clients)].append(_plain(site, clock, clients, n, args))
                results[("batcher", clients)].append(_batcher(site, clock, clients, n, args))
                results[("http", clients)].append(_http(site, root, clock, clients, n, args))
                if clients in INVARIANT_CLIENTS:
                    results[("invariant", clients)].append(
                        _batcher(site, clock, clients, n, args, invariant=True)
                    )
                results[("http-floor", clients)].append(
                    _http(site, root, clock, clients, n, args, model=False)
                )
                line = {p: round(c[-1]["throughput"], 2) for (p, k), c in results.items()
                        if k == clients}  # fmt: skip
                print(model, clients, repeat, line, flush=True)
    return {"results": results, "costs": costs}


def _median_ratio(cells: list[Cell], plain: list[Cell], key: str) -> float:
    return statistics.median(c[key] / p[key] for c, p in zip(cells, plain, strict=True))


def _med(cells: list[Cell], key: str) -> float:
    return statistics.median(c[key] for c in cells)


def main() -> int:
    """Measure every path at every concurrency on each model; write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", nargs="+", choices=sorted(MODELS), default=["tiny", "pretrained"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-client", type=int, default=2, help="fewest requests a client")
    parser.add_argument("--min-requests", type=int, default=4, help="fewest requests a cell")
    parser.add_argument("--seconds", type=float, default=3.0, help="shortest cell (s)")
    parser.add_argument("--rows", type=int, default=8, help="most rows generated at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "serving.md")
    parser.add_argument(
        "--render-only", action="store_true",
        help="rewrite the report from the measurements kept beside it (its .json); measure nothing",
    )  # fmt: skip
    args = parser.parse_args()
    kept = args.out.with_suffix(".json")
    if args.render_only:
        measured, args = _measured_from_json(json.loads(kept.read_text()), args.out)
    else:
        measured = {}
        for model in args.model:  # kept as each model ends: a later failure loses none of it
            measured[model] = _run_model(model, args)
            kept.write_text(json.dumps(_measured_to_json(measured, args), indent=1) + "\n")
    text = _report(measured, args)
    args.out.write_text(text)
    print(text)
    return 0


_REPORT_ARGS = ("repeats", "per_client", "min_requests", "seconds", "rows", "max_tokens")


def _measured_to_json(measured: dict[str, dict[str, Any]], args: Any) -> dict[str, Any]:
    """Every cell of every repeat, the pass costs and the settings the report quotes."""
    return {
        "args": {name: getattr(args, name) for name in _REPORT_ARGS},
        "models": {
            model: {
                "costs": data["costs"],
                "cells": [
                    {"path": path, "clients": clients, "repeats": cells}
                    for (path, clients), cells in data["results"].items()
                ],
            }
            for model, data in measured.items()
        },
    }


def _measured_from_json(kept: dict[str, Any], out: Path) -> tuple[dict[str, Any], Any]:
    """What :func:`_measured_to_json` kept, as :func:`_report` reads it, and its settings."""
    measured = {
        model: {
            "costs": data["costs"],
            "results": {(c["path"], int(c["clients"])): c["repeats"] for c in data["cells"]},
        }
        for model, data in kept["models"].items()
    }
    return measured, argparse.Namespace(**kept["args"], out=out)


# --- the report -------------------------------------------------------------------------------


def _goal(results: dict[tuple[str, int], list[Cell]], path: str) -> tuple[bool, str]:
    """Whether ``path`` meets the goal against plain, and its figures."""
    ratios = {c: _median_ratio(results[(path, c)], results[("plain", c)], "throughput")
              for c in CLIENTS}  # fmt: skip
    p95 = _median_ratio(results[(path, 32)], results[("plain", 32)], "p95")
    met = all(r >= 0.9 for r in ratios.values()) and p95 <= 1.5
    figures = ", ".join(f"{r:.2f} at {c}" for c, r in ratios.items())
    verdict = "met" if met else "not met"
    return met, f"**{verdict}** (throughput {figures} clients; p95 at 32 clients {p95:.2f}x)"


def _cpu_ratios(results: dict[tuple[str, int], list[Cell]], path: str) -> str:
    """Plain's CPU a request over ``path``'s, at each concurrency."""
    ratios = [_median_ratio(results[("plain", c)], results[(path, c)], "cpu") for c in CLIENTS]
    return " / ".join(f"{r:.2f}" for r in ratios)


def _table(results: dict[tuple[str, int], list[Cell]]) -> list[str]:
    lines = [
        "| clients | path | requests/s | vs plain | p50 ms | p95 ms | p95 vs plain "
        "| CPU ms a request | vs plain | rows a step | passes a request | forward | loop | idle |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for clients in CLIENTS:
        plain = results[("plain", clients)]
        for path in PATHS:
            cells = results.get((path, clients))
            if not cells:
                continue
            # A path without the model is no rival to plain: its ratios would mean nothing.
            ratio = _no_ratio if path == "http-floor" else _ratio_text
            lines.append(
                f"| {clients} | {path} | {_med(cells, 'throughput'):.2f} "
                f"| {ratio(cells, plain, 'throughput')} "
                f"| {1000 * _med(cells, 'p50'):.0f} | {1000 * _med(cells, 'p95'):.0f} "
                f"| {ratio(cells, plain, 'p95')} | {1000 * _med(cells, 'cpu'):.0f} "
                f"| {ratio(plain, cells, 'cpu')} | {_med(cells, 'rows_a_step'):.1f} "
                f"| {_med(cells, 'passes'):.2f} "
                f"| {_med(cells, 'forward'):.0%} | {_med(cells, 'loop'):.0%} "
                f"| {_med(cells, 'idle'):.0%} |"
            )
    return lines


def _ratio_text(cells: list[Cell], other: list[Cell], key: str) -> str:
    return f"{_median_ratio(cells, other, key):.2f}"


def _no_ratio(cells: list[Cell], other: list[Cell], key: str) -> str:
    return "n/a"


def _model_ms(cells: list[Cell]) -> float:
    """The model's forward time a request: its share of the wall time over the throughput."""
    return 1000 * statistics.median(c["forward"] / c["throughput"] for c in cells)


def _forward_ms(cells: list[Cell]) -> str:
    """``"a (b)"``: the model's forward ms a request, and a forward pass's."""
    request = _model_ms(cells)
    return f"{request:.0f} ({request / _med(cells, 'passes'):.1f})"


def _slashed(values: dict[int, float], spec: str) -> str:
    """``values`` at 1 / 8 / 32 clients, each formatted with ``spec``, slash-separated."""
    return " / ".join(format(values[c], spec) for c in CLIENTS)


def _floor_line(results: dict[tuple[str, int], list[Cell]]) -> str:
    """The endpoint without its model: what each process spends a request, beside the model."""
    floor = {c: _med(results[("http-floor", c)], "throughput") for c in CLIENTS}
    plain = {c: _med(results[("plain", c)], "throughput") for c in CLIENTS}
    front = {c: 1000 * _med(results[("http-floor", c)], "front_cpu") for c in CLIENTS}
    # The service process's part, beyond preparing the request (which plain's request holds).
    service = {
        c: 1000 * (_med(results[("http-floor", c)], "service_cpu")
                   - _med(results[("http-floor", c)], "prepare"))
        for c in CLIENTS
    }  # fmt: skip
    return (
        "- The endpoint's own work, measured without the model (`http-floor`: the same "
        "endpoint, requests prepared and started as the batcher does, each answered at once "
        "with no forward pass): "
        + _slashed(floor, ".0f")
        + " requests/s at 1 / 8 / 32 clients; CPU a request, the front's process "
        + _slashed(front, ".1f")
        + " ms, the service process beyond preparing the request "
        + _slashed(service, ".1f")
        + " ms, beside plain's whole request (preparation included) of "
        + _slashed({c: 1000 / plain[c] for c in CLIENTS}, ".1f")
        + " ms. Only the service process's part runs in turn with the model's work (one "
        "interpreter lock); the front's runs on the other core."
    )


def _split_line(results: dict[tuple[str, int], list[Cell]]) -> str:
    """Where http's wall time a request goes beside plain's, where http falls furthest behind."""
    ratios = {c: _median_ratio(results[("http", c)], results[("plain", c)], "throughput")
              for c in CLIENTS}  # fmt: skip
    worst = min(ratios, key=lambda c: ratios[c])

    def split(path: str) -> str:
        cells = results[(path, worst)]
        wall = 1000 / _med(cells, "throughput")  # ms of wall time a request
        parts = ", ".join(
            f"{part} {wall * _med(cells, part):.2f}" for part in ("forward", "loop", "idle")
        )
        return f"{path} {wall:.2f} ({parts}; {_med(cells, 'passes'):.2f} passes)"

    http = results[("http", worst)]
    front = 1000 * _med(http, "front_cpu")
    gap = (
        f" Between batches (`http`, {worst} clients), the last request of a batch reached the "
        f"batcher a median {1000 * _med(http, 'round_gap'):.1f} ms after the last answer of the "
        "batch before it left the service"
    )
    if worst > 1:
        gap += (
            ", with no forward pass meanwhile (the worker waits for every request announced, "
            "then prepares them together): the clients answered in one decoding step (a "
            "batch's rows) ask again together, the front handles their requests one after another "
            f"({front:.2f} ms of CPU a request, {worst * front:.1f} ms for {worst}) and sends "
            "them on once it has no more to do, and the service checks each again."
        )
    else:
        gap += " (the client's next request through the front and the link)."
    return (
        f"- Where `http` falls furthest behind plain ({ratios[worst]:.2f} at {worst} clients), "
        "the wall time a request, ms: "
        + "; ".join(split(path) for path in ("plain", "batcher", "http"))
        + ". Each path's forward passes, decoding loop and idle time, measured as in the "
        "table." + gap
    )


def _causes(measured: dict[str, Any]) -> list[str]:
    results, costs = measured["results"], measured["costs"]
    per_row = {rows: costs[f"step {rows}"] / rows for rows in (1, 8, 32)}
    model_ms = {
        path: " / ".join(_forward_ms(results[(path, c)]) for c in CLIENTS)
        for path in ("plain", "batcher", "http")
    }
    http = {c: _median_ratio(results[("http", c)], results[("batcher", c)], "throughput")
            for c in CLIENTS}  # fmt: skip
    added = 1000 * (_med(results[("http", 1)], "p50") - _med(results[("batcher", 1)], "p50"))
    extra = {c: _med(results[("http", c)], "service_cpu") - _med(results[("batcher", c)], "cpu")
             for c in CLIENTS}  # fmt: skip
    invariant = {c: _median_ratio(results[("invariant", c)], results[("plain", c)], "throughput")
                 for c in INVARIANT_CLIENTS}  # fmt: skip
    return [
        "- Forward passes alone (ms, median of 3): "
        + ", ".join(f"{name} {ms:.0f}" for name, ms in costs.items())
        + f". A decoding step costs {per_row[1]:.1f} ms a row alone, {per_row[8]:.1f} in a "
        f"step of 8 and {per_row[32]:.1f} in a step of 32: what batching can gain, and where "
        "it stops gaining.",
        "- The model's forward time a request, and in brackets a forward pass's, at 1 / 8 / "
        "32 clients (ms): "
        + "; ".join(f"{path} {ms}" for path, ms in model_ms.items())
        + ". With as many passes a request and rows a step as plain's (table), a served "
        "request costs the model more only where its passes ran slower: beside the work of "
        "the clients' threads (in-process, under the worker's interpreter lock) or of the "
        "endpoint's front process and the clients' process (http), which share the cores.",
        "- Preparing a request (render and tokenise its prompt, process its image), ms a "
        "request and in brackets requests prepared in one round, at 1 / 8 / 32 clients: "
        + "; ".join(
            f"{path} "
            + " / ".join(
                f"{1000 * _med(results[(path, c)], 'prepare'):.2f} "
                f"({_med(results[(path, c)], 'prepared_together'):.1f})"
                for c in CLIENTS
            )
            for path in ("plain", "batcher", "http")
        )
        + ". Each path prepares in its worker, between passes: plain a batch in one processor "
        "call, the batcher every request waiting when it looks (in one call for those that "
        "tokenise alike).",
        "- The HTTP layer's own cost (HTTP parsing, JSON, base64 and image decoding in the "
        "endpoint's front process, beside the model's process; in the service process, the "
        "link's frames and naming the release; the clients in a process of their own on the "
        "same cores): http against the in-process batcher "
        + ", ".join(f"{r:.2f} at {c}" for c, r in http.items())
        + f" clients; at one client it adds {added:.0f} ms to a request's p50. CPU a request "
        "at 1 / 8 / 32 clients (ms): the front's process "
        + _slashed({c: 1000 * _med(results[("http", c)], "front_cpu") for c in CLIENTS}, ".1f")
        + ", the service process over the in-process batcher's "
        + _slashed({c: 1000 * extra[c] for c in CLIENTS}, "+.1f")
        + ", the HTTP clients' own process "
        + _slashed({c: 1000 * _med(results[("http", c)], "client_cpu") for c in CLIENTS}, ".1f")
        + ", beside the model's forward time a request of "
        + _slashed({c: _model_ms(results[("batcher", c)]) for c in CLIENTS}, ".0f")
        + ": the front's work runs on the other core, beside the model's, not in turn with "
        "it.",
        _floor_line(results),
        _split_line(results),
        "- Batch-invariant answers (each row alone): "
        + ", ".join(f"{r:.2f}x plain's throughput at {c}" for c, r in invariant.items())
        + " clients.",
    ]


def _report(measured: dict[str, dict[str, Any]], args: Any) -> str:
    models = " ".join(measured)
    lines = [
        "# Serving: the HTTP endpoint against plain generation",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/serving.py --model {models} --repeats "
        f"{args.repeats} --per-client {args.per_client} --min-requests {args.min_requests} "
        f"--seconds {args.seconds:g} "
        f"--rows {args.rows} --max-tokens {args.max_tokens}` (float32, CPU, one torch thread, "
        "a 2-core machine shared with other work; the paths alternate within each repeat, and "
        "every figure is the median over repeats, ratios of each repeat's side-by-side pair). "
        "Closed loop: each client sends its next request when the last is answered; "
        f"a cell sends at least max({args.min_requests}, {args.per_client} x clients) requests "
        f"and goes on for at least {args.seconds:g} s; each request a "
        f"zero-shot image query answered with exactly {args.max_tokens} tokens. `plain`: "
        "`generate()` serving the same clients, unpatched, in batches of min(clients, "
        f"{args.rows}) prompts (it waits for exactly that many: an ideal static batcher); a "
        "request's latency includes its wait for the batches before it. `batcher`: the "
        f"endpoint's continuous batcher in-process (at most {args.rows} rows at once), every "
        "row patched with a release (all heads). `http`: the whole endpoint on 127.0.0.1 "
        "(its front process parsing HTTP and decoding images beside the model's process; "
        "keep-alive clients in another process, bodies encoded before the clock starts, data "
        "URIs), patched. `invariant`: the batcher's batch-invariant mode, patched. "
        "`http-floor`: the same endpoint without the model (each request prepared as in "
        "`http`, then answered at once, no forward pass). `CPU ms a request`: this "
        "process's CPU time (the "
        "model, the batcher, the link's reader, the in-process clients), and for `http` and "
        "`http-floor` the endpoint's front process's too (HTTP, JSON, images; not the HTTP "
        "clients' process), over requests answered, which other jobs on the machine inflate far "
        "less than wall time; its `vs plain` is plain's over the path's (above 1: the path "
        "costs less). `rows a step`: mean rows of a decoding step; `passes "
        "a request`: forward passes (prefills and steps) over requests answered. Of the "
        "wall time: `forward` in the model's forward passes (timed by hooks on the model), "
        "`loop` in the worker around them (plain: preparing its batch and the rest of "
        "`generate()`; served: preparing the waiting requests, the batcher's joins, cache "
        "cuts, masks and token choices), `idle` with nothing to run (requests being parsed "
        "or in transit).",
    ]
    for model, data in measured.items():
        _, over_http = _goal(data["results"], "http")
        _, in_process = _goal(data["results"], "batcher")
        lines += [
            "",
            f"## {model}: {MODELS[model]}",
            "",
            *_table(data["results"]),
            "",
            "Goal (patched serving >= 0.9x plain throughput at 1, 8 and 32 clients, p95 at 32 "
            f"clients <= 1.5x plain's): over HTTP {over_http}; the batcher in-process "
            f"{in_process}. CPU a request, plain's over the path's, at 1 / 8 / 32 clients: "
            f"batcher {_cpu_ratios(data['results'], 'batcher')}; "
            f"http {_cpu_ratios(data['results'], 'http')}.",
            "",
            "Where the time goes, measured in this run:",
            "",
            *_causes(data),
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

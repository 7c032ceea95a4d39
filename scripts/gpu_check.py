"""Run the whole site path on a CUDA device and say what works: one script, under 10 minutes.

    python scripts/gpu_check.py [--device cuda] [--dtype bfloat16] [--out gpu-check.json]

Steps, each timed, each through the same code a site admin runs (``dpmtv-site`` in-process):

1. **exact**: every registered architecture, tiny, on the device in float32 and the chosen
   dtype: patching every head with the model's own activations reproduces its logits exactly.
2. **data check**: ``dpmtv-site data check`` with the embedded model on the device.
3. **extract + release**: ``dpmtv-site release`` (private selection, epsilon 1) on a
   synthetic site of 200 records; the clip norm comes from public data.
4. **infer** and **evaluate**: ``dpmtv-site infer`` on one test image, ``evaluate`` in
   zero-shot and artifact modes.
5. **latency**: median seconds a query, plain and patched, batch 1 and 8, and the peak GPU
   memory.

Exit status 0 when every step passed. The JSON written to ``--out`` holds every number; see
docs/gpu.md for what to expect and what to do when a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights are local; never wait on the hub
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import torch  # after the environment above: transformers reads it on import

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.activations.hooks import PatchPolicy, capture_last_token_heads, patch_heads
from client.cli.main import main as site_cli
from client.data.records import load_dataset
from client.data.synthetic import write_task_datasets
from client.inference.answers import TaskVectorPatch, generate_answers
from client.models import (
    ALL_TINY_ARCHITECTURES,
    Example,
    Prompt,
    adapter_for,
    build_tiny_model,
    load_model,
)
from client.models.embedded import EMBEDDED_MODEL_DIR
from client.public.selection import public_activations

Results = dict[str, Any]


def _cli(*args: str) -> None:
    code = site_cli(list(args))
    if code != 0:
        raise RuntimeError(f"dpmtv-site {args[0]} exited {code}")


def check_exact(device: str, dtype: torch.dtype) -> Results:
    """No-op patch on every tiny architecture, on the device, in float32 and ``dtype``."""
    from PIL import Image

    prompt = Prompt(
        (Example(Image.new("RGB", (56, 56), "red"), "What colour?", "red"),),
        Example(Image.new("RGB", (60, 52), "blue"), "What colour?"),
    )
    out: Results = {}
    for arch in ALL_TINY_ARCHITECTURES:
        model, processor = build_tiny_model(arch, seed=0)
        adapter = adapter_for(model)
        for kind in dict.fromkeys((torch.float32, dtype)):
            cast(torch.nn.Module, model).to(device=device, dtype=kind)
            inputs = adapter.build_batch_inputs(processor, [prompt]).to(device)
            heads = adapter.head_shape(model).all_heads()
            with torch.no_grad(), capture_last_token_heads(model, adapter) as capture:
                clean = model(**inputs).logits
            rows = heads.to_array()
            values = capture.activations()[0, rows[:, 0], rows[:, 1]]
            policy = PatchPolicy.EVERY_CALL
            with torch.no_grad(), patch_heads(model, adapter, heads, values, policy=policy):
                patched = model(**inputs).logits
            out[f"{arch}/{str(kind).removeprefix('torch.')}"] = bool(torch.equal(patched, clean))
    failed = [name for name, ok in out.items() if not ok]
    if failed:
        raise RuntimeError(f"no-op patch not exact on {failed}")
    return out


def _clip_norm(model: Path, public: Path, device: str, dtype: str) -> float:
    """C from PUBLIC data: the median per-layer norm of all heads (as scripts/demo does)."""
    loaded = load_model(model, device=device, dtype=dtype)
    chunks = make_chunks(load_dataset(public), shots=4, seed=0).chunks
    activations = public_activations(loaded, chunks, progress=False)
    return float(activations.flatten(2).norm(dim=-1).median())


def run_site_path(work: Path, device: str, dtype: str) -> Results:
    """Data check, release, infer and evaluate through the CLI, on the device."""
    data = write_task_datasets(
        work / "data", task="shape", sites=1, per_site=200, public=100, test=100, seed=0
    )
    model = str(EMBEDDED_MODEL_DIR)
    on = ("--model", model, "--device", device, "--dtype", dtype)
    _cli("keygen", "--out-dir", str(work / "keys"))
    timings: Results = {}

    def timed(name: str, *args: str) -> None:
        started = time.perf_counter()
        _cli(*args)
        timings[name] = round(time.perf_counter() - started, 2)

    timed("data check", "data", "check", str(data["site-0"]), *on)
    clip = _clip_norm(EMBEDDED_MODEL_DIR, data["public"], device, dtype)
    artifact = work / "artifact"
    timed(
        "extract + release",
        "release", *on, "--data", str(data["site-0"]), "--out", str(artifact),
        "--clip-norm", f"{clip:.6g}", "--epsilon", "1", "--selection", "private",
        "--heads", "4", "--shots", "4", "--signing-key", str(work / "keys" / "site.key"),
        "--ledger", str(work / "site.sqlite"),
    )  # fmt: skip
    trusted = ("--trusted-key", str(work / "keys" / "site.pub"))
    test = load_dataset(data["test"]).records[0]
    timed(
        "infer",
        "infer", *on, "--artifact", str(artifact), *trusted,
        "--image", str(test.image_path), "--question", test.question,
    )  # fmt: skip
    for mode in ("zero-shot", "artifact"):
        extra = ("--artifact", str(artifact), *trusted) if mode == "artifact" else ()
        timed(f"evaluate {mode}", "evaluate", *on, "--data", str(data["test"]), "--mode", mode,
              *extra)  # fmt: skip
    return {"clip_norm": clip, "seconds": timings}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # kernels run asynchronously: time their end, not their launch


def _median_seconds(run: Callable[[], object], repeats: int = 20) -> float:
    run()  # warm-up (kernels, caches)
    timings = []
    for _ in range(repeats):
        _synchronize()
        started = time.perf_counter()
        run()
        _synchronize()
        timings.append(time.perf_counter() - started)
    return round(statistics.median(timings), 5)


def measure_latency(work: Path, device: str, dtype: str) -> Results:
    """Median seconds a generate() call (3 new tokens), plain and patched, batch 1 and 8."""
    loaded = load_model(EMBEDDED_MODEL_DIR, device=device, dtype=dtype)
    records = load_dataset(work / "data" / "test").records[:8]
    shape = loaded.adapter.head_shape(loaded.model)
    heads = shape.all_heads()
    patch = TaskVectorPatch(heads, torch.zeros(len(heads), shape.head_dim))
    on_gpu = loaded.model.device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    out: Results = {"model_device": str(loaded.model.device), "model_dtype": loaded.dtype_name}
    for batch in (1, 8):
        prompts = [zero_shot_prompt(r) for r in records[:batch]]
        for name, chosen in (("plain", None), ("patched", patch)):
            run = partial(
                generate_answers, loaded, prompts, patch=chosen, max_new_tokens=3, batch_size=batch
            )
            out[f"{name} batch {batch}"] = _median_seconds(run)
    if on_gpu:
        out["peak_gpu_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main() -> int:
    """Run every step; print and write the results; 0 when all passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cpu runs the same steps (a dry run)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    args = parser.parse_args()
    on_cpu = torch.device(args.device).type == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; install a CUDA build of torch.")
        return 2
    results: Results = {
        "device": "cpu" if on_cpu else torch.cuda.get_device_name(torch.device(args.device)),
        "torch": torch.__version__,
        "steps": {},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dpmtv-gpu-check-") as tmp:
        work = Path(tmp)
        dtype: torch.dtype = getattr(torch, args.dtype)
        steps: dict[str, Callable[[], Results]] = {
            "exact": lambda: check_exact(args.device, dtype),
            "site path": lambda: run_site_path(work, args.device, args.dtype),
            "latency": lambda: measure_latency(work, args.device, args.dtype),
        }
        for name, step in steps.items():
            try:
                results["steps"][name] = {"ok": True, **step()}
            except Exception as exc:  # report every step, then fail at the end
                traceback.print_exc()
                results["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0 if all(step["ok"] for step in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

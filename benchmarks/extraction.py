"""Per-chunk extraction time and patched/plain inference latency, per model.

For the tiny random LLaVA of the tests and for the embedded model: the median time to extract
one chunk (K-shot forward, last-token capture, per-layer clip; batches of 4, 5 repeats), and
the median per-query latency of plain zero-shot generation vs the same with a task vector
patched in (batch 1, 3 new tokens, 20 repeats, one run, side by side). Writes
docs/benchmarks/extraction.md.

    .venv/bin/python benchmarks/extraction.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import torch

from client.activations.chunking import make_chunks
from client.activations.extraction import extract_clipped_sum, zero_shot_prompt
from client.activations.hooks import PatchPolicy
from client.data.records import load_dataset
from client.data.synthetic import write_task_datasets
from client.inference.answers import TaskVectorPatch, generate_answers
from client.models import load_model, save_tiny_model
from client.models.embedded import EMBEDDED_MODEL_DIR
from dpmtv_common.heads import HeadSet

CHUNKS, SHOTS, REPEATS = 40, 4, 5


def median_seconds(run, repeats: int) -> float:
    run()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def measure(model_dir: Path, data: Path) -> dict[str, float]:
    loaded = load_model(model_dir, device="cpu")
    shape = loaded.adapter.head_shape(loaded.model)
    heads = shape.all_heads()
    dataset = load_dataset(data)
    chunks = make_chunks(dataset, shots=SHOTS, seed=0, max_chunks=CHUNKS).chunks
    per_chunk = median_seconds(
        lambda: extract_clipped_sum(loaded, chunks, heads=heads, clip_norm=1.0, progress=False),
        REPEATS,
    ) / len(chunks)
    query = [zero_shot_prompt(dataset.records[0])]
    few = HeadSet(heads.heads[:4])
    patch = TaskVectorPatch(few, torch.zeros(len(few), shape.head_dim), PatchPolicy.EVERY_CALL)
    plain = median_seconds(lambda: generate_answers(loaded, query, max_new_tokens=3), 20)
    patched = median_seconds(
        lambda: generate_answers(loaded, query, patch=patch, max_new_tokens=3), 20
    )
    return {"per_chunk": per_chunk, "plain": plain, "patched": patched}


def main() -> int:
    apply_thread_policy(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_task_datasets(
            root, task="colour", sites=1, per_site=CHUNKS * (SHOTS + 1), public=0, test=0, seed=0
        )
        save_tiny_model("llava", root / "tiny", seed=0)
        rows = {
            "tiny random LLaVA (tests)": measure(root / "tiny", root / "site-0"),
            "embedded shapes VLM": measure(EMBEDDED_MODEL_DIR, root / "site-0"),
        }
    lines = [
        "# Extraction and inference cost",
        "",
        "Reproduce: `.venv/bin/python benchmarks/extraction.py` (2 CPU cores, one run, side by "
        f"side). Extraction: {CHUNKS} chunks of K={SHOTS}+1 images, batches of 4, every head "
        f"captured and clipped per layer; median of {REPEATS} repeats, divided by the chunk "
        "count. Latency: one zero-shot query, greedy, 3 new tokens, median of 20; the patch "
        "overwrites 4 heads at every forward call (MTV's policy, the costlier one).",
        "",
        "| model | extraction per chunk (ms) | plain query (ms) | patched query (ms) | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {1000 * r['per_chunk']:.1f} | {1000 * r['plain']:.1f} | "
            f"{1000 * r['patched']:.1f} | {r['patched'] / r['plain']:.3f} |"
        )
    out = REPO / "docs" / "benchmarks" / "extraction.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-query latency: plain zero-shot, patched zero-shot, K-shot ICL (median of 20, batch 1)."""

from __future__ import annotations

import statistics
import time

from client.activations.extraction import zero_shot_prompt
from client.activations.hooks import PatchPolicy
from client.evaluation.run import icl_prompts
from client.inference.answers import TaskVectorPatch, generate_answers

REPEATS = 20


def _median_seconds(run) -> float:
    run()  # warm-up
    timings = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def per_query_latency(bench, test, support) -> dict[str, float]:
    import numpy as np
    import torch

    loaded = bench.loaded
    query = [zero_shot_prompt(test[0])]
    icl = icl_prompts(test[:1], support, shots=bench.shots, seed=0)
    shape = loaded.adapter.head_shape(loaded.model)
    values = torch.as_tensor(
        np.zeros((len(bench.public_heads), shape.head_dim)), dtype=torch.float32
    )
    patch = TaskVectorPatch(bench.public_heads, values, PatchPolicy.PROMPT_LAST_TOKEN)
    return {
        "zero-shot": _median_seconds(lambda: generate_answers(loaded, query, max_new_tokens=3)),
        "patched zero-shot": _median_seconds(
            lambda: generate_answers(loaded, query, patch=patch, max_new_tokens=3)
        ),
        f"{bench.shots}-shot ICL": _median_seconds(
            lambda: generate_answers(loaded, icl, max_new_tokens=3)
        ),
    }

"""First-token accuracy against the answer a user reads, on one release the demo made.

The benchmarks score a patched model by its first greedy token (one forward pass a noise
draw); the product's own ``evaluate`` scores the whole first answer span. They differ where a
patched model names the answer and then goes on. This script measures both on a finished
``scripts/demo`` run (its site 0's verified artifact, its centre, its data), for:

* the private release as stored;
* the public data alone (the centre in the same heads);
* the non-private mean of ``--chunks`` chunks of one site's data in the same heads, unclipped
  (what no noise and no clipping would give), to tell the noise's share from the vector's;
* that mean in MTV's own selection: the 16 heads attribution ranks first on 30 queries of
  another site (non-private, an oracle for the private task), to tell the heads' share;
* site 0's own 4-shot ICL (no patch), what a site has without any release;
* each patch with the answer's end learnt from the run's PUBLIC sets of other tasks
  (``client.inference.answer_end``: patched at the first decoding step, no privacy cost).

Writes ``docs/benchmarks/answer-span.md`` (and ``.json``; ``--out`` for another name)::

    scripts/demo --model M --heads 16 --sites 10 --per-site 200 --workdir RUN
    .venv/bin/python benchmarks/answer_span.py --run RUN --model M      # ~3 min on 2 cores
    .venv/bin/python benchmarks/answer_span.py --run RUN --model M --policy every-call \
        --out docs/benchmarks/answer-span-every-call
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads

import numpy as np
import torch

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.activations.hooks import PatchPolicy
from client.data.records import Record, load_dataset
from client.evaluation import EvaluationMode, evaluate, icl_prompts
from client.evaluation.first_token import QuerySet
from client.inference.answer_end import learn_answer_end
from client.inference.answers import TaskVectorPatch
from client.models import LoadedModel, load_model
from client.public.selection import public_activations, select_heads_attribution
from dpmtv_common.artifact import TaskVectorArtifact, load_artifact
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.crypto import TrustedKeys


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished scripts/demo workdir")
    parser.add_argument("--model", type=Path, required=True, help="the model the demo used")
    parser.add_argument("--chunks", type=int, default=40, help="chunks of the non-private mean")
    parser.add_argument("--queries", type=int, default=40, help="test queries scored")
    parser.add_argument(
        "--policy",
        choices=[policy.value for policy in PatchPolicy],
        default=PatchPolicy.PROMPT_LAST_TOKEN.value,
        help="where a patch is applied: the prompt's last token (the product's default), or "
        "every call (MTV's code)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/answer-span")
    return parser.parse_args()


def site_zero_artifact(run: Path, loaded: LoadedModel) -> TaskVectorArtifact:
    folders = sorted((run / "site-0-artifacts").iterdir())
    if len(folders) != 1:
        raise SystemExit(f"{run}/site-0-artifacts must hold one release, got {len(folders)}.")
    keys = TrustedKeys.from_files([run / "coordinator.pub"])
    return load_artifact(
        folders[0], trusted_keys=keys, expected_model_fingerprint=loaded.fingerprint
    )


def scores(
    loaded: LoadedModel,
    queries: list[Record],
    heads,
    values: np.ndarray,
    policy: PatchPolicy,
    answer_end: torch.Tensor | None = None,
) -> dict:
    """First-token and answer-span accuracy of one patch, with two answers as examples."""
    tensor = torch.tensor(values, dtype=torch.float32)
    first = QuerySet.build(
        loaded, [zero_shot_prompt(r) for r in queries], [r.answer for r in queries]
    ).accuracy(loaded, (heads, tensor))
    patch = TaskVectorPatch(heads, tensor, policy, answer_end)
    result = evaluate(loaded, queries, mode=EvaluationMode.ARTIFACT, patch=patch)
    return {
        "first_token": first,
        "answer_span": result.accuracy,
        "examples": [[p, r.answer] for p, r in zip(result.predictions[:2], queries, strict=False)],
    }


def measure(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model)
    artifact = site_zero_artifact(args.run, loaded)
    heads = artifact.heads
    queries = list(load_dataset(args.run / "data" / "test").records)[: args.queries]
    site = load_dataset(args.run / "data" / "site-1")
    chunks = make_chunks(site, shots=artifact.manifest.shots, seed=1, max_chunks=args.chunks)
    mean = public_activations(loaded, chunks.chunks, progress=False).mean(0).double()  # (L, H, D)
    centre = ActivationCentre.load(args.run / "centre.safetensors")
    # MTV's own selection, non-private: ranked on another site's queries (an oracle).
    validation = list(load_dataset(args.run / "data" / "site-2").records)[:30]
    own = select_heads_attribution(loaded, mean.float(), validation, k=len(heads))
    patches = {
        "private release": (heads, np.asarray(artifact.values, dtype=np.float64)),
        "public only (the centre)": (heads, centre.rows(heads)),
        f"non-private mean of {len(chunks)} chunks of one site, same heads": (
            heads,
            _rows(mean, heads),
        ),
        f"that mean in MTV's own {len(own)} heads (oracle)": (own, _rows(mean, own)),
    }
    policy = PatchPolicy(args.policy)
    rows = {
        label: scores(loaded, queries, patch_heads, values, policy)
        for label, (patch_heads, values) in patches.items()
    }
    if policy is PatchPolicy.PROMPT_LAST_TOKEN:  # the answer's end takes the decoding steps
        public = [load_dataset(folder) for folder in sorted((args.run / "data").glob("public-*"))]
        for label, (patch_heads, values) in patches.items():
            end = learn_answer_end(loaded, public, patch_heads, shots=artifact.manifest.shots)
            rows[f"{label} + the public answer's end"] = scores(
                loaded, queries, patch_heads, values, policy, end.values
            )
    rows["site 0's own 4-shot ICL (no patch)"] = icl_scores(
        loaded, queries, list(load_dataset(args.run / "data" / "site-0").records)
    )
    return {
        "run": args.run.name,  # the demo workdir's name, not a path of this machine
        "release": artifact.manifest.release_id,
        "policy": args.policy,
        "heads": len(heads),
        "queries": len(queries),
        "rows": rows,
    }


def icl_scores(loaded: LoadedModel, queries: list[Record], support: list[Record]) -> dict:
    """First-token and answer-span accuracy of 4-shot ICL from ``support`` (same prompts)."""
    prompts = icl_prompts(queries, support, shots=4, seed=0)
    first = QuerySet.build(loaded, prompts, [r.answer for r in queries]).accuracy(loaded)
    result = evaluate(loaded, queries, mode=EvaluationMode.ICL, support=support, shots=4, seed=0)
    return {
        "first_token": first,
        "answer_span": result.accuracy,
        "examples": [[p, r.answer] for p, r in zip(result.predictions[:2], queries, strict=False)],
    }


def _rows(mean: torch.Tensor, heads) -> np.ndarray:
    return np.stack([mean[layer, head].numpy() for layer, head in heads.heads])


def markdown(result: dict) -> str:
    lines = [
        "# First-token accuracy against the answer a user reads",
        "",
        "Reproduce: `scripts/demo --model M --heads 16 --sites 10 --per-site 200 --workdir RUN`, "
        f"then `.venv/bin/python benchmarks/answer_span.py --run RUN --model M --policy "
        f"{result['policy']}`. One release "
        f"({result['release']}, {result['heads']} heads), {result['queries']} test queries, "
        f"patched under the `{result['policy']}` policy. "
        "*First token*: the first greedy token is the answer's (what the benchmarks score). "
        "*Answer span*: the first answer span equals an accepted answer (what `evaluate` and a "
        "reader see).",
        "",
        "| patch | first token | answer span | answers (given <- expected) |",
        "|---|---:|---:|---|",
    ]
    for label, row in result["rows"].items():
        shown = "; ".join(f"`{given!r}` <- {expected}" for given, expected in row["examples"])
        lines.append(f"| {label} | {row['first_token']:.2f} | {row['answer_span']:.2f} | {shown} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

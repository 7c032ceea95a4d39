"""Which untrained task family to benchmark: candidates measured on validation scenes.

The embedded models were trained on four tasks (``client.data.synthetic.TRAINED_TASKS``). A second
family must be one they never saw, where the demonstrations carry what zero-shot cannot (so
the MTV ratio has a denominator), and harder than the trained tasks. This measures, for each
candidate rule on ``validation`` scenes (public data on ``train`` scenes; no test query is
used for the choice): zero-shot, K-shot ICL (K = 4 and 8), non-private MTV in the k heads that
attribution picks on public data, and the **shortcut**: the accuracy of a model that ignores
the rule and answers the trained task whose words the rule answers with (what in-context
recognition of a known task alone reaches). Only accuracy above the shortcut shows the new rule
learned in context.

The adopted family (``-merged``) lives in ``client.data.synthetic``; the other candidates are
defined here only. Writes ``docs/benchmarks/untrained-candidates.json`` for
``benchmarks/report.py``:

    .venv/bin/python benchmarks/untrained_candidates.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.data.records import Record, load_dataset, write_jsonl_dataset
from client.data.synthetic import (
    COLOURS,
    POSITIONS,
    QUESTION,
    SHAPES,
    UNTRAINED_TASKS,
    SceneSpec,
    draw_scene,
    random_scene,
)
from client.evaluation.first_token import QuerySet
from client.evaluation.run import icl_prompts
from client.models import LoadedModel, load_model
from client.models.embedded import embedded_model_path
from client.public.selection import public_activations, select_heads_attribution
from dpmtv_common.rng import make_rng

_WORDS = {
    "colour": list(COLOURS),
    "shape": list(SHAPES),
    "count": ["1", "2", "3", "4"],
    "position": list(POSITIONS),
}


def _remapped(attribute: str, words_of: str) -> Callable[[SceneSpec], str]:
    """``attribute`` answered with ``words_of``'s words, value i -> word i."""
    return lambda s: _WORDS[words_of][_WORDS[attribute].index(s.answer(attribute))]


def _merged(task: str) -> Callable[[SceneSpec], str]:
    return lambda scene: scene.answer(task)


# name: (family, rule, the trained task whose answer words the rule uses)
CANDIDATES: dict[str, tuple[str, Callable[[SceneSpec], str], str]] = {
    **{
        task: ("merged pairs", _merged(task), task.removesuffix("-merged"))
        for task in UNTRAINED_TASKS
    },
    "colour-as-shape": ("remapped", _remapped("colour", "shape"), "shape"),
    "shape-as-colour": ("remapped", _remapped("shape", "colour"), "colour"),
    "count-as-position": ("remapped", _remapped("count", "position"), "position"),
    "position-as-count": ("remapped", _remapped("position", "count"), "count"),
    "colour-shifted": (
        "permuted",
        lambda s: _WORDS["colour"][(_WORDS["colour"].index(s.colour) + 1) % 4],
        "colour",
    ),
    "colour-or-shape": (
        "compositional",
        lambda s: s.colour if s.position in ("left", "right") else s.shape,
        "colour",
    ),
    "warm-xor-round": (
        "compositional",
        lambda s: ("1", "2")[(s.colour in ("red", "yellow")) ^ (s.shape in ("circle", "square"))],
        "count",
    ),
}


def _write(root: Path, scenes: list[SceneSpec], rule: Callable[[SceneSpec], str]) -> None:
    records = [
        {"id": f"r{i}", "image": f"images/{i}.png", "question": QUESTION, "answer": rule(scene)}
        for i, scene in enumerate(scenes)
    ]
    write_jsonl_dataset(root, records, task="candidate")


def _draw(root: Path, count: int, split: str, seed: int) -> list[SceneSpec]:
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = make_rng(seed)
    scenes = [random_scene(rng, split) for _ in range(count)]
    for index, scene in enumerate(scenes):
        draw_scene(scene, rng).save(root / "images" / f"{index}.png")
    return scenes


def _measure(loaded: LoadedModel, public: Path, queries: list[Record], k: int) -> dict[str, float]:
    support = load_dataset(public)
    answers = [r.answer for r in queries]
    zero = QuerySet.build(loaded, [zero_shot_prompt(r) for r in queries], answers)
    row = {"zero": zero.accuracy(loaded)}
    for shots in (4, 8):
        prompts = icl_prompts(queries, support.records, shots=shots, seed=0)
        row[f"icl_{shots}"] = QuerySet.build(loaded, prompts, answers).accuracy(loaded)
    chunks = make_chunks(support, shots=4, seed=0).chunks
    mean = public_activations(loaded, chunks, progress=False).mean(0)
    heads = select_heads_attribution(loaded, mean, [c.query for c in chunks], k=k)
    index = heads.to_array()
    row["mtv_public_heads"] = zero.accuracy(loaded, (heads, mean[index[:, 0], index[:, 1]]))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--public", type=int, default=150)
    parser.add_argument("--validation", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=REPO / "docs/benchmarks/untrained-candidates.json"
    )
    args = parser.parse_args()
    apply_thread_policy(args.threads)
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpmtv-candidates-") as tmp:
        public_root, validation_root = Path(tmp) / "public", Path(tmp) / "validation"
        public_scenes = _draw(public_root, args.public, "train", seed=1)
        validation_scenes = _draw(validation_root, args.validation, "validation", seed=2)
        for size, k in (("small", 4), ("deep", 8)):
            loaded = load_model(embedded_model_path(size), device="cpu")
            for name, (family, rule, word_task) in CANDIDATES.items():
                _write(public_root, public_scenes, rule)
                _write(validation_root, validation_scenes, rule)
                queries = list(load_dataset(validation_root).records)
                shortcut = sum(s.answer(word_task) == rule(s) for s in validation_scenes)
                row = {"model": size, "candidate": name, "family": family}
                row |= _measure(loaded, public_root, queries, k)
                row["shortcut"] = shortcut / len(validation_scenes)
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "command": " ".join(
            [".venv/bin/python", "benchmarks/untrained_candidates.py", *sys.argv[1:]]
        ),
        "public": args.public,
        "validation": args.validation,
        "rows": rows,
        "seconds": time.monotonic() - started,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

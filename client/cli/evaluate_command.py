"""``dpmtv-site evaluate``: accuracy of zero-shot, K-shot ICL or an artifact on a labelled set."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli._choices import EVALUATION_MODES
from client.cli._common import (
    add_image_crops_option,
    add_model_options,
    add_patch_options,
    answer_end_folders,
    check_artifact,
    check_site_model,
    load_site_model,
    settings_from,
    trusted_keys,
)
from client.cli._types import non_negative_int, positive_int
from dpmtv_common.errors import ConfigError, DpmtvError

if TYPE_CHECKING:
    from client.data.records import Record
    from client.inference.answers import TaskVectorPatch
    from client.models import LoadedModel

__all__ = ["goes_on_note", "register"]


def register(sub: Any) -> None:
    """Add the ``evaluate`` sub-command."""
    parser = sub.add_parser(
        "evaluate",
        help="accuracy of zero-shot / K-shot ICL / an artifact on a labelled set",
        description="Score answers with VQA accuracy (several reference answers) or exact "
        "match (one reference), after cutting each answer at its first line or sentence end.",
    )
    add_model_options(parser)
    parser.add_argument("--data", type=Path, help="labelled evaluation set")
    parser.add_argument("--mode", choices=EVALUATION_MODES, required=True)
    parser.add_argument("--artifact", type=Path, help="for --mode artifact")
    parser.add_argument("--trusted-key", dest="trusted_keys", type=Path, action="append")
    parser.add_argument("--support", type=Path, help="demonstration pool for --mode icl")
    parser.add_argument("--shots", type=positive_int, default=4)
    parser.add_argument(
        "--limit", type=positive_int, help="evaluate the first N >= 1 records only (default all)"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="demonstrations (icl)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (stderr)")
    add_patch_options(parser)
    add_image_crops_option(parser, purpose="for zero-shot and icl (artifact: the artifact's)")
    parser.set_defaults(handler=run)


def _check_mode_options(args: argparse.Namespace) -> None:
    """Each mode's own option, before the data and the model are read."""
    if args.mode == "artifact" and args.artifact is None:
        raise ConfigError("--mode artifact needs --artifact DIR.")
    if args.mode == "icl" and args.support is None:
        raise ConfigError("--mode icl needs --support DIR (demonstrations).")
    if args.answer_end_from and args.mode != "artifact":
        raise ConfigError(
            f"--answer-end-from is for --mode artifact (it patches an artifact's heads), got "
            f"--mode {args.mode}."
        )


def _answer_end_folders(args: argparse.Namespace, evaluated: Path) -> tuple[Path, ...]:
    """Public folders, none of them the evaluated set (learning on the test set inflates it)."""
    if args.mode != "artifact":
        return ()
    folders = answer_end_folders(args)
    for folder in folders:
        if folder.resolve() == evaluated.resolve():
            raise ConfigError(
                f"--answer-end-from must not be the evaluated set --data, got {str(folder)!r}: "
                "what is learnt from the queries themselves would inflate their accuracy."
            )
    return folders


def run(args: argparse.Namespace) -> int:
    """Print the accuracy and the number of queries."""
    settings = settings_from(args)
    if settings.data_path is None:
        raise ConfigError("evaluate needs --data DIR (a labelled set).")
    _check_mode_options(args)
    answer_end = _answer_end_folders(args, settings.data_path)
    keys = trusted_keys(settings) if args.mode == "artifact" else None
    if keys is not None:
        check_artifact(args.artifact, keys)
    # Imported here: the data and model side need PIL, torch and transformers.
    from client.activations.hooks import PatchPolicy
    from client.data.records import load_dataset
    from client.evaluation import EvaluationMode, evaluate

    mode = EvaluationMode(args.mode)
    check_site_model(settings)  # an unusable model is refused before any data is read
    dataset = load_dataset(settings.data_path)
    queries = dataset.records if args.limit is None else dataset.records[: args.limit]
    support = load_dataset(args.support).records if mode is EvaluationMode.ICL else ()
    loaded = load_site_model(settings)
    patch = None
    if keys is None:
        loaded = loaded.with_image_crops(args.max_image_crops)
    else:
        from client.cli._artifact import artifact_model, artifact_patch

        loaded = artifact_model(
            args.artifact, loaded=loaded, keys=keys, requested=args.max_image_crops
        )
        patch = artifact_patch(
            args.artifact,
            loaded=loaded,
            keys=keys,
            policy=PatchPolicy(args.policy),
            instruction=dataset.instruction,  # the queries are prompted with it
            rescale_norm=args.rescale_norm,
            answer_end_from=answer_end,
        )
    result = evaluate(
        loaded,
        queries,
        mode=mode,
        support=support,
        shots=args.shots,
        patch=patch,
        instruction=dataset.instruction,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        batch_size=settings.batch_size,
        progress=not args.quiet,  # answered queries, with an estimate of the time left
    )
    print(f"{mode.value}: accuracy {result.accuracy:.4f} over {len(result.scores)} queries")
    if patch is not None and patch.answer_end is None:
        first = _first_token_accuracy(loaded, queries, patch, dataset.instruction)
        note = goes_on_note(first, result.accuracy)
        if note is not None:
            print(note, file=sys.stderr)
    return 0


GOES_ON_GAP = 0.2
"""First-token accuracy this far above the answer's: the patched model names it and goes on."""


def goes_on_note(first_token: float | None, accuracy: float) -> str | None:
    """What to tell a site whose patched model gets the first token right but not the answer."""
    if first_token is None or first_token - accuracy < GOES_ON_GAP:
        return None
    return (
        f"note: the answer's first token is right on {first_token:.4f} of the queries, the "
        f"whole answer on {accuracy:.4f}: the patched model names the answer and goes on. "
        "Where the task's answers are one token, --answer-end-from DIR (labelled PUBLIC sets; "
        "other tasks of the domain will do) makes it stop after the word."
    )


def _first_token_accuracy(
    loaded: LoadedModel, queries: Sequence[Record], patch: TaskVectorPatch, instruction: str | None
) -> float | None:
    """The patched first greedy token's accuracy (one forward pass); None if it cannot say."""
    from client.activations.extraction import zero_shot_prompt
    from client.evaluation.first_token import QuerySet

    prompts = [zero_shot_prompt(record) for record in queries]
    try:
        query_set = QuerySet.build(
            loaded, prompts, [r.answer for r in queries], instruction=instruction
        )
        return query_set.accuracy(loaded, (patch.heads, patch.values))
    except DpmtvError:  # an answer the first-token check cannot tokenise: no note, no failure
        return None

"""``dpmtv-site evaluate``: accuracy of zero-shot, K-shot ICL or an artifact on a labelled set."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from client.cli._artifact import artifact_patch
from client.cli._common import (
    add_model_options,
    add_patch_options,
    load_site_model,
    settings_from,
    trusted_keys,
)
from client.data import load_dataset
from client.evaluation import EvaluationMode, evaluate
from client.hooks import PatchPolicy
from dpmtv_common.errors import ConfigError

__all__ = ["register"]


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
    parser.add_argument("--mode", choices=[m.value for m in EvaluationMode], required=True)
    parser.add_argument("--artifact", type=Path, help="for --mode artifact")
    parser.add_argument("--trusted-key", dest="trusted_keys", type=Path, action="append")
    parser.add_argument("--support", type=Path, help="demonstration pool for --mode icl")
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--limit", type=int, help="evaluate the first N records only")
    parser.add_argument("--seed", type=int, default=0, help="demonstration draw (icl)")
    add_patch_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the accuracy and the number of queries."""
    settings = settings_from(args)
    if settings.data_path is None:
        raise ConfigError("evaluate needs --data DIR (a labelled set).")
    mode = EvaluationMode(args.mode)
    dataset = load_dataset(settings.data_path)
    queries = dataset.records[: args.limit] if args.limit else dataset.records
    loaded = load_site_model(settings)
    patch = support = None
    if mode is EvaluationMode.ARTIFACT:
        if args.artifact is None:
            raise ConfigError("--mode artifact needs --artifact DIR.")
        keys = trusted_keys(settings)
        patch = artifact_patch(
            args.artifact,
            loaded=loaded,
            keys=keys,
            policy=PatchPolicy(args.policy),
            rescale_norm=args.rescale_norm,
        )
    if mode is EvaluationMode.ICL:
        if args.support is None:
            raise ConfigError("--mode icl needs --support DIR (demonstrations).")
        support = load_dataset(args.support).records
    result = evaluate(
        loaded,
        queries,
        mode=mode,
        support=support or (),
        shots=args.shots,
        patch=patch,
        instruction=dataset.instruction,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        batch_size=settings.batch_size,
    )
    print(f"{mode.value}: accuracy {result.accuracy:.4f} over {len(result.scores)} queries")
    return 0

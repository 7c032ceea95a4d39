"""``dpmtv-site infer``: answer questions with a model patched by a released task vector."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from PIL import Image

from client.cli._artifact import artifact_patch
from client.cli._common import (
    add_model_options,
    add_patch_options,
    load_site_model,
    settings_from,
    trusted_keys,
)
from client.hooks import PatchPolicy
from client.inference import generate_answers
from client.models import Example, Prompt
from dpmtv_common.errors import ConfigError, DataError

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``infer`` sub-command."""
    parser = sub.add_parser(
        "infer",
        help="answer questions with an artifact patched in (no further privacy cost)",
        description="Load the model and the artifact, verify the artifact's signature and that "
        "it was made for this model, then answer zero-shot queries with the released heads "
        "patched in. One --image/--question pair, or --batch FILE.jsonl with 'image' and "
        "'question' on each line (answers are printed as JSON lines).",
    )
    add_model_options(parser)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--trusted-key", dest="trusted_keys", type=Path, action="append")
    parser.add_argument("--image", type=Path)
    parser.add_argument("--question")
    parser.add_argument("--batch", type=Path, help="JSONL file of {image, question}")
    add_patch_options(parser)
    parser.set_defaults(handler=run)


def _queries(args: argparse.Namespace) -> list[tuple[Path, str]]:
    if args.batch is not None:
        lines = args.batch.read_text().splitlines()
        try:
            rows = [json.loads(line) for line in lines if line.strip()]
            return [(args.batch.parent / row["image"], str(row["question"])) for row in rows]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(
                f"--batch must be JSON lines with 'image' and 'question', got {args.batch}: {exc}"
            ) from exc
    if args.image is None or args.question is None:
        raise ConfigError("give --image and --question, or --batch FILE.jsonl.")
    return [(args.image, args.question)]


def _load_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except OSError as exc:
        raise DataError(f"image must be a readable picture, got {str(path)!r}: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    """Answer the queries; one line (or JSON line) per query."""
    settings = settings_from(args)
    queries = _queries(args)
    loaded = load_site_model(settings)
    patch = artifact_patch(
        args.artifact,
        loaded=loaded,
        keys=trusted_keys(settings),
        policy=PatchPolicy(args.policy),
        rescale_norm=args.rescale_norm,
    )
    prompts = [Prompt.of([], Example(_load_image(i), q)) for i, q in queries]
    answers = generate_answers(
        loaded,
        prompts,
        patch=patch,
        max_new_tokens=args.max_new_tokens,
        batch_size=settings.batch_size,
    )
    for (image, question), answer in zip(queries, answers, strict=True):
        if args.batch is None:
            print(answer)
        else:
            print(json.dumps({"image": str(image), "question": question, "answer": answer}))
    return 0

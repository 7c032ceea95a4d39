"""``dpmtv-site infer``: answer questions with a model patched by a released task vector."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli._common import (
    add_model_options,
    add_patch_options,
    answer_end_folders,
    check_artifact,
    load_site_model,
    settings_from,
    trusted_keys,
)
from dpmtv_common.errors import ConfigError, DataError

if TYPE_CHECKING:
    from PIL import Image

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
    parser.add_argument("--batch", type=Path, help="UTF-8 JSONL file of {image, question}")
    parser.add_argument(
        "--instruction",
        help="text put before each query, as the release's dataset.json 'instruction' put it "
        "before its prompts; must be that instruction (default: none)",
    )
    add_patch_options(parser)
    parser.set_defaults(handler=run)


def _batch_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise DataError(
            f"--batch must be a UTF-8 JSON-lines file, got undecodable bytes at byte "
            f"{exc.start} of {str(path)!r}."
        ) from exc
    except OSError as exc:
        raise DataError(f"--batch must be a readable file, got {str(path)!r} ({exc}).") from exc


def _queries(args: argparse.Namespace) -> list[tuple[Path, str]]:
    if args.batch is not None:
        lines = _batch_lines(args.batch)
        try:
            rows = [json.loads(line) for line in lines if line.strip()]
            queries = [(args.batch.parent / row["image"], str(row["question"])) for row in rows]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(
                f"--batch must be JSON lines with 'image' and 'question', got {args.batch}: {exc}"
            ) from exc
        if not queries:
            raise DataError(f"--batch must hold at least one query, got none in {args.batch}.")
        return queries
    if args.image is None or args.question is None:
        raise ConfigError("give --image and --question, or --batch FILE.jsonl.")
    return [(args.image, args.question)]


def _load_image(path: Path) -> Image.Image:
    """Decode the whole image now, so a bad file fails before the model is loaded."""
    from PIL import Image

    try:
        # A header can claim any size: PIL warns past MAX_IMAGE_PIXELS and raises past twice
        # that. Both are refusals here, never a warning that lets a huge decode go on.
        # read_rgb decodes every pixel and converts faithfully (16-bit scaled, palette
        # looked up), the way the site's data is read; a bomb warning is raised, not printed.
        from client.data.records import read_rgb

        return read_rgb(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(
            f"image must have at most {Image.MAX_IMAGE_PIXELS} pixels, got {str(path)!r} ({exc})."
        ) from exc
    except (OSError, ValueError, SyntaxError) as exc:  # PIL raises all three for bad files
        raise DataError(f"image must be a readable picture, got {str(path)!r}: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    """Answer the queries; one line (or JSON line) per query."""
    settings = settings_from(args)
    queries = _queries(args)
    answer_end = answer_end_folders(args)  # public only, checked before any model loads
    images = [_load_image(image) for image, _ in queries]
    keys = trusted_keys(settings)
    check_artifact(args.artifact, keys)
    loaded = load_site_model(settings)
    # Imported here: the model side needs torch and transformers.
    from client.activations.hooks import PatchPolicy
    from client.cli._artifact import artifact_model, artifact_patch
    from client.inference.answers import generate_answers
    from client.models import Example, Prompt

    loaded = artifact_model(args.artifact, loaded=loaded, keys=keys)  # the release's crop cap
    patch = artifact_patch(
        args.artifact,
        loaded=loaded,
        keys=keys,
        policy=PatchPolicy(args.policy),
        instruction=args.instruction,
        rescale_norm=args.rescale_norm,
        answer_end_from=answer_end,
    )
    prompts = [
        Prompt.of([], Example(image, q)) for image, (_, q) in zip(images, queries, strict=True)
    ]
    answers = generate_answers(
        loaded,
        prompts,
        patch=patch,
        instruction=args.instruction,
        max_new_tokens=args.max_new_tokens,
        batch_size=settings.batch_size,
    )
    for (image_path, question), answer in zip(queries, answers, strict=True):
        if args.batch is None:
            print(answer)
        else:
            print(json.dumps({"image": str(image_path), "question": question, "answer": answer}))
    return 0

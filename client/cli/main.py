"""Entry point of ``dpmtv-site``: one sub-command per task, errors as one clear line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from client.cli import commands
from dpmtv_common.errors import DpmtvError

__all__ = ["build_parser", "main"]

_DESCRIPTION = """\
Site-side commands of dpmtv (federated, differentially private multimodal task vectors).

  keygen          make an Ed25519 key pair for signing or trusting artifacts
  make-tiny-model write a tiny random VLM (for tests and trying things out)
  select-heads    choose heads on PUBLIC data (no privacy cost) -> a head list a plan can name
  release         single-holder DP release on your private data -> signed artifact + ledger entry
  infer           answer questions with a model patched by an artifact (no further privacy cost)
  evaluate        accuracy of zero-shot, K-shot ICL, or an artifact on a labelled set
  ledger          show this site's privacy ledger

Options can also come from DPMTV_CLIENT_* environment variables (e.g. DPMTV_CLIENT_LEDGER_PATH).
"""


def build_parser() -> argparse.ArgumentParser:
    """The full command-line parser."""
    parser = argparse.ArgumentParser(
        prog="dpmtv-site",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in commands.REGISTRY:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the process exit code (0 ok, 2 usage/input error)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s"
    )
    try:
        return int(args.handler(args))
    except DpmtvError as exc:
        print(f"dpmtv-site {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or device the user named could not be used
        print(f"dpmtv-site {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

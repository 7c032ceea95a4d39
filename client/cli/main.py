"""Entry point of ``dpmtv-site``: one sub-command per task, errors as one clear line.

Every failure ends as one line on stderr and an exit code: 2 for a usage or input error (a
bad option value is caught by the parser, a bad file or setting by the command), 1 for
anything else. ``-v`` adds the traceback. Importing this module and running the commands
that need no model (``keygen``, ``ledger``, ``--help``) never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from client.cli import commands
from client.cli._errors import describe
from dpmtv_common.thread_policy import apply_thread_policy

__all__ = ["build_parser", "main"]

_DESCRIPTION = """\
Site-side commands of dpmtv (federated, differentially private multimodal task vectors):
every command is listed below; 'dpmtv-site COMMAND --help' gives its options.

Options can also come from DPMTV_CLIENT_* environment variables (e.g. DPMTV_CLIENT_LEDGER_PATH).
Exit codes: 0 done, 2 bad input (one line says which option or file), 1 anything else.
"""


def build_parser() -> argparse.ArgumentParser:
    """The full command-line parser."""
    parser = argparse.ArgumentParser(
        prog="dpmtv-site",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug log and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in commands.REGISTRY:
        register(sub)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code argparse chose (help: 0, bad option: 2)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has already printed the help or its one-line error
        return exc.code if isinstance(exc.code, int) else 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the process exit code (0 ok, 2 usage/input error, 1 other)."""
    args = _parse(argv)
    if isinstance(args, int):
        return args
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s"
    )
    try:
        apply_thread_policy(getattr(args, "threads", None))  # before any command loads torch
        _quiet_third_party_progress()
        return int(args.handler(args))
    except Exception as exc:  # every failure becomes one line; see client.cli._errors
        code, line = describe(exc)
        print(f"dpmtv-site {args.command}: error: {line}", file=sys.stderr)
        if args.verbose:
            traceback.print_exc()
        return code


def _quiet_third_party_progress() -> None:
    """Silence transformers' and the Hub's bars and advisories (read when they are imported).

    "Loading weights" bars and advisory warnings flooded every command and the service log;
    dpmtv prints its own progress, with an estimate, where a command runs long. A value the
    operator set is kept.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars obey it too
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

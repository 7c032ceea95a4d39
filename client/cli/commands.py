"""Small ``dpmtv-site`` commands, and the registry of all of them.

Registering a command must stay cheap: the parser is built for every invocation, including
``keygen`` and ``--help``, so no module imported here may import torch at module level.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client.cli import (
    audit_command,
    data_command,
    evaluate_command,
    infer_command,
    install_command,
    ledger_command,
    release_command,
    roster_command,
    select_command,
    serve_command,
)
from client.cli._types import non_negative_int
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import ConfigError

__all__ = ["REGISTRY"]

Subparsers = Any  # argparse's _SubParsersAction is private


def _key_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """Both key files, checked before either is written: no orphan private key."""
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise ConfigError(f"--out-dir must be a directory, got the file {str(args.out_dir)!r}.")
    private, public = args.out_dir / f"{args.name}.key", args.out_dir / f"{args.name}.pub"
    present = [str(path) for path in (private, public) if path.exists() or path.is_symlink()]
    if present:
        raise ConfigError(
            f"--name must not name existing key files, got {args.name!r} with {present} "
            "already there; keys are never overwritten: choose another --name or --out-dir."
        )
    return private, public


def _keygen(args: argparse.Namespace) -> int:
    if not args.name or "/" in args.name or args.name.startswith("."):
        raise ConfigError(f"--name must be a plain file stem such as 'site', got {args.name!r}.")
    private_path, public_path = _key_paths(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()
    private = key.save(private_path)
    try:
        public = key.verify_key.save(public_path)
    except BaseException:
        private.unlink(missing_ok=True)  # a private key without its public half helps no one
        raise
    print(f"private key: {private} (keep it secret)\npublic key:  {public}\nkey id: {key.key_id}")
    return 0


def register_keygen(sub: Subparsers) -> None:
    """``keygen``: an Ed25519 key pair."""
    parser = sub.add_parser(
        "keygen",
        help="make an Ed25519 signing key pair",
        description="Writes OUT_DIR/NAME.key (private, mode 0600) and OUT_DIR/NAME.pub. "
        "Refuses if either file exists: keys are never overwritten.",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("keys"), help="default ./keys")
    parser.add_argument("--name", default="site", help="file stem (default 'site')")
    parser.set_defaults(handler=_keygen)


def _make_tiny(args: argparse.Namespace) -> int:
    directory: Path = args.directory
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"directory must be a folder, got the file {str(directory)!r}.")
    if directory.is_dir() and any(directory.iterdir()) and not args.overwrite:
        raise ConfigError(
            f"directory must be new or empty, got {str(directory)!r} with files in it. "
            "Pass --overwrite to replace a model there."
        )
    # Imported here: building a model needs torch and transformers (seconds to import).
    from client.models import ALL_TINY_ARCHITECTURES as TINY_ARCHITECTURES
    from client.models import save_tiny_model

    if args.arch not in TINY_ARCHITECTURES:
        raise ConfigError(f"arch must be one of {list(TINY_ARCHITECTURES)}, got {args.arch!r}.")
    save_tiny_model(args.arch, directory, seed=args.seed)
    print(f"tiny random {args.arch} model written to {directory}")
    return 0


def register_make_tiny(sub: Subparsers) -> None:
    """``make-tiny-model``: a tiny random VLM of a real architecture."""
    parser = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random VLM (real architecture, random weights)",
        description="Write a tiny random-weight model of a supported architecture (llava, "
        "qwen2_vl, ...; an unknown name lists them all) for tests and trials.",
    )
    parser.add_argument("arch", help="architecture, e.g. llava")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a model already in DIRECTORY"
    )
    parser.set_defaults(handler=_make_tiny)


REGISTRY: tuple[Callable[[Subparsers], None], ...] = (
    register_keygen,
    register_make_tiny,
    select_command.register,
    release_command.register,
    infer_command.register,
    evaluate_command.register,
    ledger_command.register,
    serve_command.register,
    install_command.register,
    data_command.register,
    audit_command.register,
    roster_command.register,
)

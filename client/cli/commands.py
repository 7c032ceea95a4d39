"""Small ``dpmtv-site`` commands, and the registry of all of them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client.cli import evaluate_command, infer_command, release_command, select_command
from client.models import TINY_ARCHITECTURES, save_tiny_model
from dpmtv_common.crypto import SigningKey
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger

__all__ = ["REGISTRY"]

Subparsers = Any  # argparse's _SubParsersAction is private


def _keygen(args: argparse.Namespace) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()
    private = key.save(args.out_dir / f"{args.name}.key")
    public = key.verify_key.save(args.out_dir / f"{args.name}.pub")
    print(f"private key: {private} (keep it secret)\npublic key:  {public}\nkey id: {key.key_id}")
    return 0


def register_keygen(sub: Subparsers) -> None:
    """``keygen``: an Ed25519 key pair."""
    parser = sub.add_parser("keygen", help="make an Ed25519 signing key pair")
    parser.add_argument("--out-dir", type=Path, default=Path("keys"), help="default ./keys")
    parser.add_argument("--name", default="site", help="file stem (default 'site')")
    parser.set_defaults(handler=_keygen)


def _make_tiny(args: argparse.Namespace) -> int:
    save_tiny_model(args.arch, args.directory, seed=args.seed)
    print(f"tiny random {args.arch} model written to {args.directory}")
    return 0


def register_make_tiny(sub: Subparsers) -> None:
    """``make-tiny-model``: a tiny random VLM of a real architecture."""
    parser = sub.add_parser(
        "make-tiny-model", help="write a tiny random VLM (real architecture, random weights)"
    )
    parser.add_argument("arch", choices=TINY_ARCHITECTURES)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=_make_tiny)


def _show_ledger(args: argparse.Namespace) -> int:
    budget = PrivacyBudget(args.budget_epsilon, args.budget_delta)
    with PrivacyLedger.open(args.ledger_path, budget) as ledger:
        if args.commit:
            ledger.commit(args.commit)
            print(f"{args.commit}: committed (counted as spent)")
        if args.abort:
            ledger.abort(args.abort, args.reason or "resolved by the site admin")
            print(f"{args.abort}: aborted (refunded)")
        for entry in ledger.releases():
            print(
                f"{entry.release_id}  {entry.state.value:9}  eps={entry.epsilon:.4g} "
                f"delta={entry.delta:.2g}  {entry.accountant}  {entry.note}"
            )
        spent = ledger.spent()
    total = "nothing" if spent is None else f"epsilon={spent.epsilon:.4g} ({spent.accountant})"
    print(f"spent: {total} of epsilon={budget.epsilon} at delta={budget.delta}")
    return 0


def register_ledger(sub: Subparsers) -> None:
    """``ledger``: list the releases of this site's ledger and the budget spent."""
    parser = sub.add_parser(
        "ledger",
        help="show the privacy ledger, or resolve a release a lost run left reserved",
        description="Lists every release and the budget spent. A federated run that never "
        "finished (coordinator lost) leaves its reservation counted; once you know whether its "
        "noise was drawn, --commit it (spent) or --abort it (refund: only if NO noisy output "
        "was ever produced).",
    )
    parser.add_argument("--ledger", dest="ledger_path", type=Path, required=True)
    parser.add_argument("--budget-epsilon", type=float, default=10.0, help="as at creation")
    parser.add_argument("--budget-delta", type=float, default=1e-5, help="as at creation")
    parser.add_argument("--commit", metavar="RELEASE_ID", help="count a reserved release as spent")
    parser.add_argument("--abort", metavar="RELEASE_ID", help="refund a reserved release")
    parser.add_argument("--reason", help="why, kept in the ledger (with --abort)")
    parser.set_defaults(handler=_show_ledger)


REGISTRY: tuple[Callable[[Subparsers], None], ...] = (
    register_keygen,
    register_make_tiny,
    select_command.register,
    release_command.register,
    infer_command.register,
    evaluate_command.register,
    register_ledger,
)

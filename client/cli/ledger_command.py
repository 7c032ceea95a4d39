"""``dpmtv-site ledger``: the site's one privacy ledger, what it has spent, and its other ledgers.

With no option it shows the site's default ledger, the one every command and the service
share (``$XDG_DATA_HOME/dpmtv/site/ledger.sqlite``, or under ``--state-dir``); ``--ledger``
names another. It also names every other ledger of the site whose counted releases this one
lacks (:mod:`client.release.ledgers`), and ``--merge FILE`` copies them in so they compose.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from client.cli._common import settings_from
from client.cli._types import open_unit_float, positive_float
from client.release.ledgers import other_ledgers, remember_ledger, uses_default_ledger
from client.settings import SiteSettings
from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.ledger import LedgerEntry, PrivacyLedger, ReleaseState
from dpmtv_common.privacy.ledger_files import read_ledger_file

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``ledger`` sub-command."""
    parser = sub.add_parser(
        "ledger",
        help="show the site's privacy ledger, resolve a release a lost run left reserved",
        description="Shows the site's one ledger (default: the one every command and the "
        "service share, under the state folder) with every release, its epsilon and privacy "
        "unit, what is spent (committed, or exposed: noise may have left) apart from what is "
        "only reserved (an open release: refunded if it aborts), and what both count against "
        "the budget; and names the site's other ledgers whose releases it lacks (--merge one "
        "to compose them). A federated run that never finished (coordinator lost) leaves its "
        "reservation counted; once you know whether its noise was drawn, --commit it (spent) "
        "or --abort it (refund: only if NO noisy output was ever produced).",
    )
    parser.add_argument(
        "--config",
        dest="config_file",
        type=Path,
        help="a TOML file of site settings (its ledger-path and state-dir are used)",
    )
    parser.add_argument("--state-dir", type=Path, help="the site's state folder (its ledger)")
    parser.add_argument(
        "--ledger", dest="ledger_path", type=Path, help="another ledger than the site's default"
    )
    parser.add_argument(
        "--budget-epsilon", type=positive_float, help="check against it (default: as created)"
    )
    parser.add_argument(
        "--budget-delta", type=open_unit_float, help="check against it (default: as created)"
    )
    parser.add_argument("--commit", metavar="RELEASE_ID", help="count a reserved release as spent")
    parser.add_argument("--abort", metavar="RELEASE_ID", help="refund a reserved release")
    parser.add_argument("--reason", help="why, kept in the ledger (with --abort)")
    parser.add_argument(
        "--merge",
        metavar="OTHER_LEDGER",
        type=Path,
        help="copy every release of another ledger file that this one lacks (they then "
        "compose here; the other file is left as it is)",
    )
    parser.set_defaults(handler=run)


def _budget(args: argparse.Namespace, path: Path) -> PrivacyBudget:
    """The flags' budget (checked against the ledger's), else the one it was created with."""
    stored = read_ledger_file(path).budget
    return PrivacyBudget(
        args.budget_epsilon if args.budget_epsilon is not None else stored.epsilon,
        args.budget_delta if args.budget_delta is not None else stored.delta,
    )


def run(args: argparse.Namespace) -> int:
    """Show (and resolve, or merge into) the site's ledger; name its other ledgers."""
    settings = settings_from(args)
    path = settings.ledger_file
    default = uses_default_ledger(settings)
    print(f"ledger: {path} ({'the site default' if default else 'named'})")
    if args.merge is not None:
        _merge(settings, args.merge)
    if path.is_file():
        remember_ledger(settings)
        _show(args, path)
    elif not default or args.commit or args.abort:
        # Opening a ledger creates it: a typo must not print "spent: nothing" for a new file.
        raise ConfigError(
            f"--ledger must be an existing ledger file, got {str(path)!r}. "
            "A release creates it; check the path."
        )
    else:
        print("no release yet: the site's ledger is created by its first release")
    for other in other_ledgers(settings):
        print(f"other ledger of this site, NOT composed here: {other.line()}")
        print(f"  to compose it here: dpmtv-site ledger --merge {other.path}")
    return 0


def _merge(settings: SiteSettings, other: Path) -> None:
    source = read_ledger_file(other)
    path = settings.ledger_file
    budget = read_ledger_file(path).budget if path.is_file() else settings.budget
    with PrivacyLedger.open(path, budget) as ledger:
        added = ledger.merge(source)
    print(f"merged from {source.path}: {len(added)} release(s) {', '.join(added)}".rstrip())


def _show(args: argparse.Namespace, path: Path) -> None:
    budget = _budget(args, path)
    with PrivacyLedger.open(path, budget) as ledger:
        if args.commit:
            ledger.commit(args.commit)
            print(f"{args.commit}: committed (counted as spent)")
        if args.abort:
            ledger.abort(args.abort, args.reason or "resolved by the site admin")
            print(f"{args.abort}: aborted (refunded)")
        entries = ledger.releases()
        counted = ledger.spent()
        unit = ledger.counted_unit()
    for entry in entries:
        print(
            f"{entry.release_id}  {entry.state.value:9}  eps={entry.epsilon:.4g} "
            f"delta={entry.delta:.2g} per {entry.privacy_unit}  {entry.accountant}  {entry.note}"
        )
    for line in _budget_lines(entries, counted, budget, unit):
        print(line)


def _budget_lines(
    entries: list[LedgerEntry], counted: EpsilonBound | None, budget: PrivacyBudget, unit: str
) -> list[str]:
    """Spent (committed or exposed: noise may have left) apart from reserved (may be refunded)."""
    spent_states = (ReleaseState.COMMITTED, ReleaseState.EXPOSED)
    spent_events = [e.event for e in entries if e.state in spent_states]
    reserved = [e.release_id for e in entries if e.state is ReleaseState.RESERVED]
    if spent_events:
        bound = epsilon_bound(spent_events, delta=budget.delta)
        spent = (
            f"epsilon={bound.epsilon:.4g} per {unit} ({bound.accountant}) by "
            f"{len(spent_events)} releases"
        )
    else:
        spent = "nothing"
    lines = [f"spent: {spent} (committed, or exposed: noise may have left)"]
    if reserved and counted is not None:
        lines.append(
            f"reserved: {len(reserved)} open ({', '.join(reserved)}): refunded if aborted, spent "
            f"if committed; with them epsilon={counted.epsilon:.4g} ({counted.accountant})"
        )
    total = "nothing" if counted is None else f"epsilon={counted.epsilon:.4g} per {unit}"
    lines.append(
        f"counted against the budget: {total} of epsilon={budget.epsilon} at "
        f"delta={budget.delta} (spent and reserved composed)"
    )
    if unit == "example" and any(e.privacy_unit == "group" for e in entries):
        lines.append(
            "privacy unit: example (group-level releases count here at their epsilon per "
            "example; with example-level releases composed in, no group-level bound holds)"
        )
    return lines

"""``dpmtv-site roster``: make a consortium roster from the members' public keys, or show one.

A consortium's members each run ``dpmtv-site keygen --name identity`` and send the public
half (never the private one) to whoever assembles the roster; ``roster make`` writes the
file, ``roster show`` prints its fingerprint, which every member compares out of band (a
call, a signed letter) before installing the file with ``serve --roster``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dpmtv_common.crypto import VerifyKey
from dpmtv_common.errors import ConfigError
from dpmtv_common.roster import Roster

__all__ = ["register"]


def _member(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PUBLIC_KEY_FILE, got {text!r}")
    return name, Path(path)


def _make(args: argparse.Namespace) -> int:
    if args.out.exists() or args.out.is_symlink():
        raise ConfigError(
            f"--out must not exist (a roster is never overwritten), got {str(args.out)!r}."
        )
    members: dict[str, VerifyKey] = {}
    for name, path in args.member:
        if name in members:
            raise ConfigError(f"--member must name each member once, got {name!r} twice.")
        members[name] = VerifyKey.load(path)
    roster = Roster(args.consortium, members)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(roster.to_toml(), encoding="utf-8")
    print(f"roster: {args.out} ({len(members)} members)\nfingerprint: {roster.fingerprint}")
    print("Every member compares this fingerprint out of band before installing the file.")
    return 0


def _show(args: argparse.Namespace) -> int:
    roster = Roster.load(args.roster)
    print(f"consortium: {roster.consortium}\nfingerprint: {roster.fingerprint}")
    for name in sorted(roster.members):
        print(f"  {name}  key {roster.members[name].key_id}")
    return 0


def register(sub: Any) -> None:
    """Add ``roster make`` and ``roster show``."""
    parser = sub.add_parser(
        "roster",
        help="make or show the consortium roster (the members a secure sum may hold)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="roster_action", required=True, metavar="ACTION")
    make = actions.add_parser("make", help="write a roster from the members' public keys")
    make.add_argument("--consortium", required=True, help="the consortium's name")
    make.add_argument(
        "--member",
        type=_member,
        action="append",
        required=True,
        metavar="NAME=PUBLIC_KEY_FILE",
        help="a member's site name (its serve --name) and identity public key (repeat)",
    )
    make.add_argument("--out", type=Path, required=True, help="the roster file to write")
    make.set_defaults(handler=_make)
    show = actions.add_parser("show", help="print a roster's fingerprint and members")
    show.add_argument("roster", type=Path, help="the roster file")
    show.set_defaults(handler=_show)

"""Another ledger file, read without changing it: what it holds, and what of it to merge.

A population should have one ledger: releases in two ledgers are never composed with each
other. A site that once kept releases in a second file (a ledger named on the command line,
or an older default) reads it here to report it, and merges it into its one ledger with
:meth:`dpmtv_common.privacy.ledger.PrivacyLedger.merge`. Reading never migrates, creates
or writes the file: it may belong to an older version, or be kept as evidence.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from dpmtv_common.errors import LedgerError
from dpmtv_common.privacy import _ledger_schema as schema
from dpmtv_common.privacy._ledger_schema import LedgerEntry, ReleaseState
from dpmtv_common.privacy.budget import PrivacyBudget

__all__ = ["COUNTED_STATES", "LedgerFile", "read_ledger_file"]

COUNTED_STATES = (ReleaseState.RESERVED, ReleaseState.EXPOSED, ReleaseState.COMMITTED)
"""States whose cost counts against a budget (reserved included: fail closed)."""


@dataclass(frozen=True)
class LedgerFile:
    """What a ledger file holds.

    Attributes:
        path: The file.
        budget: The budget it was created with.
        entries: Every release in it, in reservation order.
    """

    path: Path
    budget: PrivacyBudget
    entries: tuple[LedgerEntry, ...]

    def counted_ids(self) -> frozenset[str]:
        """Releases whose cost counts (reserved, exposed or committed)."""
        return frozenset(e.release_id for e in self.entries if e.state in COUNTED_STATES)

    def open_ids(self) -> tuple[str, ...]:
        """Releases not yet resolved (reserved or exposed)."""
        pending = (ReleaseState.RESERVED, ReleaseState.EXPOSED)
        return tuple(e.release_id for e in self.entries if e.state in pending)


def read_ledger_file(path: str | os.PathLike[str]) -> LedgerFile:
    """Read every release of the ledger at ``path`` (schema 1 or 2) without writing anything.

    Raises:
        LedgerError: No such file, or not a readable dpmtv ledger.
    """
    where = Path(path)
    if not where.is_file():
        raise LedgerError(f"ledger must be an existing file, got {str(where)!r}.")
    with schema.sqlite_errors_as_ledger_errors(str(where)):
        uri = f"{where.absolute().as_uri()}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True)) as conn:
            columns = {row[1] for row in conn.execute("PRAGMA table_info(releases)")}
            if not columns:
                raise LedgerError(f"ledger {where} must hold a releases table, got none.")
            query = schema.SELECT_ENTRIES if "privacy_unit" in columns else schema.SELECT_ENTRIES_V1
            rows = conn.execute(query).fetchall()
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    budget = schema.stored_budget(meta, str(where))
    return LedgerFile(where, budget, tuple(schema.entry_from_row(row) for row in rows))

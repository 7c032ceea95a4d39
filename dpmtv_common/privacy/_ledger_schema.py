"""Storage of the privacy ledger: SQLite connection, schema, meta check and transactions.

Private to :mod:`dpmtv_common.privacy.ledger`, which holds the rules and re-exports
:class:`ReleaseState` and :class:`LedgerEntry`; this module only knows how rows are laid out
and how a write is made atomic and durable.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from dpmtv_common.errors import ConfigError, LedgerError
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.events import ReleaseEvent

SCHEMA_VERSION = 2
"""2 added each release's privacy unit; a version-1 ledger is migrated when opened."""

PRIVACY_UNITS = ("example", "group")
"""What one neighbouring change replaces; a group-level ε also holds per example."""

# Another process may hold the write lock while it composes a budget (well under a second);
# wait for it rather than fail, but not forever.
_BUSY_TIMEOUT_S = 30.0

# Every statement the ledger runs, as literals: values always travel as ? parameters.
INSERT_RELEASE = """INSERT INTO releases (release_id, plan_hash, event_json, epsilon, delta,
    accountant, state, pid, created_utc, updated_utc, note, privacy_unit)
    VALUES (?, ?, ?, ?, ?, ?, 'reserved', ?, ?, ?, ?, ?)"""
SELECT_ENTRIES = """SELECT release_id, plan_hash, event_json, epsilon, delta, accountant, state,
    pid, created_utc, updated_utc, note, privacy_unit FROM releases ORDER BY seq"""
# A version-1 ledger read without migrating it (another ledger looked at, never written).
SELECT_ENTRIES_V1 = """SELECT release_id, plan_hash, event_json, epsilon, delta, accountant, state,
    pid, created_utc, updated_utc, note, 'example' FROM releases ORDER BY seq"""
INSERT_MERGED = """INSERT INTO releases (release_id, plan_hash, event_json, epsilon, delta,
    accountant, state, pid, created_utc, updated_utc, note, privacy_unit)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""
SELECT_COUNTED_EVENTS = """SELECT event_json FROM releases
    WHERE state IN ('reserved', 'exposed', 'committed') ORDER BY seq"""
SELECT_PENDING = """SELECT release_id, state, pid FROM releases
    WHERE state IN ('reserved', 'exposed') ORDER BY seq"""
SELECT_STATE = "SELECT state, created_utc FROM releases WHERE release_id = ?"
SELECT_PLAN_HASH = "SELECT plan_hash FROM releases WHERE release_id = ?"
# COALESCE keeps the existing note when the transition brings none.
UPDATE_STATE = """UPDATE releases SET state = ?, updated_utc = ?, note = COALESCE(?, note)
    WHERE release_id = ?"""

_DDL = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # seq keeps insertion order for display; composition itself does not depend on order.
    """CREATE TABLE IF NOT EXISTS releases (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        release_id TEXT NOT NULL UNIQUE,
        plan_hash TEXT NOT NULL,
        event_json TEXT NOT NULL,
        epsilon REAL NOT NULL CHECK (epsilon > 0),
        delta REAL NOT NULL CHECK (delta >= 0 AND delta < 1),
        accountant TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('reserved', 'exposed', 'committed', 'aborted')),
        pid INTEGER NOT NULL,
        created_utc TEXT NOT NULL,
        updated_utc TEXT NOT NULL,
        note TEXT NOT NULL DEFAULT '',
        privacy_unit TEXT NOT NULL DEFAULT 'example' CHECK (privacy_unit IN ('example', 'group'))
    )""",
)
# Version 1 had no unit. Its releases are labelled 'example': a group-level release's ε holds
# per example too, so the label never claims a group-level bound a release did not have.
_MIGRATE_1_TO_2 = (
    """ALTER TABLE releases ADD COLUMN privacy_unit TEXT NOT NULL DEFAULT 'example'
        CHECK (privacy_unit IN ('example', 'group'))""",
    "UPDATE meta SET value = '2' WHERE key = 'schema_version'",
)


class ReleaseState(StrEnum):
    """Where a release stands; reserved, exposed and committed count as spent."""

    RESERVED = "reserved"
    EXPOSED = "exposed"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class LedgerEntry:
    """One release as the ledger stores it.

    Attributes:
        release_id: Unique name of the release.
        plan_hash: Hash of the plan the release ran.
        event: The mechanisms it ran; what the ledger composes.
        epsilon: ε of this release alone, as its plan stated it.
        delta: δ of this release alone, as its plan stated it.
        accountant: Accountant that gave ``epsilon`` ("rdp", "pld", "analytic", ...).
        state: Where the release stands.
        pid: Process that reserved it (used by crash recovery).
        created_utc: When it was reserved.
        updated_utc: When its state last changed.
        note: Free text: abort reason or crash-recovery note.
        privacy_unit: What its ε protects: ``"example"`` or ``"group"`` (one owner's records).
    """

    release_id: str
    plan_hash: str
    event: ReleaseEvent
    epsilon: float
    delta: float
    accountant: str
    state: ReleaseState
    pid: int
    created_utc: datetime
    updated_utc: datetime
    note: str
    privacy_unit: str = "example"


def entry_from_row(row: tuple[Any, ...]) -> LedgerEntry:
    """Map a row of SELECT_ENTRIES to an entry; a malformed row is a LedgerError."""
    release_id, plan_hash, event_json, epsilon, delta, accountant, state, pid, *rest = row
    created, updated, note, unit = rest
    try:
        return LedgerEntry(
            release_id=release_id,
            plan_hash=plan_hash,
            event=ReleaseEvent.from_json(event_json),
            epsilon=float(epsilon),
            delta=float(delta),
            accountant=accountant,
            state=ReleaseState(state),
            pid=int(pid),
            created_utc=datetime.fromisoformat(created),
            updated_utc=datetime.fromisoformat(updated),
            note=note,
            privacy_unit=unit,
        )
    except (ValueError, TypeError) as exc:  # ConfigError is a ValueError
        raise LedgerError(f"ledger row must be well formed, got {row!r}.") from exc


def utc_now() -> str:
    """The current UTC time as ISO 8601 with an explicit +00:00 offset."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


@contextmanager
def sqlite_errors_as_ledger_errors(path: str) -> Iterator[None]:
    """Re-raise any sqlite3 error as a LedgerError naming the ledger file."""
    try:
        yield
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path} must be a readable dpmtv ledger, got {exc!r}.") from exc


def connect(path: str) -> sqlite3.Connection:
    """Open ``path`` in autocommit mode (transactions are explicit), WAL, synchronous=FULL."""
    with sqlite_errors_as_ledger_errors(path):
        # isolation_level=None: Python's sqlite3 must not open implicit transactions, so that
        # every write is exactly one explicit BEGIN IMMEDIATE ... COMMIT.
        conn = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            # FULL fsyncs the WAL at every commit: a committed reservation survives power loss.
            conn.execute("PRAGMA synchronous=FULL")
        except BaseException:
            conn.close()
            raise
    if str(mode).lower() != "wal":
        conn.close()
        raise LedgerError(
            f"journal_mode of ledger {path} must be 'wal', got {mode!r}; "
            "put the ledger on a local file system."
        )
    return conn


@contextmanager
def write_transaction(conn: sqlite3.Connection, path: str) -> Iterator[sqlite3.Connection]:
    """One atomic write: BEGIN IMMEDIATE takes the write lock first, so processes serialise.

    Reading and writing under the same lock is what makes a budget check sound: no second
    process can reserve between our composition and our insert.
    """
    with sqlite_errors_as_ledger_errors(path):
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def create_or_check(conn: sqlite3.Connection, budget: PrivacyBudget, path: str) -> None:
    """Create the schema and record ``budget``, or check an existing ledger against it.

    Must run inside :func:`write_transaction`.

    Raises:
        ConfigError: if the ledger was created with another budget.
        LedgerError: if the schema version is unknown or the meta table is corrupt.
    """
    for statement in _DDL:
        conn.execute(statement)
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    if not meta:
        rows = [
            ("schema_version", str(SCHEMA_VERSION)),
            ("budget_epsilon", repr(budget.epsilon)),
            ("budget_delta", repr(budget.delta)),
            ("created_utc", utc_now()),
        ]
        conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", rows)
        return
    version = meta.get("schema_version")
    if version == "1":
        for statement in _MIGRATE_1_TO_2:
            conn.execute(statement)
        version = str(SCHEMA_VERSION)
    if version != str(SCHEMA_VERSION):
        raise LedgerError(
            f"schema_version of ledger {path} must be {SCHEMA_VERSION}, got {version!r}; "
            "open it with the dpmtv version that wrote it."
        )
    stored = stored_budget(meta, path)
    if stored != budget:
        # A budget is a promise made when the ledger was created; changing it silently would
        # let a site spend twice. Refuse, and say both values.
        raise ConfigError(
            f"budget must equal the budget ledger {path} was created with "
            f"(epsilon={stored.epsilon!r}, delta={stored.delta!r}), "
            f"got epsilon={budget.epsilon!r}, delta={budget.delta!r}. "
            "Open it with its own budget, or start a new ledger for a new budget."
        )


def stored_budget(meta: dict[str, str], path: str) -> PrivacyBudget:
    try:
        return PrivacyBudget(float(meta["budget_epsilon"]), float(meta["budget_delta"]))
    except (KeyError, ValueError) as exc:  # ConfigError is a ValueError
        raise LedgerError(
            f"meta table of ledger {path} must hold a valid budget, got {meta!r}."
        ) from exc


RUN_OWNED_PID = 0
"""The pid stored for a reservation owned by a federated run rather than by one process."""


def pid_is_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host (POSIX; elsewhere always True).

    A reused pid reads as alive, which only keeps a stale entry counted (fail closed).
    """
    if os.name != "posix":
        # os.kill(pid, 0) terminates the process on Windows: never probe there.
        return True
    if pid == RUN_OWNED_PID:
        # Held by a federated run that outlives any one process (Flower starts a fresh
        # ClientApp process per message): only the run's own messages, or an admin, end it.
        return True
    if pid < 0:
        # kill(-n) would signal a process group; no ledger ever stores such a pid.
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True

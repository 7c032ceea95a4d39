"""The privacy ledger: every release that spent a population's budget, on disk, two-phase.

How this connects: one kind of ledger serves the consortium (at the coordinator) and each
site (for its own data). Before the first noisy output of a release the owner calls
:meth:`PrivacyLedger.reserve` (refused if the composition would overspend the budget), then
:meth:`~PrivacyLedger.mark_exposed` just before noise is drawn, and
:meth:`~PrivacyLedger.commit` once the release is out. A release that stops before any noise
existed is :meth:`~PrivacyLedger.abort`-ed, which refunds it::

    reserved ──mark_exposed──▶ exposed ──commit──▶ committed
       │ └───────────────────commit───────────────────▲
       └──abort──▶ aborted            (exposed can never be aborted)

What is composed: costs are never added up. :meth:`PrivacyLedger.spent` re-runs
:func:`~dpmtv_common.privacy.accounting.epsilon_bound` (smaller of RDP and PLD) over the
stored :class:`~dpmtv_common.privacy.events.ReleaseEvent` of every *counted* release, at the
budget's δ, so repeated releases compose tightly. Reserved and exposed releases count as
well as committed ones (fail closed): a reservation is a claim that noise is about to be
drawn, and two concurrent releases must not both fit into the same remaining budget.

Crash recovery (in :meth:`PrivacyLedger.open`): a reserved or exposed entry whose owning
process is gone is resolved. Reserved becomes aborted, because ``mark_exposed`` precedes
every noisy output, so none existed. Exposed becomes committed, because noise may have left
the process. A process that exits without resolving its releases counts as crashed. Should a
pid be misread (another pid namespace), this stays safe: a refunded release cannot be marked
exposed any more, so it draws no noise.

Storage: SQLite in WAL mode with ``synchronous=FULL``; every write is one ``BEGIN IMMEDIATE``
transaction, so it is atomic, durable, and serialised with other processes.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from dpmtv_common.errors import ConfigError, LedgerError, PrivacyBudgetExceededError
from dpmtv_common.privacy import _ledger_schema as schema
from dpmtv_common.privacy._ledger_schema import LedgerEntry, ReleaseState
from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger_files import LedgerFile

__all__ = ["LedgerEntry", "PrivacyLedger", "ReleaseState", "Reservation"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reservation:
    """A granted reservation.

    Attributes:
        release_id: The reserved release.
        total: Composition of every counted release including this one, at the budget's δ.
    """

    release_id: str
    total: EpsilonBound


def _check_text(name: str, value: str) -> None:
    if not (isinstance(value, str) and value.strip()):
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}.")


def _check_release(
    release_id: str, plan_hash: str, epsilon: float, delta: float, accountant: str
) -> None:
    for name, text in (
        ("release_id", release_id),
        ("plan_hash", plan_hash),
        ("accountant", accountant),
    ):
        _check_text(name, text)
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ConfigError(f"epsilon must be finite and > 0, got {epsilon!r}.")
    if not (0.0 <= delta < 1.0):
        raise ConfigError(f"delta must lie in [0, 1), got {delta!r}.")


class PrivacyLedger:
    """A durable, two-phase record of the releases that spent one population's budget.

    Open with :meth:`open`; use as a context manager or call :meth:`close`.
    """

    def __init__(self, conn: sqlite3.Connection, budget: PrivacyBudget, path: str) -> None:
        self._conn = conn
        self._budget = budget
        self._path = path

    @classmethod
    def open(cls, path: str | os.PathLike[str], budget: PrivacyBudget) -> PrivacyLedger:
        """Open (or create) the ledger at ``path`` and resolve entries of crashed processes.

        Raises:
            ConfigError: if the ledger was created with another budget.
            LedgerError: if the file is not a readable ledger of this schema version.
        """
        where = os.fspath(path)
        # A site's first release creates its ledger: make the folder, not just the file.
        Path(where).parent.mkdir(parents=True, exist_ok=True)
        conn = schema.connect(where)
        ledger = cls(conn, budget, where)
        try:
            with schema.write_transaction(conn, where):
                schema.create_or_check(conn, budget, where)
            ledger._recover_crashed()
        except BaseException:
            conn.close()
            raise
        return ledger

    @property
    def budget(self) -> PrivacyBudget:
        """The (epsilon, delta) this ledger was created with."""
        return self._budget

    def close(self) -> None:
        """Close the database connection; every write is already durable."""
        self._conn.close()

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def spent(self) -> EpsilonBound | None:
        """Composition of every reserved, exposed or committed release; None if there is none.

        Reservations count (fail closed): their noise may be drawn at any moment.
        """
        with schema.sqlite_errors_as_ledger_errors(self._path):
            events = self._counted_events(self._conn)
        return epsilon_bound(events, delta=self._budget.delta) if events else None

    def reserve(
        self,
        *,
        release_id: str,
        plan_hash: str,
        event: ReleaseEvent,
        epsilon: float,
        delta: float,
        accountant: str,
        note: str = "",
        owned_by_run: bool = False,
        privacy_unit: str = "example",
    ) -> Reservation:
        """Reserve a release before any of its noisy output exists.

        The check composes every counted release plus ``event`` at the budget's δ, under
        the database write lock, so concurrent reservations cannot both take the rest.
        By default the calling process owns the reservation and crash recovery resolves it
        when that process is gone. With ``owned_by_run`` (a site in a federated run, whose
        stages run in separate processes) only ``commit``/``abort`` end it: a run that never
        finishes leaves it counted (fail closed) until an admin resolves it. ``privacy_unit``
        is what the release's ε protects (``"example"`` or ``"group"``), kept for display:
        costs compose the same way, and a composition holds per group only when every
        counted release was group-level (:meth:`counted_unit`).

        Raises:
            PrivacyBudgetExceededError: if the total would exceed the budget's ε or
                ``delta`` exceeds its δ; nothing is written.
            LedgerError: if ``release_id`` is already in the ledger.
        """
        _check_release(release_id, plan_hash, epsilon, delta, accountant)
        if privacy_unit not in schema.PRIVACY_UNITS:
            raise ConfigError(
                f"privacy_unit must be one of {schema.PRIVACY_UNITS}, got {privacy_unit!r}."
            )
        with schema.write_transaction(self._conn, self._path) as conn:
            if (row := conn.execute(schema.SELECT_STATE, (release_id,)).fetchone()) is not None:
                raise LedgerError(
                    f"release_id must be new to this ledger, got {release_id!r} "
                    f"(reserved at {row[1]}, now {row[0]})."
                )
            counted = self._counted_events(conn)
            total = epsilon_bound([*counted, event], delta=self._budget.delta)
            self._refuse_overspend(counted, total, release_id, epsilon, delta)
            now = schema.utc_now()
            values = (release_id, plan_hash, event.to_json(), epsilon, delta, accountant)
            owner = schema.RUN_OWNED_PID if owned_by_run else os.getpid()
            conn.execute(schema.INSERT_RELEASE, (*values, owner, now, now, note, privacy_unit))
        return Reservation(release_id, total)

    def mark_exposed(self, release_id: str) -> None:
        """Record, just BEFORE the first noisy output is computed, that it can't be refunded."""
        self._transition(release_id, ReleaseState.EXPOSED, (ReleaseState.RESERVED,))

    def commit(self, release_id: str) -> None:
        """Record that the release is out: reserved or exposed becomes committed."""
        allowed = (ReleaseState.RESERVED, ReleaseState.EXPOSED)
        self._transition(release_id, ReleaseState.COMMITTED, allowed)

    def abort(self, release_id: str, reason: str) -> None:
        """Refund a reserved release that drew no noise; ``reason`` is kept as its note."""
        _check_text("reason", reason)
        self._transition(release_id, ReleaseState.ABORTED, (ReleaseState.RESERVED,), reason)

    def merge(self, other: LedgerFile) -> list[str]:
        """Copy into this ledger every release of ``other`` it lacks, with its state; their ids.

        The copies count as they counted there (a committed release stays spent), even past
        this ledger's budget: the cost was paid, and once over budget every new reservation
        is refused. Merging twice copies nothing the second time.

        Raises:
            LedgerError: ``other`` has a release still open (resolve it there first), or one
                whose id this ledger holds for another plan; nothing is written.
        """
        if other.open_ids():
            raise LedgerError(
                f"releases of ledger {other.path} must be resolved before a merge, got "
                f"{list(other.open_ids())} still open: --commit or --abort them there first."
            )
        with schema.write_transaction(self._conn, self._path) as conn:
            added = []
            for entry in other.entries:
                row = conn.execute(schema.SELECT_PLAN_HASH, (entry.release_id,)).fetchone()
                if row is not None:
                    if row[0] != entry.plan_hash:
                        raise LedgerError(
                            f"release_id {entry.release_id!r} must name one release, got "
                            f"another plan under that id in {other.path}; nothing merged."
                        )
                    continue
                conn.execute(schema.INSERT_MERGED, _merged_row(entry, other.path))
                added.append(entry.release_id)
        return added

    def releases(self) -> list[LedgerEntry]:
        """Every release ever reserved, in reservation order, for display."""
        with schema.sqlite_errors_as_ledger_errors(self._path):
            rows = self._conn.execute(schema.SELECT_ENTRIES).fetchall()
        return [schema.entry_from_row(row) for row in rows]

    def counted_unit(self) -> str:
        """The unit the composition of every counted release holds for.

        ``"group"`` only when every counted release was group-level; one example-level
        release makes the composition an example-level bound (a group-level ε holds per
        example as well, an example-level one says nothing of a whole group).
        """
        counted = (ReleaseState.RESERVED, ReleaseState.EXPOSED, ReleaseState.COMMITTED)
        units = {entry.privacy_unit for entry in self.releases() if entry.state in counted}
        return "group" if units == {"group"} else "example"

    def _counted_events(self, conn: sqlite3.Connection) -> list[ReleaseEvent]:
        rows = conn.execute(schema.SELECT_COUNTED_EVENTS).fetchall()
        try:
            return [ReleaseEvent.from_json(text) for (text,) in rows]
        except ConfigError as exc:
            raise LedgerError(f"ledger {self._path} must hold valid events: {exc}") from exc

    def _refuse_overspend(
        self,
        counted: list[ReleaseEvent],
        total: EpsilonBound,
        release_id: str,
        epsilon: float,
        delta: float,
    ) -> None:
        budget = self._budget
        if total.epsilon <= budget.epsilon and delta <= budget.delta:
            return
        before = epsilon_bound(counted, delta=budget.delta).epsilon if counted else 0.0
        raise PrivacyBudgetExceededError(
            f"release {release_id!r} must fit the budget (epsilon={budget.epsilon!r}, "
            f"delta={budget.delta!r}), got total epsilon={total.epsilon!r} ({total.accountant})"
            f" = already spent epsilon={before!r} composed with this release "
            f"(epsilon={epsilon!r}, delta={delta!r}). Nothing was reserved."
        )

    def _transition(
        self,
        release_id: str,
        to: ReleaseState,
        allowed: tuple[ReleaseState, ...],
        note: str | None = None,
    ) -> None:
        with schema.write_transaction(self._conn, self._path) as conn:
            row = conn.execute(schema.SELECT_STATE, (release_id,)).fetchone()
            if row is None:
                raise LedgerError(
                    f"release_id must name a release in this ledger, got {release_id!r}."
                )
            state = ReleaseState(row[0])
            if state not in allowed:
                raise LedgerError(_transition_refusal(release_id, state, to, allowed))
            conn.execute(schema.UPDATE_STATE, (to.value, schema.utc_now(), note, release_id))

    def _recover_crashed(self) -> None:
        """Resolve reserved/exposed entries whose owning process no longer exists."""
        with schema.write_transaction(self._conn, self._path) as conn:
            for release_id, state, pid in conn.execute(schema.SELECT_PENDING).fetchall():
                if schema.pid_is_alive(pid):
                    continue  # its owner may still expose or commit it
                # Reserved: mark_exposed precedes any noise, so nothing was spent. Exposed:
                # noise may have left the process, so it stays spent for good (fail closed).
                exposed = state == ReleaseState.EXPOSED
                to = ReleaseState.COMMITTED if exposed else ReleaseState.ABORTED
                note = f"recovered after crash of pid {pid}"
                conn.execute(schema.UPDATE_STATE, (to.value, schema.utc_now(), note, release_id))
                _log.warning("ledger %s: %r %s -> %s, %s", self._path, release_id, state, to, note)


def _merged_row(entry: LedgerEntry, source: Path) -> tuple[object, ...]:
    note = f"merged from {source}" + (f": {entry.note}" if entry.note else "")
    return (
        entry.release_id,
        entry.plan_hash,
        entry.event.to_json(),
        entry.epsilon,
        entry.delta,
        entry.accountant,
        entry.state.value,
        schema.RUN_OWNED_PID,  # finished releases only: no process owns them
        entry.created_utc.isoformat(),
        schema.utc_now(),
        note,
        entry.privacy_unit,
    )


def _transition_refusal(
    release_id: str, state: ReleaseState, to: ReleaseState, allowed: tuple[ReleaseState, ...]
) -> str:
    expected = " or ".join(repr(s.value) for s in allowed)
    message = (
        f"state of release {release_id!r} must be {expected} to become {to.value!r}, "
        f"got {state.value!r}."
    )
    if to is ReleaseState.ABORTED and state is ReleaseState.EXPOSED:
        message += " Its noise was already drawn, so it can never be refunded; commit it."
    return message

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

from dpmtv_common.errors import ConfigError, LedgerError, PrivacyBudgetExceededError
from dpmtv_common.privacy import _ledger_schema
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState, Reservation
from dpmtv_common.privacy.ledger_files import read_ledger_file

DELTA = 1e-5
EVENT = ReleaseEvent(5.0, 8, 0.1)  # alone: epsilon ~ 0.99; two composed: ~ 1.45 at DELTA
BUDGET = PrivacyBudget(epsilon=3.0, delta=DELTA)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.sqlite"


@pytest.fixture
def ledger(path: Path) -> Iterator[PrivacyLedger]:
    with PrivacyLedger.open(path, BUDGET) as opened:
        yield opened


def reserve(ledger: PrivacyLedger, release_id: str, *, delta: float = 1e-6) -> Reservation:
    return ledger.reserve(
        release_id=release_id,
        plan_hash="plan-" + release_id,
        event=EVENT,
        epsilon=0.99,
        delta=delta,
        accountant="rdp",
    )


def states(ledger: PrivacyLedger) -> dict[str, ReleaseState]:
    return {entry.release_id: entry.state for entry in ledger.releases()}


def test_spent_is_none_for_a_new_ledger(ledger: PrivacyLedger) -> None:
    assert ledger.spent() is None
    assert ledger.releases() == []


def test_reserve_and_commit_compose_like_epsilon_bound(ledger: PrivacyLedger) -> None:
    # Arrange
    expected = epsilon_bound([EVENT, EVENT], delta=DELTA)
    # Act
    reserve(ledger, "r1")
    ledger.commit("r1")
    second = reserve(ledger, "r2")
    ledger.mark_exposed("r2")
    ledger.commit("r2")
    # Assert
    assert ledger.spent() == expected
    assert second.total == expected
    assert expected.epsilon > epsilon_bound([EVENT], delta=DELTA).epsilon
    assert states(ledger) == {"r1": ReleaseState.COMMITTED, "r2": ReleaseState.COMMITTED}


def test_reservations_count_as_spent_before_commit(ledger: PrivacyLedger) -> None:
    reserve(ledger, "r1")
    assert ledger.spent() == epsilon_bound([EVENT], delta=DELTA)


def test_overspend_is_refused_with_the_numbers_and_writes_nothing(path: Path) -> None:
    # Arrange: one release fits epsilon=1.2, two composed (~1.45) do not.
    budget = PrivacyBudget(epsilon=1.2, delta=DELTA)
    spent_before = epsilon_bound([EVENT], delta=DELTA).epsilon
    total = epsilon_bound([EVENT, EVENT], delta=DELTA).epsilon
    with PrivacyLedger.open(path, budget) as ledger:
        reserve(ledger, "r1")
        # Act
        with pytest.raises(PrivacyBudgetExceededError) as caught:
            reserve(ledger, "r2")
        # Assert
        message = str(caught.value)
        for number in (spent_before, total, 0.99, 1.2, DELTA):
            assert repr(number) in message
        assert [entry.release_id for entry in ledger.releases()] == ["r1"]
        assert ledger.spent() == epsilon_bound([EVENT], delta=DELTA)


def test_release_delta_above_budget_delta_is_refused(ledger: PrivacyLedger) -> None:
    with pytest.raises(PrivacyBudgetExceededError, match=r"delta=0\.001"):
        reserve(ledger, "r1", delta=1e-3)
    assert ledger.releases() == []


def test_abort_refunds_the_reservation(ledger: PrivacyLedger) -> None:
    reserve(ledger, "r1")
    ledger.abort("r1", "site dropped out before noise")
    assert ledger.spent() is None
    (entry,) = ledger.releases()
    assert entry.state is ReleaseState.ABORTED
    assert entry.note == "site dropped out before noise"


def test_abort_makes_room_for_a_release_that_would_not_fit(path: Path) -> None:
    # Arrange: epsilon=1.2 holds one release but not two.
    with PrivacyLedger.open(path, PrivacyBudget(epsilon=1.2, delta=DELTA)) as ledger:
        reserve(ledger, "r1")
        ledger.abort("r1", "stopped before noise")
        # Act
        reservation = reserve(ledger, "r2")
        # Assert
        assert reservation.total == epsilon_bound([EVENT], delta=DELTA)


def test_exposed_release_cannot_be_aborted(ledger: PrivacyLedger) -> None:
    reserve(ledger, "r1")
    ledger.mark_exposed("r1")
    with pytest.raises(LedgerError, match=r"got 'exposed'\. Its noise was already drawn"):
        ledger.abort("r1", "too late")
    assert states(ledger) == {"r1": ReleaseState.EXPOSED}


@pytest.mark.parametrize(
    ("finish", "step", "state"),
    [
        ("commit", "mark_exposed", "committed"),
        ("commit", "commit", "committed"),
        ("abort", "commit", "aborted"),
        ("abort", "mark_exposed", "aborted"),
    ],
)
def test_wrong_transitions_state_the_current_state(
    ledger: PrivacyLedger, finish: str, step: str, state: str
) -> None:
    reserve(ledger, "r1")
    if finish == "commit":
        ledger.commit("r1")
    else:
        ledger.abort("r1", "stopped")
    with pytest.raises(LedgerError, match=f"got '{state}'"):
        getattr(ledger, step)("r1")


def test_unknown_release_id_is_refused(ledger: PrivacyLedger) -> None:
    with pytest.raises(LedgerError, match="got 'missing'"):
        ledger.commit("missing")


def test_duplicate_release_id_is_refused_even_after_abort(ledger: PrivacyLedger) -> None:
    reserve(ledger, "r1")
    ledger.abort("r1", "stopped")
    with pytest.raises(LedgerError, match="release_id must be new"):
        reserve(ledger, "r1")
    assert len(ledger.releases()) == 1


def test_reopen_with_another_budget_is_refused_naming_both(path: Path) -> None:
    PrivacyLedger.open(path, BUDGET).close()
    with pytest.raises(ConfigError) as caught:
        PrivacyLedger.open(path, PrivacyBudget(epsilon=4.0, delta=DELTA))
    assert "epsilon=3.0" in str(caught.value)
    assert "epsilon=4.0" in str(caught.value)


def test_state_persists_across_reopen(path: Path) -> None:
    # Arrange
    with PrivacyLedger.open(path, BUDGET) as ledger:
        reserve(ledger, "r1")
        ledger.commit("r1")
        reserve(ledger, "r2")
        ledger.mark_exposed("r2")
        reserve(ledger, "r3")
        before = ledger.releases()
    # Act: this process is alive, so reopening must not resolve r2 or r3.
    with PrivacyLedger.open(path, BUDGET) as ledger:
        after = ledger.releases()
        spent = ledger.spent()
    # Assert
    assert after == before
    assert spent == epsilon_bound([EVENT] * 3, delta=DELTA)


def test_entries_record_owner_and_utc_times(ledger: PrivacyLedger) -> None:
    reserve(ledger, "r1")
    (entry,) = ledger.releases()
    assert entry.pid == os.getpid()
    assert entry.event == EVENT
    assert (entry.plan_hash, entry.epsilon, entry.delta, entry.accountant) == (
        "plan-r1",
        0.99,
        1e-6,
        "rdp",
    )
    assert entry.created_utc.tzinfo == UTC
    assert entry.updated_utc >= entry.created_utc


def test_file_is_wal_and_records_schema_and_budget(path: Path) -> None:
    PrivacyLedger.open(path, BUDGET).close()
    with closing(sqlite3.connect(path)) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    assert mode == "wal"
    assert meta["schema_version"] == str(_ledger_schema.SCHEMA_VERSION)
    assert (float(meta["budget_epsilon"]), float(meta["budget_delta"])) == (3.0, DELTA)


def test_unknown_schema_version_is_refused(path: Path) -> None:
    PrivacyLedger.open(path, BUDGET).close()
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(LedgerError, match="got '99'"):
        PrivacyLedger.open(path, BUDGET)


def test_a_file_that_is_not_a_database_is_refused(path: Path) -> None:
    path.write_bytes(b"not a database, just some bytes" * 100)
    with pytest.raises(LedgerError, match="must be a readable dpmtv ledger"):
        PrivacyLedger.open(path, BUDGET)


@pytest.mark.parametrize(
    ("field", "value"),
    [("release_id", " "), ("plan_hash", ""), ("epsilon", float("nan")), ("delta", 1.0)],
)
def test_invalid_release_arguments_are_refused(
    ledger: PrivacyLedger, field: str, value: object
) -> None:
    arguments: dict[str, Any] = {
        "release_id": "r1",
        "plan_hash": "p",
        "event": EVENT,
        "epsilon": 0.99,
        "delta": 1e-6,
        "accountant": "rdp",
        field: value,
    }
    with pytest.raises(ConfigError, match=f"{field} must"):
        ledger.reserve(**arguments)
    assert ledger.releases() == []


def test_pid_lookup_treats_permission_denied_as_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    def deny(pid: int, signal: int) -> None:
        raise PermissionError(pid)

    monkeypatch.setattr(os, "kill", deny)
    assert _ledger_schema.pid_is_alive(12345)


def test_pid_lookup_reports_a_vanished_process_and_never_probes_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def vanished(pid: int, signal: int) -> None:
        raise ProcessLookupError(pid)

    monkeypatch.setattr(os, "kill", vanished)
    assert not _ledger_schema.pid_is_alive(12345)
    assert not _ledger_schema.pid_is_alive(-1)
    # pid 0 marks a run-owned reservation, never resolved by process liveness.
    assert _ledger_schema.pid_is_alive(_ledger_schema.RUN_OWNED_PID)


def test_run_owned_reservation_survives_its_process_and_still_counts(tmp_path: Path) -> None:
    # Arrange: a reservation owned by a federated run, as a site makes in the plan stage.
    path = tmp_path / "ledger.sqlite"
    budget = PrivacyBudget(10.0, 1e-5)
    with PrivacyLedger.open(path, budget) as ledger:
        ledger.reserve(
            release_id="run-1",
            plan_hash="h",
            event=ReleaseEvent(5.0, 8, 0.1),
            epsilon=1.0,
            delta=1e-5,
            accountant="rdp",
            owned_by_run=True,
        )
    # Act: another process-level open runs crash recovery.
    with PrivacyLedger.open(path, budget) as reopened:
        entries = reopened.releases()
        spent = reopened.spent()
    # Assert
    assert entries[0].state is ReleaseState.RESERVED
    assert entries[0].pid == 0
    assert spent is not None


def test_open_creates_missing_parent_folders(tmp_path: Path) -> None:
    path = tmp_path / "site" / "ledgers" / "ledger.sqlite"
    with PrivacyLedger.open(path, PrivacyBudget(1.0, 1e-5)) as ledger:
        assert ledger.spent() is None
    assert path.is_file()


# ---------------------------------------------------------------- privacy unit


_VERSION_1_TABLE = """CREATE TABLE releases (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, release_id TEXT NOT NULL UNIQUE,
    plan_hash TEXT NOT NULL, event_json TEXT NOT NULL, epsilon REAL NOT NULL,
    delta REAL NOT NULL, accountant TEXT NOT NULL, state TEXT NOT NULL, pid INTEGER NOT NULL,
    created_utc TEXT NOT NULL, updated_utc TEXT NOT NULL, note TEXT NOT NULL DEFAULT '')"""


def test_each_release_keeps_its_privacy_unit(ledger: PrivacyLedger) -> None:
    # Act
    reserve(ledger, "r-example")
    ledger.reserve(
        release_id="r-group",
        plan_hash="plan-g",
        event=EVENT,
        epsilon=0.99,
        delta=1e-6,
        accountant="rdp",
        privacy_unit="group",
    )
    # Assert
    units = {entry.release_id: entry.privacy_unit for entry in ledger.releases()}
    assert units == {"r-example": "example", "r-group": "group"}


def test_the_composition_holds_per_group_only_when_every_release_was_group_level(
    ledger: PrivacyLedger,
) -> None:
    def group(release_id: str) -> None:
        ledger.reserve(
            release_id=release_id,
            plan_hash="plan-" + release_id,
            event=EVENT,
            epsilon=0.99,
            delta=1e-6,
            accountant="rdp",
            privacy_unit="group",
        )

    group("g1")
    assert ledger.counted_unit() == "group"
    reserve(ledger, "e1")
    assert ledger.counted_unit() == "example"
    ledger.abort("e1", "refunded")  # an aborted release no longer counts
    assert ledger.counted_unit() == "group"


def test_an_unknown_privacy_unit_is_refused(ledger: PrivacyLedger) -> None:
    with pytest.raises(ConfigError, match="privacy_unit must be one of"):
        ledger.reserve(
            release_id="r1",
            plan_hash="p",
            event=EVENT,
            epsilon=0.99,
            delta=1e-6,
            accountant="rdp",
            privacy_unit="user",
        )


def test_a_version_1_ledger_is_migrated_and_keeps_every_release_counted(path: Path) -> None:
    # Arrange: a ledger as version 1 wrote it, one release committed.
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute(_VERSION_1_TABLE)
        conn.executemany(
            "INSERT INTO meta VALUES (?, ?)",
            [("schema_version", "1"), ("budget_epsilon", "3.0"), ("budget_delta", "1e-05"),
             ("created_utc", "2025-01-01T00:00:00+00:00")],
        )  # fmt: skip
        conn.execute(
            "INSERT INTO releases (release_id, plan_hash, event_json, epsilon, delta, "
            "accountant, state, pid, created_utc, updated_utc) VALUES "
            "('old', 'p', ?, 0.99, 1e-6, 'rdp', 'committed', 1, "
            "'2025-01-01T00:00:00+00:00', '2025-01-01T00:00:00+00:00')",
            (EVENT.to_json(),),
        )
    # Act
    with PrivacyLedger.open(path, BUDGET) as opened:
        (entry,) = opened.releases()
        spent = opened.spent()
    # Assert: still counted, labelled per example (never a group-level claim it lacked).
    assert entry.state is ReleaseState.COMMITTED
    assert entry.privacy_unit == "example"
    assert spent is not None
    assert spent.epsilon == pytest.approx(epsilon_bound([EVENT], delta=DELTA).epsilon)
    with closing(sqlite3.connect(path)) as conn:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    assert meta["schema_version"] == "2"


# ---------------------------------------------------------------- another ledger file


def test_merging_copies_what_is_missing_once_and_counts_it(tmp_path: Path) -> None:
    # Arrange: one committed release in another file
    with PrivacyLedger.open(tmp_path / "other.sqlite", BUDGET) as other:
        reserve(other, "elsewhere")
        other.commit("elsewhere")
    source = read_ledger_file(tmp_path / "other.sqlite")
    with PrivacyLedger.open(tmp_path / "site.sqlite", BUDGET) as site:
        # Act
        first = site.merge(source)
        again = site.merge(source)
        # Assert
        assert (first, again) == (["elsewhere"], [])
        assert states(site) == {"elsewhere": ReleaseState.COMMITTED}
        assert site.spent() is not None
    assert source.budget == BUDGET


def test_a_merge_is_refused_while_the_other_ledger_has_an_open_release(tmp_path: Path) -> None:
    with PrivacyLedger.open(tmp_path / "other.sqlite", BUDGET) as other:
        reserve(other, "open")
    with (
        PrivacyLedger.open(tmp_path / "site.sqlite", BUDGET) as site,
        pytest.raises(LedgerError, match="must be resolved before a merge"),
    ):
        site.merge(read_ledger_file(tmp_path / "other.sqlite"))


def test_a_merge_is_refused_when_one_id_names_two_plans(tmp_path: Path) -> None:
    with PrivacyLedger.open(tmp_path / "other.sqlite", BUDGET) as other:
        reserve(other, "r1")
        other.commit("r1")
    with PrivacyLedger.open(tmp_path / "site.sqlite", BUDGET) as site:
        site.reserve(
            release_id="r1", plan_hash="another", event=EVENT, epsilon=0.99, delta=1e-6,
            accountant="rdp",
        )  # fmt: skip
        with pytest.raises(LedgerError, match="must name one release"):
            site.merge(read_ledger_file(tmp_path / "other.sqlite"))


def test_reading_a_missing_or_foreign_file_is_a_ledger_error(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="existing file"):
        read_ledger_file(tmp_path / "none.sqlite")
    with closing(sqlite3.connect(tmp_path / "empty.sqlite")) as conn:
        conn.execute("CREATE TABLE x (y)")
    with pytest.raises(LedgerError, match="releases table"):
        read_ledger_file(tmp_path / "empty.sqlite")

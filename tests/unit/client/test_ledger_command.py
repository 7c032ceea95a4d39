"""``dpmtv-site ledger`` says what is spent apart from what is only reserved."""

from __future__ import annotations

import re

from client.cli.main import main
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import PrivacyLedger

DELTA = 1e-5
EVENT = ReleaseEvent(5.0, 8, 0.1)  # alone: epsilon ~ 0.99


def _reserve(ledger: PrivacyLedger, release_id: str) -> None:
    ledger.reserve(
        release_id=release_id,
        plan_hash="sha256:" + "0" * 64,
        event=EVENT,
        epsilon=1.0,
        delta=DELTA,
        accountant="rdp",
        owned_by_run=True,  # a federated site's reservation: only commit or abort end it
    )


def _epsilon_after(label: str, text: str) -> float:
    match = re.search(rf"^{re.escape(label)} epsilon=([0-9.]+)", text, flags=re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


def test_a_reservation_is_shown_apart_from_what_is_spent(tmp_path, capsys):
    # Arrange: one committed release and one still reserved (e.g. after flwr stop)
    path = tmp_path / "ledger.sqlite"
    with PrivacyLedger.open(path, PrivacyBudget(10.0, DELTA)) as ledger:
        _reserve(ledger, "done")
        ledger.commit("done")
        _reserve(ledger, "open")

    # Act
    code = main(["ledger", "--ledger", str(path)])
    printed = capsys.readouterr().out

    # Assert: spent is the committed release alone; the reservation is named, not spent
    one = epsilon_bound([EVENT], delta=DELTA).epsilon
    both = epsilon_bound([EVENT, EVENT], delta=DELTA).epsilon
    assert code == 0
    assert _epsilon_after("spent:", printed) == float(f"{one:.4g}")
    assert "by 1 releases" in printed
    assert "reserved: 1 open (open): refunded if aborted, spent if committed" in printed
    assert f"with them epsilon={both:.4g}" in printed
    assert _epsilon_after("counted against the budget:", printed) == float(f"{both:.4g}")


def test_an_aborted_reservation_is_neither_spent_nor_reserved(tmp_path, capsys):
    path = tmp_path / "ledger.sqlite"
    with PrivacyLedger.open(path, PrivacyBudget(10.0, DELTA)) as ledger:
        _reserve(ledger, "open")

    code = main(["ledger", "--ledger", str(path), "--abort", "open", "--reason", "flwr stop"])
    printed = capsys.readouterr().out

    assert code == 0
    assert "spent: nothing" in printed
    assert "reserved:" not in printed
    assert "counted against the budget: nothing of epsilon=10.0" in printed

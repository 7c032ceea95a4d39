"""The one table of record/ledger pairs: every step of a real Site lands in it, nothing else runs.

The Site here is the real ``client.release.site.Site`` on a real ledger and real records; only what
needs a model or a signed artifact is stood in for (the plan's policy check, the model's
shape and sums, the artifact's signature check), none of which moves a state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

import client.release.site
from client.data.records import SiteDataset
from client.models import LoadedModel
from client.release.policy import ModelShape
from client.release.record import ReleaseRecord, SiteReleaseState
from client.release.site import Site
from client.release.states import (
    BESIDE,
    SETTLEMENT,
    Settlement,
    anything_sent,
    in_step,
    require_in_step,
    settlement,
)
from client.settings import SiteSettings
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import LedgerError
from dpmtv_common.heads import HeadLayout
from dpmtv_common.privacy.ledger import ReleaseState
from protocol import (
    AbortNotice,
    ReleaseRequest,
    SecureSumRequest,
    StageOrderError,
)
from tests.plans import make_plan

RUN = 7
M_I = 3
SHAPE = ModelShape(HeadLayout(2, 4), 16)
EXTRACT = SecureSumRequest(
    release_id="r1", stage="extract", heads=None, clip_norm=1.0, score_top_r=None
)
ARTIFACT = ReleaseRequest(release_id="r1", manifest_json="{}", tensors=b"t", signature=b"s")
OPEN = (SiteReleaseState.PLANNED, SiteReleaseState.CONTRIBUTED)
FINAL = (SiteReleaseState.RELEASED, SiteReleaseState.ABORTED)


@dataclass(frozen=True)
class StandInModel:
    fingerprint: str = "sha256:" + "0" * 64
    dtype_name: str = "float32"

    def with_image_crops(self, crops: object) -> StandInModel:
        return self


class ModelFreeSite(Site):
    """The real Site; its model-bound parts (shape, data listing, sums) stood in for."""

    def model(self) -> LoadedModel:
        return cast(LoadedModel, StandInModel())

    def shape(self) -> ModelShape:
        return SHAPE

    def _listed_dataset(self) -> SiteDataset:
        return cast(SiteDataset, SimpleNamespace(privacy_unit="example", instruction=None))

    def _compute(
        self, record: ReleaseRecord, request: SecureSumRequest, seed: int
    ) -> list[np.ndarray]:
        return [np.zeros(4), np.array([float(record.num_chunks)])]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelFreeSite:
    # Checks that need a model, data or keys; each is tested on its own elsewhere.
    monkeypatch.setattr(client.release.site, "check_plan", lambda plan, **_: None)
    monkeypatch.setattr(client.release.site, "planned_num_chunks", lambda *_: M_I)
    monkeypatch.setattr(client.release.site, "prompt_template_digest", lambda _: "0" * 64)
    monkeypatch.setattr(client.release.site, "check_artifact", lambda *_: None)
    monkeypatch.setattr(client.release.site, "load_artifact", lambda *_, **__: object())
    monkeypatch.setattr(TrustedKeys, "from_files", staticmethod(lambda _: None))
    return ModelFreeSite(SiteSettings(name="site-1", state_dir=tmp_path / "state"))


def ledger_state(site: Site, release_id: str = "r1") -> ReleaseState | None:
    with site.ledger() as ledger:
        return {e.release_id: e.state for e in ledger.releases()}.get(release_id)


def pair(site: Site, release_id: str = "r1") -> tuple[ReleaseRecord, ReleaseState | None]:
    return site.records.require(release_id), ledger_state(site, release_id)


def assert_in_table(site: Site, release_id: str = "r1") -> None:
    record, state = pair(site, release_id)
    assert state in BESIDE[(record.state, bool(record.sent))], (record.state, record.sent, state)


def accepted(site: Site, release_id: str = "r1") -> None:
    site.accept_plan(make_plan(release_id=release_id), run_id=RUN)


def contributed(site: Site) -> None:
    accepted(site)
    site.contribution(EXTRACT, run_id=RUN)


def force(site: Site, record_state: SiteReleaseState, ledger: ReleaseState) -> None:
    """Put r1's record and ledger entry in the given states, as an outside change would."""
    accepted(site)
    sent = ("extract",) if record_state is SiteReleaseState.CONTRIBUTED else ()
    record = site.records.require("r1")
    site.records.save(record.changed(state=record_state, sent=sent))
    with site.ledger() as opened:
        if ledger in (ReleaseState.EXPOSED, ReleaseState.COMMITTED):
            opened.mark_exposed("r1")
        if ledger is ReleaseState.COMMITTED:
            opened.commit("r1")
        if ledger is ReleaseState.ABORTED:
            opened.abort("r1", "an outside refund")


# ---------------------------------------------------------------- the tables themselves


def test_every_record_state_has_a_row_and_only_open_ones_are_never_refunded() -> None:
    assert {state for state, _ in BESIDE} == set(SiteReleaseState)
    assert BESIDE[(SiteReleaseState.PLANNED, False)] == {ReleaseState.RESERVED}
    assert BESIDE[(SiteReleaseState.CONTRIBUTED, True)] == {ReleaseState.EXPOSED}
    for (state, sent), allowed in BESIDE.items():
        if sent:  # something left: never beside a refund
            assert ReleaseState.ABORTED not in allowed, state


def test_only_the_pair_with_nothing_sent_and_a_reservation_is_refunded() -> None:
    refunds = [key for key, rule in SETTLEMENT.items() if rule is Settlement.REFUND]
    assert refunds == [(ReleaseState.RESERVED, False)]
    assert (ReleaseState.ABORTED, True) not in SETTLEMENT  # a refund of sent data is refused
    assert all(rule.counts for (_, sent), rule in SETTLEMENT.items() if sent)


@pytest.mark.parametrize(
    ("state", "sent"), [(s, sent) for s in OPEN for sent in ((), ("extract",))]
)
@pytest.mark.parametrize("ledger", list(ReleaseState))
def test_settling_any_open_pair_lands_in_the_table(
    state: SiteReleaseState, sent: tuple[str, ...], ledger: ReleaseState
) -> None:
    record = ReleaseRecord.planned(
        make_plan(), run_id=RUN, num_chunks=M_I, layout=SHAPE.layout, head_dim=16
    ).changed(state=state, sent=sent)
    try:
        rule = settlement(record, ledger)
    except LedgerError:
        assert ledger is ReleaseState.ABORTED
        assert anything_sent(record)
        return
    after = {
        Settlement.COMMIT: ReleaseState.COMMITTED,
        Settlement.REFUND: ReleaseState.ABORTED,
    }.get(rule, ledger)
    finished = record.changed(state=SiteReleaseState.ABORTED)
    assert in_step(finished, after), (state, sent, ledger, rule)
    if in_step(record, ledger):  # a finish only ever settles a pair in step
        assert in_step(record.changed(state=SiteReleaseState.RELEASED), after)


def test_a_record_that_says_contributed_with_nothing_listed_counts() -> None:
    record = ReleaseRecord.planned(
        make_plan(), run_id=RUN, num_chunks=M_I, layout=SHAPE.layout, head_dim=16
    ).changed(state=SiteReleaseState.CONTRIBUTED)
    assert not in_step(record, ReleaseState.RESERVED)
    assert settlement(record, ReleaseState.RESERVED) is Settlement.COMMIT


def test_the_refusal_names_the_states_found_and_expected() -> None:
    record = ReleaseRecord.planned(
        make_plan(), run_id=RUN, num_chunks=M_I, layout=SHAPE.layout, head_dim=16
    )
    with pytest.raises(
        LedgerError,
        match=r"record 'planned' \(nothing sent\) must stand beside ledger state 'reserved', "
        r"got 'committed'",
    ):
        require_in_step(record, ReleaseState.COMMITTED, "secure sum")
    with pytest.raises(LedgerError, match=r"got none \(no ledger entry\)"):
        require_in_step(record, None, "secure sum")


# ---------------------------------------------------------------- every step of the Site


def test_accepting_a_plan_leaves_planned_beside_reserved(site: ModelFreeSite) -> None:
    accepted(site)
    assert pair(site)[0].state is SiteReleaseState.PLANNED
    assert ledger_state(site) is ReleaseState.RESERVED
    assert_in_table(site)


def test_a_contribution_leaves_contributed_beside_exposed(site: ModelFreeSite) -> None:
    contributed(site)
    record, state = pair(site)
    assert (record.state, record.sent, state) == (
        SiteReleaseState.CONTRIBUTED,
        ("extract",),
        ReleaseState.EXPOSED,
    )
    assert_in_table(site)


@pytest.mark.parametrize(
    ("step", "expected"),
    [(contributed, ReleaseState.COMMITTED), (accepted, ReleaseState.ABORTED)],
    ids=["after-a-contribution-committed", "with-nothing-sent-refunded"],
)
def test_a_stored_artifact_is_released_and_settles_by_what_was_sent(
    site: ModelFreeSite, step: Any, expected: ReleaseState
) -> None:
    step(site)
    site.finish(ARTIFACT, run_id=RUN)
    assert pair(site)[0].state is SiteReleaseState.RELEASED
    assert ledger_state(site) is expected
    assert_in_table(site)


@pytest.mark.parametrize(
    ("step", "expected"),
    [(accepted, ReleaseState.ABORTED), (contributed, ReleaseState.COMMITTED)],
    ids=["before-contributing", "after-contributing"],
)
def test_an_abort_settles_by_the_table(
    site: ModelFreeSite, step: Any, expected: ReleaseState
) -> None:
    step(site)
    site.abort(AbortNotice(release_id="r1", reason="x", noisy_output=False), run_id=RUN)
    assert pair(site)[0].state is SiteReleaseState.ABORTED
    assert ledger_state(site) is expected
    assert_in_table(site)


@pytest.mark.parametrize("everything", [True, False], ids=["at-start-or-stop", "when-idle"])
def test_a_sweep_settles_every_open_release_by_the_table(
    site: ModelFreeSite, everything: bool
) -> None:
    contributed(site)
    accepted(site, "r2")
    later = datetime.now(UTC).timestamp() + 10 * site.settings.idle_release_seconds
    assert sorted(site.sweep(now=later, everything=everything)) == ["r1", "r2"]
    assert ledger_state(site, "r1") is ReleaseState.COMMITTED
    assert ledger_state(site, "r2") is ReleaseState.ABORTED
    for release_id in ("r1", "r2"):
        assert site.records.require(release_id).state is SiteReleaseState.ABORTED
        assert_in_table(site, release_id)


# ---------------------------------------------------------------- out of step


OUT_OF_STEP = [
    (SiteReleaseState.CONTRIBUTED, ReleaseState.RESERVED),
    (SiteReleaseState.PLANNED, ReleaseState.EXPOSED),
    (SiteReleaseState.PLANNED, ReleaseState.COMMITTED),
    (SiteReleaseState.CONTRIBUTED, ReleaseState.COMMITTED),
]
FURTHER_STEPS = {
    "secure sum": lambda site: site.contribution(EXTRACT, run_id=RUN),
    "release": lambda site: site.finish(ARTIFACT, run_id=RUN),
    "noisy vector": lambda site: site.store_reference(
        "r1", cast(Any, None), np.zeros(1), run_id=RUN
    ),
}


@pytest.mark.parametrize(("record_state", "ledger"), OUT_OF_STEP)
@pytest.mark.parametrize("action", sorted(FURTHER_STEPS))
def test_a_further_step_on_a_pair_out_of_step_is_refused_and_moves_nothing(
    site: ModelFreeSite, record_state: SiteReleaseState, ledger: ReleaseState, action: str
) -> None:
    force(site, record_state, ledger)
    before = site.records.require("r1")
    with pytest.raises(LedgerError, match=rf"{action} for release 'r1' needs its record and"):
        FURTHER_STEPS[action](site)
    assert site.records.require("r1") == before
    assert ledger_state(site) is ledger
    assert not (site.settings.artifacts_folder / "r1").exists()


@pytest.mark.parametrize(("record_state", "ledger"), OUT_OF_STEP)
def test_a_pair_out_of_step_is_counted_at_service_start_never_refunded(
    site: ModelFreeSite, record_state: SiteReleaseState, ledger: ReleaseState
) -> None:
    force(site, record_state, ledger)
    fresh = ModelFreeSite(site.settings)  # a restarted service: no seeds, records on disk
    assert fresh.sweep(everything=True) == ["r1"]
    record = site.records.require("r1")
    assert record.state is SiteReleaseState.ABORTED
    assert "counted" in record.note
    assert ledger_state(site) is ReleaseState.COMMITTED
    assert_in_table(site)


def test_a_record_that_contradicts_itself_is_counted_at_service_start(
    site: ModelFreeSite,
) -> None:
    # Contributed, but its list of sent sums lost: the record's state alone makes it count.
    accepted(site)
    record = site.records.require("r1")
    site.records.save(record.changed(state=SiteReleaseState.CONTRIBUTED))
    assert ModelFreeSite(site.settings).sweep(everything=True) == ["r1"]
    assert ledger_state(site) is ReleaseState.COMMITTED
    assert_in_table(site)


def test_a_refund_of_data_that_left_is_refused_and_the_others_still_resolve(
    site: ModelFreeSite,
) -> None:
    force(site, SiteReleaseState.CONTRIBUTED, ReleaseState.ABORTED)
    accepted(site, "r2")
    with pytest.raises(LedgerError, match=r"release 'r1' cannot be settled: record 'contributed'"):
        site.sweep(everything=True)
    assert site.records.require("r1").state is SiteReleaseState.CONTRIBUTED  # left open
    assert site.records.require("r2").state is SiteReleaseState.ABORTED
    assert ledger_state(site, "r2") is ReleaseState.ABORTED


def test_a_release_the_ledger_does_not_know_is_refused(site: ModelFreeSite) -> None:
    accepted(site)
    ledger = site.settings.ledger_file
    for suffix in ("", "-wal", "-shm"):  # the whole SQLite ledger, not the records beside it
        ledger.with_name(ledger.name + suffix).unlink(missing_ok=True)
    with pytest.raises(LedgerError, match=r"cannot be settled.*none \(no ledger entry\)"):
        site.abort(AbortNotice(release_id="r1", reason="x", noisy_output=False), run_id=RUN)
    assert site.records.require("r1").state is SiteReleaseState.PLANNED


def test_the_stage_order_checks_still_come_first(site: ModelFreeSite) -> None:
    force(site, SiteReleaseState.PLANNED, ReleaseState.COMMITTED)
    with pytest.raises(StageOrderError, match="must come from run"):
        site.contribution(EXTRACT, run_id=RUN + 1)


def test_every_pair_the_site_can_be_found_in_is_settled_or_refused() -> None:
    # Exhaustive over both tables: no pair of an open record falls through to a refund
    # unless it is the single consistent one.
    plan = make_plan()
    record = ReleaseRecord.planned(
        plan, run_id=RUN, num_chunks=M_I, layout=SHAPE.layout, head_dim=16
    )
    for state, sent, ledger in itertools.product(OPEN, ((), ("x",)), ReleaseState):
        candidate = record.changed(state=state, sent=sent)
        try:
            rule = settlement(candidate, ledger)
        except LedgerError:
            continue
        if rule is Settlement.REFUND:
            assert (state, sent, ledger) == (SiteReleaseState.PLANNED, (), ReleaseState.RESERVED)

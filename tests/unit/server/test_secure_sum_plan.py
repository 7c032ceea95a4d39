"""The plan stage keeps a site for the secure sums only if it sent this release's key for itself."""

from __future__ import annotations

from typing import Any

import pytest

from dpmtv_common.errors import InsufficientSharesError
from dpmtv_common.privacy.testing import SeededNoise
from protocol import ErrorCode, ErrorReply, KeyAdvert, PlanAccept, WireMessage
from server.coordinator import Coordinator, build_plan
from server.messaging import Replies
from server.settings import CoordinatorSettings, RunConfig
from tests.unit.server.coordinator_world import unsigned_keys

RUN = RunConfig(
    model_fingerprint="sha256:" + "0" * 64,
    release_id="r1",
    clip_norm=1.0,
    selection="all",
    min_sites=2,
    expected_sites=5,
)


def keys(node: int, release_id: str = "r1") -> KeyAdvert:
    """A key advertisement of the right shape (the coordinator relays, the sites verify)."""
    return unsigned_keys(node, release_id)


def accept(node: int, advert: KeyAdvert | None) -> PlanAccept:
    return PlanAccept(
        release_id="r1",
        site_name=f"site-{node}",
        num_chunks=5,
        num_layers=2,
        num_heads=4,
        head_dim=16,
        prompt_template_sha256="a" * 64,
        instruction_sha256="b" * 64,
        dpmtv_version="0.1.0",
        keys=advert,
    )


class FixedExchange:
    """Answers the plan with the given replies, whatever was sent."""

    def __init__(self, answers: dict[int, WireMessage]) -> None:
        self.answers = answers

    def broadcast(self, *args: Any) -> Replies:
        return Replies(answers=dict(self.answers), failures={})


def plan_stage(monkeypatch: pytest.MonkeyPatch, answers: dict[int, WireMessage]) -> Coordinator:
    coordinator = Coordinator(
        grid=None,  # type: ignore[arg-type]
        context=None,  # type: ignore[arg-type]
        run=RUN,
        settings=CoordinatorSettings(),
        noise=SeededNoise(0),
    )
    monkeypatch.setattr(coordinator, "_exchange", lambda: FixedExchange(answers))
    coordinator.plan_stage(build_plan(RUN), sorted(answers))
    return coordinator


def test_only_acceptances_with_this_release_s_key_for_the_sender_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Arrange: 2 sends node 9's key, 3 none, 4 a key for another release, 5 refuses.
    answers: dict[int, WireMessage] = {
        1: accept(1, keys(1)),
        2: accept(2, keys(9)),
        3: accept(3, None),
        4: accept(4, keys(4, "r0")),
        5: ErrorReply(code=ErrorCode.POLICY, reason="not today"),
        6: accept(6, keys(6)),
    }

    # Act
    coordinator = plan_stage(monkeypatch, answers)

    # Assert
    assert sorted(coordinator.accepted) == [1, 6]


def test_too_few_sites_with_keys_abort_the_plan_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: three accept, but only one with a key for itself.
    answers: dict[int, WireMessage] = {
        1: accept(1, keys(1)),
        2: accept(2, None),
        3: accept(3, keys(1)),
    }

    # Act / Assert
    with pytest.raises(InsufficientSharesError, match="min-sites=2, got 1") as info:
        plan_stage(monkeypatch, answers)
    assert "without this release's secure-sum key for its node" in str(info.value)


@pytest.mark.parametrize(("sites", "min_sites"), [(10, 10), (12, 12), (20, 19)])
def test_a_sum_that_cannot_hold_the_minimum_with_the_assumed_colluders_stops_before_a_message(
    sites: int, min_sites: int
) -> None:
    # Arrange: a tenth of the sites (one or two) assumed colluding: min-sites honest ones
    # cannot all be tied to every site, so every site would refuse the graph.
    from server.secure_sum import SecureSumSession

    adverts = {node: keys(node) for node in range(1, sites + 1)}

    # Act / Assert
    with pytest.raises(InsufficientSharesError, match="assumed colluding"):
        SecureSumSession(None, "r1", adverts, min_sites)  # type: ignore[arg-type]

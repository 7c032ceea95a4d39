"""What the site service refuses before it counts anything, and what keeps a release alive.

Real site services behind real relays (tiny random LLaVA, three sites, as in
``test_hostile_coordinator``): a coordinator runs a secure sum whose clipping range is too
small for the plan; each site must refuse while its release is still only reserved (what a
site refuses later in a sum, before it reveals anything, is ``test_roster_secure_sum``).
Then junk and refused messages must not renew a release's idle timer, while an accepted
message of its own run does.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import pytest
from flwr.app import Message, RecordDict

from client.service.server import SMALL_FRAME_BYTES
from client.service.wire import FrameKind
from dpmtv_common.errors import ServiceError
from dpmtv_common.privacy.ledger import ReleaseState
from protocol import (
    AbortNotice,
    ErrorCode,
    ErrorReply,
    PlanAccept,
    PlanRequest,
    message_from_record,
    message_to_record,
)
from protocol.secure_sum import SurvivorsRequest, UnmaskRequest, ranges_for
from server.simulation import set_task_identity
from tests.flower_harness import flower_process_state
from tests.integration import test_hostile_coordinator as hostile
from tests.integration.test_hostile_coordinator import (
    SITES,
    Consortium,
    error_code,
    extract_request,
    make_plan,
    planned,
)

pytestmark = pytest.mark.integration

OLD = "2000-01-01T00:00:00+00:00"

# The hostile-coordinator tests' world (tiny model, three sites' data) and consortium.
world = hostile.world
consortium = hostile.consortium


# ---------------------------------------------------------------- refused before exposure


def test_a_clipping_range_too_small_for_the_plan_is_refused_before_exposure(
    consortium: Consortium,
) -> None:
    # Arrange: m_i = 5 chunks of norm <= C = 1 need c >= 5; the coordinator sets up c = 2.
    planned(consortium)
    ranges = ranges_for(2.0, SITES)
    assert ranges.clipping_range < 5
    # Act
    result = consortium.secure_sum(extract_request(), ranges=ranges)
    # Assert: no site took part, and none counted anything: reserved, nothing sent.
    assert result is None
    answers = consortium.answers("query.sum_shares")
    assert [error_code(answers[consortium.node(i)]) for i in range(SITES)] == [
        ErrorCode.PLAN_MISMATCH
    ] * SITES
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.RESERVED
        assert consortium.services[index].site.records.require("r1").sent == ()


# ---------------------------------------------------------------- the idle timer


def _message(consortium: Consortium, run_id: int, message_type: str, body: object) -> Message:
    with flower_process_state():
        set_task_identity()
        content = RecordDict() if body is None else message_to_record(body)  # type: ignore[arg-type]
        message = Message(
            content,
            dst_node_id=consortium.node(0),
            message_type=message_type,
        )
    message.metadata.__dict__["_run_id"] = run_id
    message.metadata.__dict__["_message_id"] = f"m-{run_id}-{message_type}"
    return message


def _age(consortium: Consortium) -> int:
    """Make r1 of site 0 look idle since long ago; return its run."""
    site = consortium.services[0].site
    record = site.records.require("r1")
    site.records.save(record.model_copy(update={"updated": OLD}))
    site.last_seen.clear()
    return record.run_id


def test_refused_messages_of_the_run_do_not_keep_a_release_alive(
    consortium: Consortium,
) -> None:
    # Arrange
    planned(consortium)
    service = consortium.services[0]
    run_id = _age(consortium)
    # Act: a refused plan (its release id is taken), an abort of a release never planned and
    # a secure-sum message without a body, from the release's own run; a message of a type
    # no handler takes (Flower's "train"), and junk.
    for body, message_type in (
        (PlanRequest(plan=make_plan(consortium.world)), "query.plan"),
        (AbortNotice(release_id="other", reason="x", noisy_output=False), "query.abort"),
        (None, "query.sum_shares"),
    ):
        reply = service.handle_message(_message(consortium, run_id, message_type, body))
        assert isinstance(message_from_record(reply.content), ErrorReply)
    no_handler = _message(consortium, run_id, "train", None)
    assert service.handle_message(no_handler).has_error()
    with pytest.raises(ServiceError, match="serialised Flower Message"):
        service.handle_bytes(b"\x00junk")
    # Assert: still idle since its last change; the sweep resolves it.
    assert service.site.sweep() == ["r1"]
    assert consortium.ledger_state(0, "r1") is ReleaseState.ABORTED


@pytest.mark.parametrize("message_type", ["query.sum_survivors", "query.sum_unmask"])
def test_a_refused_survivors_or_unmask_message_does_not_keep_a_release_alive(
    consortium: Consortium, message_type: str
) -> None:
    # Arrange: r1 accepted, no sum begun, idle since long ago.
    planned(consortium)
    service = consortium.services[0]
    run_id = _age(consortium)
    nodes = [consortium.node(i) for i in range(SITES)]
    body = {
        "query.sum_survivors": SurvivorsRequest(
            release_id="r1", sum_index=0, survivors=nodes, boxes=[]
        ),
        "query.sum_unmask": UnmaskRequest(
            release_id="r1", sum_index=0, survivors=nodes, signatures=[]
        ),
    }[message_type]
    # Act: the coordinator sends a survivors or unmask message of the run out of order.
    reply = service.handle_message(_message(consortium, run_id, message_type, body))
    # Assert: refused, and r1 still idle since its last change: the sweep resolves it.
    assert error_code(message_from_record(reply.content)) is ErrorCode.STAGE_ORDER
    assert service.site.sweep() == ["r1"]
    assert consortium.ledger_state(0, "r1") is ReleaseState.ABORTED


def test_an_accepted_message_renews_only_its_own_run_s_releases(
    consortium: Consortium,
) -> None:
    # Arrange
    planned(consortium)
    service = consortium.services[0]
    run_id = _age(consortium)
    # Act: an accepted message of another run (a plan r2) leaves r1 idle...
    other = service.handle_message(
        _message(
            consortium,
            run_id + 1,
            "query.plan",
            PlanRequest(plan=make_plan(consortium.world, "r2")),
        )
    )
    assert isinstance(message_from_record(other.content), PlanAccept)
    assert run_id not in service.site.last_seen
    # ...and an accepted one of r1's run (a plan r3) renews it.
    same = service.handle_message(
        _message(
            consortium, run_id, "query.plan", PlanRequest(plan=make_plan(consortium.world, "r3"))
        )
    )
    assert isinstance(message_from_record(same.content), PlanAccept)
    # Assert
    assert "r1" not in service.site.sweep()


# ---------------------------------------------------------------- the frame bound


def test_an_open_plan_raises_the_message_bound_to_what_it_needs(consortium: Consortium) -> None:
    # Arrange
    service = consortium.services[0]
    assert service.frame_limit(FrameKind.MESSAGE) == SMALL_FRAME_BYTES
    # Act
    planned(consortium)
    # Assert: L x H x D = 2 x 4 x 16 float64 coordinates, twice over, above the small bound.
    assert service.frame_limit(FrameKind.MESSAGE) == SMALL_FRAME_BYTES + 16 * 2 * 4 * 16
    # Resolved releases give the room back.
    consortium.ask(0, "query.abort", AbortNotice(release_id="r1", reason="x", noisy_output=False))
    assert service.frame_limit(FrameKind.MESSAGE) == SMALL_FRAME_BYTES

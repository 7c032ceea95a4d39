"""What the site service refuses before it counts anything, and what keeps a release alive.

Real site services behind real relays (tiny random LLaVA, three sites, as in
``test_hostile_coordinator``): a coordinator sets up a secure sum whose clipping range is
too small for the plan, or forges the neighbours' shares at collect; each site must refuse
while its release is still only reserved. Then junk and refused messages must not renew a
release's idle timer, while an accepted message of its own run does.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import base64
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
)
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

from client.service.handlers import secagg_policy_mod
from client.service.server import SMALL_FRAME_BYTES
from client.service.wire import FrameKind
from client.settings import SiteSettings
from dpmtv_common.errors import PolicyError, ServiceError
from dpmtv_common.privacy.ledger import ReleaseState
from protocol import (
    AbortNotice,
    ErrorReply,
    PlanAccept,
    PlanRequest,
    StageOrderError,
    message_from_record,
    message_to_record,
    secure_sum_request_to_config,
)
from server.secagg import SecureSumSettings, secure_sum
from server.simulation import make_server_context, set_task_identity
from tests.flower_harness import flower_process_state
from tests.integration import test_hostile_coordinator as hostile
from tests.integration.test_hostile_coordinator import (
    SITES,
    Consortium,
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
    settings = SecureSumSettings.for_plan(max_abs_coordinate=2.0, max_sites=SITES, timeout=30.0)
    assert settings.clipping_range < 5
    # Act
    result = secure_sum(
        consortium.grid,
        make_server_context(),
        [consortium.node(i) for i in range(SITES)],
        secure_sum_request_to_config(extract_request()),
        round_id=1,
        settings=settings,
        min_sites=2,
    )
    # Assert: no site took part, and none counted anything: reserved, nothing sent.
    assert result is None
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.RESERVED
        assert consortium.services[index].site.records.require("r1").sent == ()


def _collect_message(sources: list[int], ciphertexts: list[bytes]) -> Message:
    configs = ConfigRecord(
        {
            Key.STAGE: "collect_masked_vectors",
            Key.CIPHERTEXT_LIST: ciphertexts,
            Key.SOURCE_LIST: sources,
        }
    )
    return Message(RecordDict({RECORD_KEY_CONFIGS: configs}), dst_node_id=1, message_type="train")


def _context_after_share_keys(keys: dict[int, bytes], threshold: int) -> Context:
    state = SecAggPlusState(current_stage="share_keys", nid=1, threshold=threshold)
    state.ss2_dict = keys
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
    return context


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("honest", None),
        ("junk ciphertext", PolicyError),  # does not decrypt under the pairwise key
        ("wrong sender", PolicyError),  # node 2's key, node 3's share inside
        ("not for this node", PolicyError),
        ("unknown neighbour", PolicyError),
        ("too few shares", PolicyError),  # threshold 3 needs two neighbours' shares
        ("no share_keys stage", StageOrderError),
    ],
)
def test_forged_shares_at_collect_are_refused_before_the_handler_runs(
    case: str, error: type[Exception] | None
) -> None:
    # Arrange: node 1 after share_keys with neighbours 2 and 3 (Flower's own crypto).
    keys = {
        2: base64.urlsafe_b64encode(os.urandom(32)),
        3: base64.urlsafe_b64encode(os.urandom(32)),
    }

    def share(key_of: int, sender: int, receiver: int) -> bytes:
        plaintext = share_keys_plaintext_concat(sender, receiver, b"seed", b"secret")
        return encrypt(keys[key_of], plaintext)

    shares = {2: share(2, 2, 1), 3: share(3, 3, 1)}
    threshold = 3
    if case == "junk ciphertext":
        shares[3] = b"junk"
    elif case == "wrong sender":
        shares[2] = share(2, 3, 1)
    elif case == "not for this node":
        shares[3] = share(3, 3, 2)
    elif case == "unknown neighbour":
        shares[4] = shares.pop(3)
    elif case == "too few shares":
        del shares[3]
    context = _context_after_share_keys(keys, threshold)
    if case == "no share_keys stage":
        context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    mod = secagg_policy_mod(SiteSettings(state_dir=Path("/nonexistent")))
    called: list[Message] = []

    def handler(msg: Message, ctx: Context) -> Message:
        called.append(msg)  # where the site would compute and count its contribution
        return msg

    with flower_process_state():
        set_task_identity()
        message = _collect_message(list(shares), list(shares.values()))
        # Act / Assert
        if error is None:
            mod(message, context, handler)
            assert called == [message]
        else:
            with pytest.raises(error):
                mod(message, context, handler)
            assert called == []


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
    # Act: a refused plan (its release id is taken) and an abort of a release never planned,
    # from the release's own run, a SecAgg+ round without a stage, and junk.
    for body, message_type in (
        (PlanRequest(plan=make_plan(consortium.world)), "query.plan"),
        (AbortNotice(release_id="other", reason="x", noisy_output=False), "query.abort"),
    ):
        reply = service.handle_message(_message(consortium, run_id, message_type, body))
        assert isinstance(message_from_record(reply.content), ErrorReply)
    junk_round = _message(consortium, run_id, "train", None)  # no SecAgg+ stage at all
    assert service.handle_message(junk_round).has_error()
    with pytest.raises(ServiceError, match="serialised Flower Message"):
        service.handle_bytes(b"\x00junk")
    # Assert: still idle since its last change; the sweep resolves it.
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

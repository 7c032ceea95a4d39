"""The plan rides on the first SecAgg+ setup only when the plan sizes that sum by itself."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server.workflow.secure_aggregation import secaggplus_workflow as flwr_workflow

from dpmtv_common.crypto import mask_prg
from dpmtv_common.errors import ConfigError
from protocol import (
    MESSAGE_RECORD_KEY,
    PROTOCOL_VERSION,
    NoiseMode,
    PlanAccept,
    PlanRequest,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    expect,
    message_to_record,
)
from server.plan_at_setup import plan_folds_into_setup, send_plan_at_setup
from server.secagg import mask_prg_in_use
from server.simulation import make_server_context
from tests.flower_harness import flower_process_state, set_task_identity


@pytest.fixture(autouse=True)
def _identity() -> Iterator[None]:
    # Restores Flower's mask expansion and task identity for the tests that follow.
    with flower_process_state():
        set_task_identity()
        yield


def make_plan(**overrides: Any) -> ReleasePlan:
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "release_id": "r1",
        "task": "colour",
        "model_fingerprint": "sha256:" + "0" * 64,
        "epsilon": 1.0,
        "delta": 1e-5,
        "shots": 2,
        "clip_norm": 1.0,
        "selection": SelectionMode.ALL,
        "order": ReleaseOrder.SELECT_FIRST,
        "num_selected_heads": 2,
        "public_heads": None,
        "selection_share": 0.3,
        "score_top_r": 2,
        "min_sites": 2,
        "max_chunks_per_site": 100,
        "created": datetime.now(UTC).isoformat(),
    }
    fields.update(overrides)
    return ReleasePlan(**fields)


class SilentGrid:
    """Keeps what is sent; no site answers."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.run = SimpleNamespace(run_id=7)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        self.sent.extend(messages)
        return []


def test_only_a_central_plan_with_a_chunk_cap_folds_into_the_setup() -> None:
    assert plan_folds_into_setup(make_plan())
    assert not plan_folds_into_setup(make_plan(max_chunks_per_site=None))
    distributed = make_plan(noise_mode=NoiseMode.DISTRIBUTED, max_sites=3, min_honest=2)
    assert not plan_folds_into_setup(distributed)
    with pytest.raises(ConfigError, match="only in central noise mode with a chunk cap"):
        send_plan_at_setup(SilentGrid(), make_server_context(), distributed, [1, 2, 3], 1.0)  # type: ignore[arg-type]


def test_the_setup_carries_the_plan_and_the_secure_mask_expansion_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Arrange: a fresh process's Flower, with its own (32-bit-seeded) mask expansion.
    monkeypatch.setitem(vars(flwr_workflow), "pseudo_rand_gen", lambda *args: [])
    assert mask_prg_in_use() != mask_prg.MASK_PRG_NAME
    grid = SilentGrid()
    plan = make_plan()
    # Act
    replies, sum_round = send_plan_at_setup(
        grid,  # type: ignore[arg-type]
        make_server_context(),
        plan,
        [1, 2, 3],
        1.0,
    )
    # Assert: ChaCha20 masks; every site was sent the plan beside SecAgg+'s setup record;
    # nobody answered, so nobody accepted and the round has no site left.
    assert mask_prg_in_use() == mask_prg.MASK_PRG_NAME
    assert sorted(m.metadata.dst_node_id for m in grid.sent) == [1, 2, 3]
    assert all(expect(m.content, PlanRequest).plan == plan for m in grid.sent)
    assert all(MESSAGE_RECORD_KEY in m.content.config_records for m in grid.sent)
    assert replies.answers == {}
    assert sorted(replies.failures) == [1, 2, 3]
    assert sum_round.active_sites == set()


class AnsweringGrid(SilentGrid):
    """Every site answers SecAgg+'s setup with keys and, beside them, a chosen plan answer."""

    def __init__(self, answers: dict[int, PlanAccept | None]) -> None:
        super().__init__()
        self.answers = answers

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        sent = list(messages)
        super().send_and_receive(sent, timeout=timeout)
        replies = []
        for message in sent:
            keys = ConfigRecord({Key.PUBLIC_KEY_1: b"pk1", Key.PUBLIC_KEY_2: b"pk2"})
            content = RecordDict({RECORD_KEY_CONFIGS: keys})
            accept = self.answers[message.metadata.dst_node_id]
            if accept is not None:
                content[MESSAGE_RECORD_KEY] = message_to_record(accept).config_records[
                    MESSAGE_RECORD_KEY
                ]
            replies.append(Message(content, reply_to=message))
        return replies


def accept_for(release_id: str, site: int) -> PlanAccept:
    return PlanAccept(
        release_id=release_id,
        site_name=f"site-{site}",
        num_chunks=5,
        num_layers=2,
        num_heads=4,
        head_dim=16,
        prompt_template_sha256="a" * 64,
        dpmtv_version="0.1.0",
    )


def test_only_an_accept_of_this_plan_counts_and_the_others_leave_the_sum() -> None:
    # Arrange: site 1 accepts r1; site 2 answers for another release; site 3 with keys only.
    grid = AnsweringGrid({1: accept_for("r1", 1), 2: accept_for("other", 2), 3: None})
    # Act
    replies, sum_round = send_plan_at_setup(
        grid,  # type: ignore[arg-type]
        make_server_context(),
        make_plan(),
        [1, 2, 3],
        1.0,
    )
    # Assert
    assert sorted(replies.answers) == [1]
    assert "accepted release 'other', not 'r1'" in replies.failures[2]
    assert "without an answer to the plan" in replies.failures[3]
    assert 2 not in sum_round.active_sites
    assert 3 not in sum_round.active_sites

"""InProcessGrid isolates nodes like a wire, without deep copies, and drops by message type."""

from __future__ import annotations

import copy
from typing import cast

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from server.simulation import FIRST_NODE_ID, InProcessGrid

NODE = FIRST_NODE_ID


def make_message(grid: InProcessGrid, content: RecordDict) -> Message:
    return grid.create_message(content, "train", NODE, group_id="g")


def content() -> RecordDict:
    return RecordDict(
        {
            "config": ConfigRecord({"stage": "setup", "ids": [1, 2, 3], "blob": b"k"}),
            "arrays": ArrayRecord([np.arange(4.0)]),
        }
    )


def popping_app(message: Message, context: Context) -> Message:
    """Pops and mutates what it received, and its state, as a careless handler might."""
    config = message.content.config_records["config"]
    config.pop("stage")
    ids = cast(list[int], config["ids"])
    ids.append(99)
    context.state.config_records["seen"] = ConfigRecord({"count": 1})
    return Message(RecordDict({"reply": ConfigRecord({"ids": [7]})}), reply_to=message)


def test_a_node_that_pops_and_mutates_leaves_the_senders_message_as_sent() -> None:
    # Arrange
    grid = InProcessGrid([popping_app], num_nodes=1)
    message = make_message(grid, content())

    # Act
    (reply,) = grid.send_and_receive([message])

    # Assert
    config = message.content.config_records["config"]
    assert config["stage"] == "setup"
    assert config["ids"] == [1, 2, 3]
    assert reply.content.config_records["reply"]["ids"] == [7]


def test_the_kept_reply_is_not_the_one_returned() -> None:
    # Arrange
    grid = InProcessGrid([popping_app], num_nodes=1)

    # Act
    (reply,) = grid.send_and_receive([make_message(grid, content())])
    ids = cast(list[int], reply.content.config_records["reply"]["ids"])
    ids.append(8)

    # Assert
    _, _, kept = grid.replies[0]
    assert kept.content.config_records["reply"]["ids"] == [7]


def test_state_is_committed_only_when_the_app_returns() -> None:
    # Arrange
    def failing_app(message: Message, context: Context) -> Message:
        context.state.config_records["seen"] = ConfigRecord({"count": 2})
        raise RuntimeError("site crashed")

    grid = InProcessGrid([popping_app, failing_app], num_nodes=2)
    first, second = grid.node_ids
    messages = [
        grid.create_message(content(), "train", node, group_id="g") for node in (first, second)
    ]

    # Act
    replies = grid.send_and_receive(messages)

    # Assert: the failing node's state is as before; its reply is an error
    assert grid.contexts[first].state.config_records["seen"]["count"] == 1
    assert "seen" not in grid.contexts[second].state.config_records
    assert replies[1].has_error()


def test_a_node_writing_to_its_arrays_leaves_the_senders_arrays_alone() -> None:
    # Arrange
    def writing_app(message: Message, context: Context) -> Message:
        (array,) = message.content.array_records["arrays"].to_numpy_ndarrays()
        np.testing.assert_array_equal(array, np.arange(4.0))
        array[:] = -1.0
        return Message(RecordDict(), reply_to=message)

    grid = InProcessGrid([writing_app], num_nodes=1)
    message = make_message(grid, content())

    # Act
    grid.send_and_receive([message])

    # Assert
    (sent,) = message.content.array_records["arrays"].to_numpy_ndarrays()
    np.testing.assert_array_equal(sent, np.arange(4.0))


def test_delivery_makes_no_deep_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("deepcopy called")

    monkeypatch.setattr(copy, "deepcopy", refuse)
    grid = InProcessGrid([popping_app], num_nodes=1)

    # Act
    replies = grid.send_and_receive([make_message(grid, content())])

    # Assert
    assert len(replies) == 1


def test_a_drop_silences_a_node_at_its_message_types_only() -> None:
    # Arrange
    grid = InProcessGrid(
        [popping_app, popping_app], num_nodes=2, drops={NODE: {"query.sum_shares"}}
    )
    other = NODE + 1
    messages = [
        grid.create_message(content(), "query.sum_shares", NODE, group_id="g"),
        grid.create_message(content(), "query.sum_collect", NODE, group_id="g"),
        grid.create_message(content(), "query.sum_shares", other, group_id="g"),
    ]

    # Act
    replies = grid.send_and_receive(messages)

    # Assert: as a site that timed out: no reply at all, and nothing recorded
    assert [(r.metadata.src_node_id, r.metadata.message_type) for r in replies] == [
        (NODE, "query.sum_collect"),
        (other, "query.sum_shares"),
    ]
    assert [(node, stage) for node, stage, _ in grid.replies] == [
        (NODE, "query.sum_collect"),
        (other, "query.sum_shares"),
    ]

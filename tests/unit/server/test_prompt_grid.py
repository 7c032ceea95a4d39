"""PromptGrid: Flower's send_and_receive contract, pulled every 0.1 s, stragglers given up."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from dpmtv_common.errors import ConfigError
from server.prompt_grid import PromptGrid, StragglerPolicy, site_label
from tests.flower_harness import flower_process_state, set_task_identity


class FakeClock:
    """Monotonic time that moves only when the grid sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ScriptedGrid(Grid):
    """A SuperLink stand-in: node ``n`` answers ``answer_after[n]`` s after the push."""

    def __init__(self, clock: FakeClock, answer_after: dict[int, float | None]) -> None:
        self.clock = clock
        self.answer_after = answer_after
        self.pushed: dict[str, Message] = {}
        self.pulls = 0
        self.pushed_at = 0.0
        self._run = Run.create_empty(run_id=1)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        raise AssertionError("PromptGrid must not delegate create_message")

    def get_node_ids(self) -> Iterable[int]:
        return list(self.answer_after)

    def get_nodes(self) -> Iterable[NodeInfo]:
        return [NodeInfo(node_id=n, name=f"hospital-{n}") for n in self.answer_after]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for index, message in enumerate(messages):
            message_id = f"m{message.metadata.dst_node_id}-{index}"
            self.pushed[message_id] = message
            ids.append(message_id)
        self.pushed_at = self.clock.now
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self.pulls += 1
        replies = []
        for message_id in message_ids:
            message = self.pushed[message_id]
            delay = self.answer_after[message.metadata.dst_node_id]
            if delay is not None and self.clock.now >= self.pushed_at + delay:
                message.metadata.__dict__["_message_id"] = message_id
                reply = Message(RecordDict({"ok": ConfigRecord({"n": 1})}), reply_to=message)
                replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        raise AssertionError("PromptGrid must not use Flower's 3 s polling loop")


@pytest.fixture(autouse=True)
def _identity() -> Iterable[None]:
    with flower_process_state():
        set_task_identity()
        yield


def _grid(answer_after: dict[int, float | None], stragglers: StragglerPolicy | None = None):
    clock = FakeClock()
    inner = ScriptedGrid(clock, answer_after)
    grid = PromptGrid(inner, stragglers=stragglers, clock=clock, sleep=clock.sleep)
    return grid, inner, clock


def _messages(grid: PromptGrid, nodes: Iterable[int]) -> list[Message]:
    return [grid.create_message(RecordDict(), "query.plan", n, "g") for n in nodes]


def _answered(replies: Iterable[Message]) -> list[int]:
    return sorted(int(r.metadata.reply_to_message_id.split("-")[0][1:]) for r in replies)


def test_replies_are_collected_within_one_pull_interval_of_the_last_one() -> None:
    # Arrange: three sites answering after 1.0, 2.0 and 2.55 s.
    grid, _, clock = _grid({1: 1.0, 2: 2.0, 3: 2.55})
    # Act
    replies = grid.send_and_receive(_messages(grid, [1, 2, 3]), timeout=60)
    # Assert: all three, and the wait ended at most one 0.1 s pull after the last reply
    # (Flower's loop would have returned at 3.0 s, or 6.0 s for a reply just after 3 s).
    assert _answered(replies) == [1, 2, 3]
    assert 2.55 <= clock.now <= 2.55 + 0.1 + 1e-9
    assert set(clock.sleeps) == {0.1}


def test_a_timeout_returns_what_came_and_none_waits_for_every_site() -> None:
    # Arrange
    grid, _, clock = _grid({1: 0.5, 2: None})
    # Act
    replies = grid.send_and_receive(_messages(grid, [1, 2]), timeout=4.0)
    # Assert: the silent site's reply is simply missing; the wait ended at the timeout.
    assert _answered(replies) == [1]
    assert 4.0 <= clock.now <= 4.0 + 0.1 + 1e-9
    # Act: no timeout, no straggler policy: waits until the last (slow) site answered.
    grid, _, clock = _grid({1: 0.5, 2: 30.0})
    replies = grid.send_and_receive(_messages(grid, [1, 2]), timeout=None)
    assert _answered(replies) == [1, 2]
    assert clock.now == pytest.approx(30.0, abs=0.11)


def test_a_zero_timeout_pushes_and_pulls_nothing_as_flower_does() -> None:
    # Arrange
    grid, inner, _ = _grid({1: 0.0})
    # Act
    replies = grid.send_and_receive(_messages(grid, [1]), timeout=0.0)
    # Assert
    assert list(replies) == []
    assert len(inner.pushed) == 1
    assert inner.pulls == 0


def test_a_silent_site_is_given_up_seconds_after_the_others_answered() -> None:
    # Arrange: two sites answer by 2 s, the third is dead; the stage timeout is 600 s.
    policy = StragglerPolicy(min_grace=5.0, factor=2.0)
    grid, _, clock = _grid({1: 1.0, 2: 2.0, 3: None}, stragglers=policy)
    # Act
    replies = grid.send_and_receive(_messages(grid, [1, 2, 3]), timeout=600.0)
    # Assert: given up after max(5, 2 x 2) = 5 s of silence, i.e. at about 7 s, not 600 s.
    assert _answered(replies) == [1, 2]
    assert 7.0 < clock.now <= 7.0 + 0.1 + 1e-9


def test_a_slow_live_site_keeps_time_proportional_to_the_others() -> None:
    # Arrange: a heavy stage (fast sites take 60 s); the slow site needs 150 s.
    policy = StragglerPolicy(min_grace=5.0, factor=2.0)
    grid, _, _ = _grid({1: 50.0, 2: 60.0, 3: 150.0}, stragglers=policy)
    # Act
    replies = grid.send_and_receive(_messages(grid, [1, 2, 3]), timeout=600.0)
    # Assert: 150 s < 60 + 2 x 60: it is waited for.
    assert _answered(replies) == [1, 2, 3]


def test_no_reply_at_all_waits_for_the_timeout_not_the_grace() -> None:
    # Arrange: nobody answered, so nobody is a straggler (the stage may just be slow).
    grid, _, clock = _grid({1: None, 2: None}, stragglers=StragglerPolicy(1.0, 0.0))
    # Act
    replies = grid.send_and_receive(_messages(grid, [1, 2]), timeout=20.0)
    # Assert
    assert list(replies) == []
    assert clock.now >= 20.0


def test_sites_are_labelled_by_their_registered_name() -> None:
    # Arrange
    grid, inner, _ = _grid({7: 0.0})
    # Act / Assert
    assert site_label(grid, 7) == "hospital-7 (7)"
    assert site_label(grid, 8) == "8"  # unknown to the SuperLink: the id alone
    assert site_label(inner, 7) == "7"  # a plain grid knows no names


def test_a_synchronous_in_process_grid_is_delegated_to() -> None:
    # Arrange: a grid that delivers inside send_and_receive and cannot push (InProcessGrid).
    class Synchronous(ScriptedGrid):
        def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
            raise NotImplementedError

        def send_and_receive(self, messages, *, timeout=None):
            return ["delivered", timeout]

    clock = FakeClock()
    grid = PromptGrid(Synchronous(clock, {1: 0.0}), clock=clock, sleep=clock.sleep)
    # Act / Assert
    assert grid.send_and_receive(_messages(grid, [1]), timeout=3.0) == ["delivered", 3.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pull_interval": 0}, "pull_interval must be in"),
        ({"pull_interval": 5}, "pull_interval must be in"),
    ],
)
def test_bad_pull_intervals_are_refused(kwargs: dict[str, float], match: str) -> None:
    inner = ScriptedGrid(FakeClock(), {})
    with pytest.raises(ConfigError, match=match):
        PromptGrid(inner, pull_interval=kwargs["pull_interval"])


@pytest.mark.parametrize("field", ["min_grace", "factor"])
def test_negative_straggler_settings_are_refused(field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be a number >= 0, got -1"):
        StragglerPolicy(**{field: -1})

import pytest

from protocol import ALLOWED_TRANSITIONS, Stage, StageOrderError, StageTracker

SELECT_FIRST = [Stage.PLAN, Stage.SELECT, Stage.EXTRACT, Stage.RELEASE]
RELEASE_FIRST = [Stage.PLAN, Stage.EXTRACT, Stage.SELECT, Stage.RELEASE]
NO_PRIVATE_SELECTION = [Stage.PLAN, Stage.EXTRACT, Stage.RELEASE]


def _tracker_after(stages: list[Stage]) -> StageTracker:
    tracker = StageTracker()
    for stage in stages:
        tracker.advance(stage)
    return tracker


def test_stage_values_are_lowercase_names() -> None:
    assert [stage.value for stage in Stage] == ["plan", "select", "extract", "release", "abort"]


@pytest.mark.parametrize("path", [SELECT_FIRST, RELEASE_FIRST, NO_PRIVATE_SELECTION])
def test_tracker_accepts_every_release_path(path: list[Stage]) -> None:
    # Act
    tracker = _tracker_after(path)

    # Assert
    assert tracker.history == path
    assert tracker.finished
    assert tracker.allowed() == frozenset()


@pytest.mark.parametrize(
    "before", [[Stage.PLAN], [Stage.PLAN, Stage.SELECT], [Stage.PLAN, Stage.EXTRACT]]
)
def test_tracker_allows_abort_from_any_non_terminal_stage(before: list[Stage]) -> None:
    tracker = _tracker_after(before)

    tracker.advance(Stage.ABORT)

    assert tracker.current is Stage.ABORT
    assert tracker.finished


@pytest.mark.parametrize(
    ("before", "stage"),
    [
        ([], Stage.SELECT),
        ([], Stage.ABORT),
        ([Stage.PLAN], Stage.PLAN),
        ([Stage.PLAN], Stage.RELEASE),
        ([Stage.PLAN, Stage.SELECT], Stage.RELEASE),
        ([Stage.PLAN, Stage.SELECT, Stage.EXTRACT], Stage.SELECT),
        ([Stage.PLAN, Stage.EXTRACT, Stage.SELECT], Stage.EXTRACT),
        (SELECT_FIRST, Stage.ABORT),
        ([Stage.PLAN, Stage.ABORT], Stage.EXTRACT),
    ],
)
def test_tracker_refuses_stage_out_of_order(before: list[Stage], stage: Stage) -> None:
    # Arrange
    tracker = _tracker_after(before)

    # Act / Assert
    with pytest.raises(StageOrderError, match=f"stage {stage.value} cannot follow"):
        tracker.advance(stage)
    assert tracker.history == before


def test_refusal_names_previous_stage_and_allowed_ones() -> None:
    tracker = _tracker_after([Stage.PLAN, Stage.SELECT])

    with pytest.raises(StageOrderError) as info:
        tracker.advance(Stage.RELEASE)

    assert str(info.value) == "stage release cannot follow select; allowed: abort, extract."


def test_refusal_at_start_and_after_the_end_says_so() -> None:
    with pytest.raises(StageOrderError, match="cannot follow start; allowed: plan"):
        StageTracker().advance(Stage.EXTRACT)
    with pytest.raises(StageOrderError, match=r"allowed: none \(the release is finished\)"):
        _tracker_after(NO_PRIVATE_SELECTION).advance(Stage.ABORT)


def test_transition_table_matches_design() -> None:
    assert ALLOWED_TRANSITIONS[None] == {Stage.PLAN}
    assert ALLOWED_TRANSITIONS[Stage.PLAN] == {Stage.SELECT, Stage.EXTRACT, Stage.ABORT}
    assert ALLOWED_TRANSITIONS[Stage.SELECT] == {Stage.EXTRACT, Stage.RELEASE, Stage.ABORT}
    assert ALLOWED_TRANSITIONS[Stage.EXTRACT] == {Stage.SELECT, Stage.RELEASE, Stage.ABORT}
    assert ALLOWED_TRANSITIONS[Stage.RELEASE] == frozenset()
    assert ALLOWED_TRANSITIONS[Stage.ABORT] == frozenset()


def test_stage_order_error_is_a_protocol_error() -> None:
    from dpmtv_common.errors import ProtocolError

    assert issubclass(StageOrderError, ProtocolError)

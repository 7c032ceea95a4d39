import math
from datetime import timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from protocol import (
    PROTOCOL_VERSION,
    NeighbouringRelation,
    NoiseMode,
    PlanRequest,
    PrivacyUnit,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    expect,
    message_to_record,
    plan_hash,
)

VALID: dict[str, Any] = {
    # A literal, not PROTOCOL_VERSION: the pinned hash below pins the hash function, and a
    # version bump must not look like a change to it.
    "protocol_version": "1.0",
    "release_id": "release-0001",
    "task": "vqa-colours",
    "model_fingerprint": "ab" * 32,
    "epsilon": 1.0,
    "delta": 1e-5,
    "shots": 4,
    "clip_norm": 2.5,
    "selection": SelectionMode.PRIVATE,
    "order": ReleaseOrder.SELECT_FIRST,
    "num_selected_heads": 16,
    "public_heads": None,
    "selection_share": 0.2,
    "score_top_r": 8,
    "min_sites": 2,
    "max_chunks_per_site": None,
    "created": "2025-01-02T03:04:05+00:00",
}
PUBLIC_HEADS = ((0, 3), (2, 1), (2, 5))
# plan_hash(make_plan()), pinned: a change invalidates every ledger entry written before it.
PINNED_HASH = "c7c9e8decd6127d536e96ae9fce0b4558fd74d4be301cf12b98d1a934d238390"


def make_plan(**overrides: Any) -> ReleasePlan:
    return ReleasePlan.model_validate({**VALID, **overrides})


def test_valid_plan_has_documented_defaults() -> None:
    plan = make_plan()

    assert plan.neighbouring is NeighbouringRelation.REPLACE_ONE
    assert plan.privacy_unit is PrivacyUnit.EXAMPLE
    assert plan.noise_mode is NoiseMode.CENTRAL


def test_enum_values_are_the_wire_spellings() -> None:
    assert [m.value for m in SelectionMode] == ["public", "private", "all"]
    assert [m.value for m in ReleaseOrder] == ["select-first", "release-first"]
    assert [m.value for m in NoiseMode] == ["central", "distributed"]
    assert [m.value for m in PrivacyUnit] == ["example", "group"]


def test_public_mode_accepts_its_head_list() -> None:
    plan = make_plan(
        selection=SelectionMode.PUBLIC, public_heads=PUBLIC_HEADS, num_selected_heads=3
    )

    assert plan.public_heads == PUBLIC_HEADS


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"selection": SelectionMode.PUBLIC}, "public_heads must be set when selection"),
        ({"public_heads": PUBLIC_HEADS}, "public_heads must be None when selection is 'private'"),
        (
            {"selection": SelectionMode.ALL, "public_heads": PUBLIC_HEADS},
            "public_heads must be None when selection is 'all'",
        ),
        (
            {"selection": SelectionMode.PUBLIC, "public_heads": PUBLIC_HEADS},
            r"num_selected_heads must equal len\(public_heads\) = 3 in public mode, got 16",
        ),
        (
            {"selection": SelectionMode.PUBLIC, "public_heads": ((2, 1), (0, 3))},
            "public_heads must be sorted, unique",
        ),
        (
            {"selection": SelectionMode.PUBLIC, "public_heads": ((0, 3), (0, 3))},
            "public_heads must be sorted, unique",
        ),
        (
            {"selection": SelectionMode.PUBLIC, "public_heads": ((-1, 3),)},
            "public_heads must be sorted, unique",
        ),
        (
            {"selection": SelectionMode.PUBLIC, "public_heads": ()},
            "public_heads must hold at least one head",
        ),
    ],
)
def test_public_heads_are_required_iff_public_mode_and_canonical(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        make_plan(**overrides)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("epsilon", 0.0, "epsilon must be finite and > 0, got 0.0"),
        ("epsilon", -1.0, "epsilon must be finite and > 0"),
        ("epsilon", math.inf, "epsilon must be finite and > 0, got inf"),
        ("epsilon", math.nan, "epsilon must be finite and > 0, got nan"),
        ("delta", 0.0, "delta must lie strictly between 0 and 1, got 0.0"),
        ("delta", 1.0, "delta must lie strictly between 0 and 1, got 1.0"),
        ("clip_norm", 0.0, "clip_norm must be finite and > 0"),
        ("shots", 0, "shots must be >= 1, got 0"),
        ("num_selected_heads", 0, "num_selected_heads must be >= 1"),
        ("score_top_r", 0, "score_top_r must be >= 1"),
        ("min_sites", 0, "min_sites must be >= 1"),
        ("max_chunks_per_site", 0, "max_chunks_per_site must be >= 1"),
        ("selection_share", 1.0, "selection_share must lie strictly between 0 and 1"),
        ("release_id", "", "release_id must be 1-64 characters"),
        ("release_id", "..", "release_id must be 1-64 characters"),
        ("release_id", "../../x", "release_id must be 1-64 characters"),
        ("release_id", "/etc", "release_id must be 1-64 characters"),
        ("release_id", "a" * 65, "release_id must be 1-64 characters"),
        ("task", "t" * 201, "task must be at most 200 printable characters"),
        ("task", "line\nbreak", "task must be at most 200 printable characters"),
        ("epsilon", 1e6, "epsilon must be at most 100.0"),
        ("shots", 10_000, "shots must be at most 256"),
        ("num_selected_heads", 100_000, "num_selected_heads must be at most 65536"),
        ("task", "  ", "task must be non-empty"),
        ("model_fingerprint", "", "model_fingerprint must be non-empty"),
        ("protocol_version", "1", "protocol_version must be 'MAJOR.MINOR', got '1'"),
        ("created", "2025-01-02T03:04:05", "created must be an ISO-8601 timestamp with a UTC"),
        ("created", "yesterday", "created must be an ISO-8601 timestamp"),
    ],
)
def test_plan_field_validators_say_what_was_given(field: str, value: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make_plan(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("shots", "4"), ("shots", 4.0), ("selection", "private"), ("public_heads", [])],
)
def test_plan_is_strict_about_types(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        make_plan(**{field: value})


def test_plan_rejects_unknown_and_missing_fields() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        make_plan(sigma=1.0)
    without_shots = {k: v for k, v in VALID.items() if k != "shots"}
    with pytest.raises(ValidationError, match="shots"):
        ReleasePlan.model_validate(without_shots)


def test_plan_is_frozen() -> None:
    plan = make_plan()

    with pytest.raises(ValidationError, match="frozen"):
        plan.epsilon = 2.0  # type: ignore[misc]


def test_plan_json_round_trip_is_equal() -> None:
    plan = make_plan(
        selection=SelectionMode.PUBLIC, public_heads=PUBLIC_HEADS, num_selected_heads=3
    )

    assert ReleasePlan.model_validate_json(plan.model_dump_json()) == plan


def test_plan_hash_is_stable_and_pinned() -> None:
    assert plan_hash(make_plan()) == plan_hash(make_plan())
    assert plan_hash(make_plan()) == PINNED_HASH


def test_plan_hash_survives_a_json_round_trip() -> None:
    plan = make_plan()

    assert plan_hash(ReleasePlan.model_validate_json(plan.model_dump_json())) == plan_hash(plan)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epsilon", 1.0000001),
        ("delta", 2e-5),
        ("release_id", "release-0002"),
        ("clip_norm", 2.0),
        ("order", ReleaseOrder.RELEASE_FIRST),
        ("min_honest", 3),
        ("max_sites", 10),
        ("max_chunks_per_site", 100),
    ],
)
def test_plan_hash_changes_when_any_field_changes(field: str, value: object) -> None:
    assert plan_hash(make_plan(**{field: value})) != plan_hash(make_plan())


def test_plan_hash_is_sha256_hex() -> None:
    digest = plan_hash(make_plan())

    assert len(digest) == 64
    assert set(digest) <= set("0123456789abcdef")


names = st.text(min_size=1, max_size=20).filter(lambda s: s.strip() != "" and s.isprintable())
release_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)
positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
open_unit = st.floats(min_value=1e-12, max_value=1 - 1e-12)
counts = st.integers(min_value=1, max_value=10_000)
head_lists = st.sets(st.tuples(st.integers(0, 63), st.integers(0, 63)), min_size=1).map(
    lambda heads: tuple(sorted(heads))
)
offsets = st.integers(-23 * 60, 23 * 60).map(lambda minutes: timezone(timedelta(minutes=minutes)))
timestamps = st.builds(lambda at, tz: at.replace(tzinfo=tz).isoformat(), st.datetimes(), offsets)


@st.composite
def plans(draw: st.DrawFn) -> ReleasePlan:
    selection = draw(st.sampled_from(SelectionMode))
    public_heads = draw(head_lists) if selection is SelectionMode.PUBLIC else None
    noise_mode = draw(st.sampled_from(NoiseMode))
    min_sites = draw(counts)
    distributed = noise_mode is NoiseMode.DISTRIBUTED
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id=draw(release_ids),
        task=draw(names),
        model_fingerprint=draw(names),
        epsilon=draw(st.floats(min_value=1e-6, max_value=100.0)),
        delta=draw(open_unit),
        shots=draw(st.integers(1, 256)),
        clip_norm=draw(positive),
        selection=selection,
        order=draw(st.sampled_from(ReleaseOrder)),
        num_selected_heads=len(public_heads) if public_heads else draw(counts),
        public_heads=public_heads,
        selection_share=draw(open_unit),
        score_top_r=draw(counts),
        min_sites=min_sites,
        noise_mode=noise_mode,
        min_honest=draw(st.integers(1, min_sites)),
        max_sites=draw(st.integers(min_sites, 20_000)) if distributed else None,
        max_chunks_per_site=draw(counts if distributed else st.none() | counts),
        created=draw(timestamps),
    )


@settings(max_examples=50, deadline=None)
@given(plan=plans())
def test_decode_of_encode_is_identity_for_plans(plan: ReleasePlan) -> None:
    # Act
    decoded = expect(message_to_record(PlanRequest(plan=plan)), PlanRequest).plan

    # Assert
    assert decoded == plan
    assert plan_hash(decoded) == plan_hash(plan)


def test_a_distributed_plan_must_bound_sites_and_chunks() -> None:
    with pytest.raises(ValidationError, match="max_sites and max_chunks_per_site must be set"):
        make_plan(noise_mode=NoiseMode.DISTRIBUTED)


def test_a_distributed_plan_orders_min_honest_min_sites_and_max_sites() -> None:
    with pytest.raises(ValidationError, match="min_honest <= min_sites <= max_sites"):
        make_plan(
            noise_mode=NoiseMode.DISTRIBUTED,
            max_sites=3,
            max_chunks_per_site=10,
            min_sites=2,
            min_honest=3,
        )

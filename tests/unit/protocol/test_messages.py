from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from dpmtv_common.errors import (
    ArtifactFormatError,
    ConfigError,
    DataError,
    DpmtvError,
    LedgerError,
    ModelMismatchError,
    PolicyError,
    PrivacyBudgetExceededError,
)
from protocol import (
    AbortNotice,
    AnyMessage,
    ErrorCode,
    ErrorReply,
    MessageDecodeError,
    PlanAccept,
    PlanMismatchError,
    ProtocolError,
    ReleaseAck,
    ReleaseRequest,
    RemoteError,
    SecureSumRequest,
    StageOrderError,
    VersionMismatchError,
    WireMessage,
    message_from_record,
    message_to_record,
)

# ----------------------------------------------------------------- strategies

names = st.text(min_size=1, max_size=20).filter(lambda s: s.strip() != "" and s.isprintable())
release_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)
positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
SUM_STAGES: tuple[Literal["select", "extract"], ...] = ("select", "extract")
small_counts = st.integers(min_value=1, max_value=10_000)
head_lists = st.sets(st.tuples(st.integers(0, 63), st.integers(0, 63)), min_size=1, max_size=8).map(
    lambda heads: tuple(sorted(heads))
)


@st.composite
def secure_sum_requests(draw: st.DrawFn) -> SecureSumRequest:
    stage = draw(st.sampled_from(SUM_STAGES))
    return SecureSumRequest(
        release_id=draw(release_ids),
        stage=stage,
        heads=draw(st.none() | head_lists),
        clip_norm=draw(positive),
        score_top_r=draw(small_counts) if stage == "select" else None,
        reference_heads=draw(st.none() | head_lists) if stage == "select" else None,
    )


# PlanRequest is left out: test_plan.py sends random plans through the codec.
messages = st.one_of(
    st.builds(
        PlanAccept,
        release_id=release_ids,
        site_name=names,
        num_chunks=st.integers(0, 10**6),
        num_layers=st.integers(1, 64),
        num_heads=st.integers(1, 64),
        head_dim=st.integers(1, 256),
        prompt_template_sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
        instruction_sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
        dpmtv_version=st.from_regex(r"[0-9A-Za-z.+!_-]{1,64}", fullmatch=True),
    ),
    st.builds(ErrorReply, code=st.sampled_from(ErrorCode), reason=st.text()),
    secure_sum_requests(),
    st.builds(
        ReleaseRequest,
        release_id=release_ids,
        manifest_json=st.text(),
        tensors=st.binary(),
        signature=st.binary(),
    ),
    st.builds(
        ReleaseAck,
        release_id=release_ids,
        site_name=names,
        artifact_sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
    ),
    st.builds(AbortNotice, release_id=release_ids, reason=st.text(), noisy_output=st.booleans()),
)

ANY_MESSAGE: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (PrivacyBudgetExceededError("epsilon 2.0 exceeds the remaining 1.5"), "budget-exceeded"),
        (ModelMismatchError("fingerprint differs"), "model-mismatch"),
        (VersionMismatchError("major 2"), "version-mismatch"),
        (StageOrderError("stage release cannot follow plan"), "stage-order"),
        (DataError("3 examples, need 5"), "insufficient-data"),
        (ConfigError("shots must be >= 1"), "bad-request"),
        (MessageDecodeError("body invalid"), "bad-request"),
        (LedgerError("ledger corrupt"), "refused"),
        (PolicyError("epsilon above the site cap"), "policy"),
        (PlanMismatchError("artifact epsilon differs"), "plan-mismatch"),
        (ArtifactFormatError("missing manifest"), "refused"),
        (DpmtvError("anything else of ours"), "refused"),
    ],
)
def test_error_reply_maps_typed_exceptions_to_codes_and_drops_their_message(
    exc: Exception, code: str
) -> None:
    # Act
    reply = ErrorReply.from_exception(exc)

    # Assert: the code and the class travel; the text (may quote private data) does not.
    assert reply.code == ErrorCode(code)
    assert reply.error_type == type(exc).__name__
    assert str(exc) not in reply.reason
    assert str(exc) not in reply.model_dump_json()


def test_error_reply_never_carries_a_quoted_private_record() -> None:
    record = '{"image": "patient-0042.png", "answer": "malignant, stage II"}'
    exc = DataError(f"manifest line 7 must be valid JSON, got {record!r}")

    reply = ErrorReply.from_exception(exc)

    assert "patient" not in reply.model_dump_json()
    assert "malignant" not in reply.model_dump_json()


@pytest.mark.parametrize(
    "exc", [KeyError("/home/site/secret.csv"), RuntimeError("token=abc123"), ValueError("x")]
)
def test_error_reply_hides_the_text_of_unexpected_exceptions(exc: Exception) -> None:
    reply = ErrorReply.from_exception(exc)

    assert reply.code is ErrorCode.INTERNAL
    assert str(exc) not in reply.reason
    assert "internal error" in reply.reason


def test_error_reply_refuses_an_unbounded_reason() -> None:
    with pytest.raises(ValueError, match="reason must be at most 2000"):
        ErrorReply(code=ErrorCode.REFUSED, reason="x" * 2001)


def test_raise_remote_raises_remote_error_with_code_and_reason() -> None:
    reply = ErrorReply(code=ErrorCode.BUDGET_EXCEEDED, reason="epsilon 2.0 > 1.5 left")

    with pytest.raises(RemoteError, match=r"budget-exceeded.*epsilon 2\.0 > 1\.5 left") as info:
        reply.raise_remote()

    assert info.value.code is ErrorCode.BUDGET_EXCEEDED
    assert info.value.reason == "DpmtvError: epsilon 2.0 > 1.5 left"
    assert isinstance(info.value, ProtocolError)


def test_error_codes_are_the_documented_set() -> None:
    assert {code.value for code in ErrorCode} == {
        "version-mismatch",
        "model-mismatch",
        "budget-exceeded",
        "insufficient-data",
        "bad-request",
        "stage-order",
        "internal",
        "refused",
        "policy",
        "plan-mismatch",
    }


def test_secure_sum_request_for_select_needs_score_top_r() -> None:
    with pytest.raises(ValidationError, match="score_top_r must be set when stage is 'select'"):
        SecureSumRequest(
            release_id="r", stage="select", heads=None, clip_norm=1.0, score_top_r=None
        )


def test_secure_sum_request_for_extract_refuses_score_top_r() -> None:
    with pytest.raises(ValidationError, match="score_top_r must be None when stage is 'extract'"):
        SecureSumRequest(release_id="r", stage="extract", heads=None, clip_norm=1.0, score_top_r=3)


def test_only_a_select_request_may_name_reference_heads() -> None:
    with pytest.raises(ValidationError, match="reference_heads must be None when stage is"):
        SecureSumRequest(
            release_id="r",
            stage="extract",
            heads=None,
            clip_norm=1.0,
            score_top_r=None,
            reference_heads=((0, 0),),
        )


@pytest.mark.parametrize(
    ("heads", "clip_norm", "message"),
    [
        (((1, 0), (0, 0)), 1.0, "heads must be sorted, unique"),
        ((), 1.0, "heads must hold at least one head"),
        (None, 0.0, "clip_norm must be finite and > 0"),
    ],
)
def test_secure_sum_request_validates_heads_and_clip_norm(
    heads: tuple[tuple[int, int], ...] | None, clip_norm: float, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        SecureSumRequest(
            release_id="r", stage="extract", heads=heads, clip_norm=clip_norm, score_top_r=None
        )


def test_secure_sum_request_stage_is_select_or_extract_only() -> None:
    with pytest.raises(ValidationError, match="stage"):
        SecureSumRequest(
            release_id="r",
            stage="release",  # type: ignore[arg-type]
            heads=None,
            clip_norm=1.0,
            score_top_r=None,
        )


def test_plan_accept_refuses_negative_chunk_count() -> None:
    with pytest.raises(ValidationError, match="num_chunks"):
        PlanAccept(
            release_id="r",
            site_name="site-a",
            num_chunks=-1,
            num_layers=2,
            num_heads=4,
            head_dim=16,
            prompt_template_sha256="a" * 64,
            instruction_sha256="b" * 64,
            dpmtv_version="0.1.0",
        )


def test_release_ack_needs_a_sha256_hex_digest() -> None:
    with pytest.raises(ValidationError, match="artifact_sha256 must be 64 lowercase hex digits"):
        ReleaseAck(release_id="r", site_name="site-a", artifact_sha256="ABC")


def test_messages_are_frozen_and_strict() -> None:
    msg = AbortNotice(release_id="r", reason="too few sites", noisy_output=True)

    with pytest.raises(ValidationError, match="frozen"):
        msg.reason = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        PlanAccept(
            release_id="r",
            site_name="a",
            num_chunks="3",  # type: ignore[arg-type]
            num_layers=2,
            num_heads=4,
            head_dim=16,
            prompt_template_sha256="a" * 64,
            instruction_sha256="b" * 64,
            dpmtv_version="0.1.0",
        )


def test_release_request_bytes_travel_as_base64_in_json() -> None:
    msg = ReleaseRequest(release_id="r", manifest_json="{}", tensors=b"\x00\xff", signature=b"s")

    body = msg.model_dump_json()

    assert '"tensors":"AP8="' in body
    assert ReleaseRequest.model_validate_json(body) == msg


def test_any_message_dispatches_on_kind() -> None:
    msg = AbortNotice(release_id="r", reason="stop", noisy_output=True)

    decoded = ANY_MESSAGE.validate_json(msg.model_dump_json())

    assert type(decoded) is AbortNotice
    assert decoded == msg


def test_any_message_refuses_unknown_kind() -> None:
    with pytest.raises(ValidationError, match="kind"):
        ANY_MESSAGE.validate_json('{"kind": "exfiltrate", "release_id": "r"}')


@settings(max_examples=50, deadline=None)
@given(msg=messages)
def test_decode_of_encode_is_identity_for_messages(msg: WireMessage) -> None:
    assert message_from_record(message_to_record(msg)) == msg

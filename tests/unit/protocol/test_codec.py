import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from flwr.app import ConfigRecord, RecordDict

from protocol import (
    PROTOCOL_VERSION,
    AbortNotice,
    AddressedBox,
    ErrorCode,
    ErrorReply,
    KeyAdvert,
    MaskedInput,
    MessageDecodeError,
    NodeBytes,
    NonceReveal,
    PlanAccept,
    PlanRequest,
    ReleaseAck,
    ReleaseOrder,
    ReleasePlan,
    ReleaseRequest,
    RemoteError,
    SecureSumRequest,
    SelectionMode,
    SumCollectRequest,
    SumInstructions,
    SumKeysRequest,
    SumRanges,
    SumSharesRequest,
    SurvivorsRequest,
    SurvivorsSigned,
    UnmaskReply,
    UnmaskRequest,
    VersionMismatchError,
    WireMessage,
    check_compatible,
    expect,
    message_from_record,
    message_to_record,
)

# ----------------------------------------------------------------- examples

PLAN = ReleasePlan(
    protocol_version=PROTOCOL_VERSION,
    release_id="r1",
    task="vqa",
    model_fingerprint="f" * 64,
    epsilon=1.0,
    delta=1e-5,
    shots=4,
    clip_norm=1.0,
    selection=SelectionMode.PUBLIC,
    order=ReleaseOrder.SELECT_FIRST,
    num_selected_heads=2,
    public_heads=((0, 1), (3, 2)),
    selection_share=0.1,
    score_top_r=4,
    min_sites=2,
    max_chunks_per_site=None,
    created=datetime(2025, 1, 1, tzinfo=UTC).isoformat(),
)

SELECT_REQUEST = SecureSumRequest(
    release_id="r1", stage="select", heads=None, clip_norm=1.0, score_top_r=4
)
ABORT = AbortNotice(release_id="r1", reason="too few sites", noisy_output=False)
EXAMPLES: list[WireMessage] = [
    PlanRequest(plan=PLAN),
    PlanAccept(
        release_id="r1",
        site_name="site-a",
        num_chunks=120,
        num_layers=2,
        num_heads=4,
        head_dim=16,
        prompt_template_sha256="a" * 64,
        instruction_sha256="b" * 64,
        dpmtv_version="0.1.0",
    ),
    ErrorReply(code=ErrorCode.REFUSED, reason="not today"),
    SELECT_REQUEST,
    SecureSumRequest(
        release_id="r1",
        stage="select",
        heads=None,
        clip_norm=1.0,
        score_top_r=4,
        reference_heads=((0, 1), (3, 2)),
    ),
    ReleaseRequest(release_id="r1", manifest_json="{}", tensors=b"\x00\x01", signature=b"\xff"),
    ReleaseAck(release_id="r1", site_name="site-a", artifact_sha256="0" * 64),
    ABORT,
]


def _envelope(record: RecordDict) -> ConfigRecord:
    # The record holds exactly one config record: the envelope.
    (envelope,) = record.config_records.values()
    return envelope


def _tampered(msg: Any, **changes: Any) -> RecordDict:
    record = message_to_record(msg)
    envelope = _envelope(record)
    for key, value in changes.items():
        envelope[key.replace("_", "-")] = value
    return record


def _with_body(msg: Any, edit: Any) -> RecordDict:
    body = json.loads(msg.model_dump_json())
    edit(body)
    return _tampered(msg, body=json.dumps(body))


# ----------------------------------------------------------------- messages


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_kind_round_trips(msg: WireMessage) -> None:
    # Act
    decoded = message_from_record(message_to_record(msg))

    # Assert
    assert decoded == msg
    assert type(decoded) is type(msg)


def test_encoding_a_model_without_kind_is_a_type_error() -> None:
    class Kindless(WireMessage):
        release_id: str

    with pytest.raises(TypeError, match="Kindless"):
        message_to_record(Kindless(release_id="r1"))


def test_envelope_carries_kind_and_version() -> None:
    envelope = _envelope(message_to_record(ABORT))

    assert envelope["kind"] == "abort"
    assert envelope["protocol-version"] == PROTOCOL_VERSION


def test_extra_field_is_rejected_with_its_name() -> None:
    record = _with_body(ABORT, lambda body: body.update(sneaky=1))

    with pytest.raises(MessageDecodeError, match=r"(?s)sneaky.*Extra inputs are not permitted"):
        message_from_record(record)


def test_missing_field_is_rejected_with_its_name() -> None:
    record = _with_body(ABORT, lambda body: body.pop("reason"))

    with pytest.raises(MessageDecodeError, match=r"(?s)reason.*Field required") as info:
        message_from_record(record)

    assert info.value.__cause__ is not None


def test_invalid_json_body_is_a_decode_error() -> None:
    with pytest.raises(MessageDecodeError, match="abort"):
        message_from_record(_tampered(ABORT, body="{not json"))


def test_body_kind_must_match_envelope_kind() -> None:
    with pytest.raises(MessageDecodeError, match="body kind must match envelope kind 'error'"):
        message_from_record(_tampered(ABORT, kind="error"))


@pytest.mark.parametrize("version", ["6.0", "8.0", "0.9", "one", ""])
def test_other_major_version_is_refused_before_the_body_is_read(version: str) -> None:
    record = _tampered(ABORT, protocol_version=version, body="{not json")

    with pytest.raises(VersionMismatchError, match=repr(version)):
        message_from_record(record)


def test_same_major_other_minor_is_accepted() -> None:
    assert message_from_record(_tampered(ABORT, protocol_version="7.9")) == ABORT


def test_check_compatible_message_shows_both_versions() -> None:
    with pytest.raises(VersionMismatchError, match=r"got '8\.1' \(local version '7\.0'\)"):
        check_compatible("8.1")


def test_record_without_envelope_is_a_decode_error() -> None:
    with pytest.raises(MessageDecodeError, match="must hold a config record"):
        message_from_record(RecordDict({"other": ConfigRecord({"x": 1})}))


def test_envelope_with_non_string_entry_is_a_decode_error() -> None:
    with pytest.raises(MessageDecodeError, match="envelope key 'body' must hold a str"):
        message_from_record(_tampered(ABORT, body=3))


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(MessageDecodeError, ValueError)


# ----------------------------------------------------------------- expect


def test_expect_returns_the_expected_message() -> None:
    assert expect(message_to_record(ABORT), AbortNotice) == ABORT


def test_expect_raises_remote_error_for_an_error_reply() -> None:
    reply = ErrorReply(code=ErrorCode.MODEL_MISMATCH, reason="fingerprint differs")

    with pytest.raises(RemoteError, match="fingerprint differs") as info:
        expect(message_to_record(reply), PlanAccept)

    assert info.value.code is ErrorCode.MODEL_MISMATCH


def test_expect_refuses_another_kind() -> None:
    with pytest.raises(MessageDecodeError, match="must be a PlanAccept, got a AbortNotice"):
        expect(message_to_record(ABORT), PlanAccept)


# ----------------------------------------------------------------- arrays


# ----------------------------------------------------------------- secure-sum messages

RANGES = SumRanges(clipping_range=4.0, quantization_range=2**30, modulus_range=2**62)
EXTRACT_REQUEST = SecureSumRequest(
    release_id="r1", stage="extract", heads=((0, 1),), clip_norm=2.0, score_top_r=None
)
ADVERTS = [
    KeyAdvert(
        member=f"site-{node}",
        node_id=node,
        release_id="r1",
        roster_sha256="ab" * 32,
        public_key=bytes([node]) * 32,
        nonce_commitment=bytes([node + 8]) * 32,
        signature=bytes([node]) * 64,
    )
    for node in (1, 2)
]
SUM_EXAMPLES: list[WireMessage] = [
    SumSharesRequest(
        release_id="r1",
        adverts=ADVERTS,
        nonces=[],
        instructions=SumInstructions(sum_index=0, request=EXTRACT_REQUEST, ranges=RANGES),
    ),
    SumCollectRequest(
        release_id="r1",
        instructions=SumInstructions(sum_index=1, request=SELECT_REQUEST, ranges=RANGES),
    ),
    MaskedInput(release_id="r1", sum_index=0, boxes=[AddressedBox(node_id=2, box=b"\x00" * 60)]),
    SurvivorsRequest(release_id="r1", sum_index=0, survivors=[1, 2], boxes=[]),
    SurvivorsSigned(release_id="r1", sum_index=1, signature=bytes(64)),
    UnmaskRequest(
        release_id="r1",
        sum_index=0,
        survivors=[1, 2],
        signatures=[NodeBytes(node_id=1, value=bytes(64)), NodeBytes(node_id=2, value=b"s")],
    ),
    UnmaskReply(
        release_id="r1",
        sum_index=0,
        seed_shares=[NodeBytes(node_id=1, value=b"share")],
        pair_seeds=[NodeBytes(node_id=3, value=bytes(32))],
    ),
    SumKeysRequest(release_id="r1", adverts=ADVERTS),
    NonceReveal(release_id="r1", nonce=bytes(range(32))),
    SumSharesRequest(
        release_id="r1",
        adverts=ADVERTS,
        nonces=[NodeBytes(node_id=1, value=bytes(32)), NodeBytes(node_id=2, value=b"n" * 32)],
        instructions=SumInstructions(sum_index=0, request=EXTRACT_REQUEST, ranges=RANGES),
    ),
]


@pytest.mark.parametrize("size", [31, 33])
def test_a_nonce_or_commitment_of_another_length_is_refused(size: int) -> None:
    # Arrange: both are exactly 32 bytes (a SHA-256 digest; the nonce is as long).
    reveal = json.loads(NonceReveal(release_id="r1", nonce=bytes(32)).model_dump_json())
    advert = json.loads(ADVERTS[0].model_dump_json())

    # Act / Assert
    with pytest.raises(ValueError, match=f"must be 32 bytes, got {size}"):
        NonceReveal.model_validate_json(
            json.dumps({**reveal, "nonce": base64.b64encode(bytes(size)).decode()})
        )
    with pytest.raises(ValueError, match=f"must be 32 bytes, got {size}"):
        KeyAdvert.model_validate_json(
            json.dumps({**advert, "nonce_commitment": base64.b64encode(bytes(size)).decode()})
        )


@pytest.mark.parametrize("msg", SUM_EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_secure_sum_message_round_trips(msg: WireMessage) -> None:
    # Act
    decoded = message_from_record(message_to_record(msg))

    # Assert
    assert decoded == msg
    assert type(decoded) is type(msg)


def test_a_secure_sum_request_travels_inside_a_sum_s_instructions() -> None:
    # Arrange
    collect = SumCollectRequest(
        release_id="r1",
        instructions=SumInstructions(sum_index=1, request=EXTRACT_REQUEST, ranges=RANGES),
    )

    # Act
    decoded = expect(message_to_record(collect), SumCollectRequest)

    # Assert
    assert decoded.instructions.request == EXTRACT_REQUEST
    assert decoded.instructions.ranges == RANGES


def test_bytes_travel_as_base64_text_in_the_body() -> None:
    # Act
    body = json.loads(str(_envelope(message_to_record(SUM_EXAMPLES[4]))["body"]))

    # Assert
    assert body["signature"] == base64.b64encode(bytes(64)).decode("ascii")


def test_a_sum_message_of_another_kind_than_expected_is_refused() -> None:
    # Arrange
    record = message_to_record(SUM_EXAMPLES[1])

    # Act / Assert
    with pytest.raises(MessageDecodeError, match="must be a SumSharesRequest, got a Sum"):
        expect(record, SumSharesRequest)


def test_a_sum_message_body_of_another_kind_is_refused() -> None:
    # Arrange: the envelope says survivors-signed, the body is an unmask request.
    record = _tampered(SUM_EXAMPLES[5], kind="survivors-signed")

    # Act / Assert
    with pytest.raises(MessageDecodeError, match="survivors-signed"):
        message_from_record(record)


def test_a_sum_message_from_another_major_version_is_refused() -> None:
    # Arrange
    record = _tampered(SUM_EXAMPLES[0], protocol_version="8.1", body="{not json")

    # Act / Assert
    with pytest.raises(VersionMismatchError):
        message_from_record(record)


@pytest.mark.parametrize(
    ("value", "match"),
    [("not base64!", "must be base64"), ("AAAA", "must be 64 bytes, got 3"), (7, "base64 text")],
)
def test_a_signature_that_is_not_64_base64_bytes_is_refused(value: object, match: str) -> None:
    # Arrange
    def edit(body: dict[str, Any]) -> None:
        body["signature"] = value

    record = _with_body(SUM_EXAMPLES[4], edit)

    # Act / Assert
    with pytest.raises(MessageDecodeError, match=match):
        message_from_record(record)

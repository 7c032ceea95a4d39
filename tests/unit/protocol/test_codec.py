import json
from datetime import UTC, datetime
from typing import Any

import pytest
from flwr.app import ConfigRecord, RecordDict

from protocol import (
    PROTOCOL_VERSION,
    AbortNotice,
    ErrorCode,
    ErrorReply,
    MessageDecodeError,
    PlanAccept,
    PlanRequest,
    ReleaseAck,
    ReleaseOrder,
    ReleasePlan,
    ReleaseRequest,
    RemoteError,
    SecureSumRequest,
    SelectionMode,
    VersionMismatchError,
    WireMessage,
    check_compatible,
    expect,
    message_from_record,
    message_to_record,
    secure_sum_request_from_config,
    secure_sum_request_to_config,
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


@pytest.mark.parametrize("version", ["3.0", "5.0", "0.9", "one", ""])
def test_other_major_version_is_refused_before_the_body_is_read(version: str) -> None:
    record = _tampered(ABORT, protocol_version=version, body="{not json")

    with pytest.raises(VersionMismatchError, match=repr(version)):
        message_from_record(record)


def test_same_major_other_minor_is_accepted() -> None:
    assert message_from_record(_tampered(ABORT, protocol_version="4.7")) == ABORT


def test_check_compatible_message_shows_both_versions() -> None:
    with pytest.raises(VersionMismatchError, match=r"got '5\.1' \(local version '4\.0'\)"):
        check_compatible("5.1")


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


# ----------------------------------------------------------------- FitIns config


def test_secure_sum_request_round_trips_through_a_fitins_config() -> None:
    req = SecureSumRequest(
        release_id="r1", stage="extract", heads=((0, 1),), clip_norm=2.0, score_top_r=None
    )

    config = secure_sum_request_to_config(req)

    assert all(isinstance(value, str | int | float | bool) for value in config.values())
    assert "stage" not in config  # SecAgg+ owns that key
    assert secure_sum_request_from_config({**config, "server-round": 3}) == req


def test_fitins_config_with_another_message_is_refused() -> None:
    config = secure_sum_request_to_config(SELECT_REQUEST)
    config["body"] = ABORT.model_dump_json()
    config["kind"] = "abort"

    with pytest.raises(MessageDecodeError, match="must hold a SecureSumRequest"):
        secure_sum_request_from_config(config)


def test_fitins_config_from_another_major_version_is_refused() -> None:
    config = {**secure_sum_request_to_config(SELECT_REQUEST), "protocol-version": "5.1"}

    with pytest.raises(VersionMismatchError):
        secure_sum_request_from_config(config)


def test_fitins_config_without_our_keys_is_a_decode_error() -> None:
    with pytest.raises(MessageDecodeError, match="protocol-version"):
        secure_sum_request_from_config({"stage": "setup"})

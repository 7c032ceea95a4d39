"""Messages to Flower records and back: the only module that knows wire keys.

How this connects: the server and client apps build a message model (``protocol.messages``),
call :func:`message_to_record` and put the ``RecordDict`` in a Flower ``Message``; the
receiver calls :func:`expect` (or :func:`message_from_record`) on the content. A SecAgg+
round cannot carry our records (``secaggplus_mod`` owns the ``train`` content), so its
:class:`~protocol.messages.SecureSumRequest` travels flattened in the legacy FitIns config
through :func:`secure_sum_request_to_config`. Arrays never go through JSON: the one array a
coordinator sends (the noisy vector of a release-first select sum) travels in that round's
FitIns parameters (``client.secagg.sent_reference``); artifacts travel as signed bytes.

Envelope, the same in a ``ConfigRecord`` and in a FitIns config::

    {"kind": <message kind>, "protocol-version": PROTOCOL_VERSION, "body": <model JSON>}

Decoding checks the version before anything else, so a peer on another MAJOR version gets
a clear :class:`~protocol.errors.VersionMismatchError` instead of field errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from flwr.app import ConfigRecord, RecordDict
from pydantic import TypeAdapter, ValidationError

from protocol.errors import MessageDecodeError
from protocol.messages import AnyMessage, ErrorReply, SecureSumRequest, WireMessage
from protocol.version import PROTOCOL_VERSION, check_compatible

__all__ = [
    "MESSAGE_RECORD_KEY",
    "expect",
    "message_from_record",
    "message_to_record",
    "secure_sum_request_from_config",
    "secure_sum_request_to_config",
]

_M = TypeVar("_M", bound=WireMessage)

# Record keys. None of the envelope keys may be "stage": SecAgg+ reads that key.
MESSAGE_RECORD_KEY = "dpmtv"
_MESSAGE_KEY = MESSAGE_RECORD_KEY
_KIND = "kind"
_VERSION = "protocol-version"
_BODY = "body"

_ANY_MESSAGE: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)


def _envelope(msg: WireMessage) -> dict[str, str]:
    kind = getattr(msg, "kind", None)
    if not isinstance(kind, str):
        raise TypeError(f"msg must be a protocol message with a kind, got {type(msg).__name__}.")
    return {_KIND: kind, _VERSION: PROTOCOL_VERSION, _BODY: msg.model_dump_json()}


def _text(envelope: Mapping[str, Any], key: str) -> str:
    value = envelope.get(key)
    if not isinstance(value, str):
        raise MessageDecodeError(f"envelope key {key!r} must hold a str, got {value!r}.")
    return value


def _message_from_envelope(envelope: Mapping[str, Any]) -> AnyMessage:
    check_compatible(_text(envelope, _VERSION))
    kind = _text(envelope, _KIND)
    try:
        msg = _ANY_MESSAGE.validate_json(_text(envelope, _BODY))
    except ValidationError as exc:
        raise MessageDecodeError(f"message body of kind {kind!r} is invalid: {exc}") from exc
    if msg.kind != kind:
        raise MessageDecodeError(f"body kind must match envelope kind {kind!r}, got {msg.kind!r}.")
    return msg


def message_to_record(msg: WireMessage) -> RecordDict:
    """Encode a message (any of ``protocol.messages``) as a record."""
    # update() rather than ConfigRecord(dict): its constructor wants the full value union.
    envelope = ConfigRecord()
    envelope.update(_envelope(msg))
    return RecordDict({_MESSAGE_KEY: envelope})


def message_from_record(record: RecordDict) -> AnyMessage:
    """Decode the message in a record.

    Raises:
        VersionMismatchError: The sender speaks another MAJOR protocol version.
        MessageDecodeError: The record holds no message, or an invalid one.
    """
    if _MESSAGE_KEY not in record.config_records:
        raise MessageDecodeError(
            f"record must hold a config record {_MESSAGE_KEY!r}, got keys {sorted(record)!r}."
        )
    return _message_from_envelope(record.config_records[_MESSAGE_KEY])


def expect(record: RecordDict, message_type: type[_M]) -> _M:
    """Decode a record that must hold a ``message_type``; a peer's error is raised.

    Raises:
        RemoteError: The peer replied with an ``ErrorReply``.
        MessageDecodeError: The record holds another kind of message, or none.
        VersionMismatchError: The sender speaks another MAJOR protocol version.
    """
    msg = message_from_record(record)
    if isinstance(msg, message_type):
        return msg
    if isinstance(msg, ErrorReply):
        msg.raise_remote()
    raise MessageDecodeError(
        f"message must be a {message_type.__name__}, got a {type(msg).__name__} "
        f"(kind {msg.kind!r})."
    )


def secure_sum_request_to_config(req: SecureSumRequest) -> dict[str, str | int | float | bool]:
    """Flatten a request into scalar entries for a legacy FitIns config."""
    return dict(_envelope(req))


def secure_sum_request_from_config(cfg: Mapping[str, Any]) -> SecureSumRequest:
    """Read a request back from a FitIns config; keys that are not ours are ignored.

    Raises:
        MessageDecodeError: The config holds no valid ``SecureSumRequest``.
        VersionMismatchError: The sender speaks another MAJOR protocol version.
    """
    msg = _message_from_envelope(cfg)
    if not isinstance(msg, SecureSumRequest):
        raise MessageDecodeError(
            f"FitIns config must hold a SecureSumRequest, got a {type(msg).__name__}."
        )
    return msg

"""Messages to Flower records and back: the only module that knows wire keys.

How this connects: the server and client apps build a message model (``protocol.messages``,
``protocol.secure_sum``), call :func:`message_to_record` and put the ``RecordDict`` in a
Flower ``Message``; the receiver calls :func:`expect` (or :func:`message_from_record`) on
the content. Arrays never go through JSON: a secure sum's masked vector and the noisy vector
a release-first select sum carries travel beside the message in an ``ArrayRecord``
(:func:`with_array`, :func:`array_from_record`: numpy's format, header checked first, never a
pickle); artifacts travel as signed bytes.

Envelope, in a ``ConfigRecord``::

    {"kind": <message kind>, "protocol-version": PROTOCOL_VERSION, "body": <model JSON>}

Decoding checks the version before anything else, so a peer on another MAJOR version gets
a clear :class:`~protocol.errors.VersionMismatchError` instead of field errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from pydantic import TypeAdapter, ValidationError

from dpmtv_common.aliases import Float64Array, Int64Array
from protocol.errors import MessageDecodeError
from protocol.messages import AnyMessage, ErrorReply, WireMessage
from protocol.secure_sum import SUM_MESSAGE_KINDS, AnySumMessage
from protocol.version import PROTOCOL_VERSION, check_compatible

# Flower's record types are imported where records are built, so a process that imports the
# protocol without exchanging messages (the HTTP front) does not load Flower (0.14 s).
if TYPE_CHECKING:
    from flwr.app import RecordDict

__all__ = [
    "MESSAGE_RECORD_KEY",
    "array_from_record",
    "with_array",
    "expect",
    "message_from_record",
    "message_to_record",
]

_M = TypeVar("_M", bound=WireMessage)

# Record keys.
MESSAGE_RECORD_KEY = "dpmtv"
_MESSAGE_KEY = MESSAGE_RECORD_KEY
_KIND = "kind"
_VERSION = "protocol-version"
_BODY = "body"

_ANY_MESSAGE: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)
_SUM_MESSAGE: TypeAdapter[AnySumMessage] = TypeAdapter(AnySumMessage)
_ARRAY_DTYPES = {"int64": np.int64, "float64": np.float64}


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


def _message_from_envelope(envelope: Mapping[str, Any]) -> AnyMessage | AnySumMessage:
    check_compatible(_text(envelope, _VERSION))
    kind = _text(envelope, _KIND)
    adapter: TypeAdapter[Any] = _SUM_MESSAGE if kind in SUM_MESSAGE_KINDS else _ANY_MESSAGE
    try:
        msg: AnyMessage | AnySumMessage = adapter.validate_json(_text(envelope, _BODY))
    except ValidationError as exc:
        raise MessageDecodeError(f"message body of kind {kind!r} is invalid: {exc}") from exc
    if msg.kind != kind:
        raise MessageDecodeError(f"body kind must match envelope kind {kind!r}, got {msg.kind!r}.")
    return msg


def message_to_record(msg: WireMessage) -> RecordDict:
    """Encode a message (any of ``protocol.messages``) as a record."""
    from flwr.app import ConfigRecord, RecordDict

    # update() rather than ConfigRecord(dict): its constructor wants the full value union.
    envelope = ConfigRecord()
    envelope.update(_envelope(msg))
    return RecordDict({_MESSAGE_KEY: envelope})


def message_from_record(record: RecordDict) -> AnyMessage | AnySumMessage:
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


def with_array(record: RecordDict, key: str, values: Int64Array | Float64Array) -> RecordDict:
    """``record`` with one 1-d int64 or float64 array beside its message (numpy's format)."""
    from flwr.app import Array, ArrayRecord

    array = np.ascontiguousarray(values)
    if array.ndim != 1 or array.dtype.name not in _ARRAY_DTYPES:
        raise TypeError(f"values must be 1-d int64 or float64, got {array.dtype}{array.shape}.")
    record[key] = ArrayRecord({key: Array(array)})
    return record


def array_from_record(
    record: RecordDict, key: str, *, dtype: str, length: int | None = None
) -> Int64Array | Float64Array:
    """The one array under ``key``, checked against its header before it is decoded.

    Raises:
        MessageDecodeError: No such array, another dtype or shape, or undecodable bytes.
    """
    arrays = record.array_records.get(key)
    if arrays is None or list(arrays) != [key]:
        raise MessageDecodeError(f"record must carry one array {key!r}, got {sorted(record)!r}.")
    array = arrays[key]
    if array.dtype != dtype or len(array.shape) != 1:
        raise MessageDecodeError(
            f"array {key!r} must be 1-d {dtype}, got {array.dtype}{tuple(array.shape)}."
        )
    if length is not None and array.shape[0] != length:
        raise MessageDecodeError(f"array {key!r} must hold {length} values, got {array.shape[0]}.")
    try:
        values = array.numpy()  # numpy's own format, loaded without pickles
    except (TypeError, ValueError, EOFError, OSError) as exc:
        raise MessageDecodeError(f"array {key!r} must decode: {exc}") from exc
    if values.dtype != _ARRAY_DTYPES[dtype] or values.shape != tuple(array.shape):
        raise MessageDecodeError(f"array {key!r} must match its header, got another array.")
    return np.asarray(values)

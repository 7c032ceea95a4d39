"""The protocol's errors, and the closed set of codes an error crosses the wire with.

An exception never crosses the wire as a pickle (unpickling peer data runs peer code).
A peer turns its exception into ``ErrorReply(code, reason)``; the receiver raises one
local :class:`RemoteError` from it. ::

    dpmtv_common.errors.ProtocolError
    ├── StageOrderError              a stage arrived out of the allowed order
    ├── MessageDecodeError (ValueError)  a record is not a well-formed message
    ├── VersionMismatchError         the peer speaks another protocol MAJOR version
    ├── PlanMismatchError            a notice or artifact does not match the plan a site accepted
    └── RemoteError                  the peer replied with an ErrorReply
"""

from __future__ import annotations

from enum import StrEnum

from dpmtv_common.errors import ProtocolError

__all__ = [
    "ErrorCode",
    "MessageDecodeError",
    "PlanMismatchError",
    "ProtocolError",
    "RemoteError",
    "StageOrderError",
    "VersionMismatchError",
]


class ErrorCode(StrEnum):
    """Why a peer refused or failed a request; the only error detail a peer must parse."""

    VERSION_MISMATCH = "version-mismatch"
    MODEL_MISMATCH = "model-mismatch"
    BUDGET_EXCEEDED = "budget-exceeded"
    INSUFFICIENT_DATA = "insufficient-data"
    POLICY = "policy"
    PLAN_MISMATCH = "plan-mismatch"
    BAD_REQUEST = "bad-request"
    STAGE_ORDER = "stage-order"
    INTERNAL = "internal"
    REFUSED = "refused"


class StageOrderError(ProtocolError):
    """A release stage was requested out of the allowed order (see ``protocol.stages``)."""


class MessageDecodeError(ProtocolError, ValueError):
    """A record does not hold a well-formed message of the expected kind."""


class VersionMismatchError(ProtocolError):
    """The peer speaks a protocol version with another MAJOR number."""


class PlanMismatchError(ProtocolError):
    """A notice, request or artifact does not match the plan the site accepted."""


class RemoteError(ProtocolError):
    """The peer replied with an ``ErrorReply``; raised locally in its place.

    Attributes:
        code: The peer's error code.
        reason: The peer's human-readable reason (peer-controlled text: display, never eval).
    """

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"peer replied with error {code.value!r}: {reason}")
        self.code = code
        self.reason = reason

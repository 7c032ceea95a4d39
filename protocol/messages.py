"""One pydantic model per message of a release, discriminated on ``kind``.

Models are frozen, forbid unknown fields and validate strictly, so a body that decodes
is exactly what the sender meant. Encoding to Flower records lives in ``protocol.codec``
and nowhere else.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, NoReturn, Self, TypeAlias

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from dpmtv_common.errors import (
    ConfigError,
    DataError,
    DpmtvError,
    ModelMismatchError,
    PrivacyBudgetExceededError,
)
from protocol.errors import (
    ErrorCode,
    MessageDecodeError,
    RemoteError,
    StageOrderError,
    VersionMismatchError,
)
from protocol.plan import HeadList, NonEmptyStr, PositiveFloat, PositiveInt, ReleasePlan

__all__ = [
    "AbortNotice",
    "AnyMessage",
    "ErrorReply",
    "NoisyVectorBroadcast",
    "PlanAccept",
    "PlanRequest",
    "ReleaseAck",
    "ReleaseRequest",
    "SecureSumRequest",
    "WireMessage",
]

# First match wins, so subclasses come before the classes they refine.
_CODE_OF_EXCEPTION: tuple[tuple[type[BaseException], ErrorCode], ...] = (
    (PrivacyBudgetExceededError, ErrorCode.BUDGET_EXCEEDED),
    (ModelMismatchError, ErrorCode.MODEL_MISMATCH),
    (VersionMismatchError, ErrorCode.VERSION_MISMATCH),
    (StageOrderError, ErrorCode.STAGE_ORDER),
    (DataError, ErrorCode.INSUFFICIENT_DATA),
    (ConfigError, ErrorCode.BAD_REQUEST),
    (MessageDecodeError, ErrorCode.BAD_REQUEST),
    (DpmtvError, ErrorCode.REFUSED),
)
# Bounds what one reply can carry; a reason is for a human reading a log line.
_MAX_REASON_CHARS = 2000
_INTERNAL_REASON = "internal error at the peer; its operator can find the cause in its logs."


def _sha256_hex(value: str) -> str:
    if re.fullmatch(r"[0-9a-f]{64}", value) is None:
        raise ValueError(f"artifact_sha256 must be 64 lowercase hex digits, got {value!r}.")
    return value


class WireMessage(BaseModel):
    """Base of every message: frozen, no unknown fields, strict types."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class PlanRequest(WireMessage):
    """Coordinator to site: the plan of this release, for the site to accept or refuse."""

    kind: Literal["plan-request"] = "plan-request"
    plan: ReleasePlan


class PlanAccept(WireMessage):
    """Site to coordinator: the site accepts the plan and will contribute ``num_chunks``.

    Attributes:
        num_chunks: m_i, the site's disjoint chunks of K + 1 examples.
        num_layers: L of the site's model (the coordinator needs no model of its own).
        num_heads: H, attention heads a layer.
        head_dim: D, dimensions a head.
    """

    kind: Literal["plan-accept"] = "plan-accept"
    release_id: NonEmptyStr
    site_name: NonEmptyStr
    num_chunks: Annotated[int, Field(ge=0)]
    num_layers: Annotated[int, Field(ge=1)]
    num_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]


class ErrorReply(WireMessage):
    """Either side: the request failed or was refused; an exception carried as data."""

    kind: Literal["error"] = "error"
    code: ErrorCode
    reason: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorReply:
        """Turn a local exception into a reply, without leaking unexpected internals.

        Typed dpmtv errors carry their message (written for the peer's operator); any
        other exception becomes ``internal`` with a generic reason, because its text may
        hold paths, data or stack details.
        """
        for exc_type, code in _CODE_OF_EXCEPTION:
            if isinstance(exc, exc_type):
                return cls(code=code, reason=str(exc)[:_MAX_REASON_CHARS])
        return cls(code=ErrorCode.INTERNAL, reason=_INTERNAL_REASON)

    def raise_remote(self) -> NoReturn:
        """Raise this reply as a local :class:`~protocol.errors.RemoteError`."""
        raise RemoteError(self.code, self.reason)


class SecureSumRequest(WireMessage):
    """Coordinator to site: the content of one SecAgg+ round (travels in the FitIns config).

    Attributes:
        stage: ``select`` sums per-chunk head votes; ``extract`` sums clipped activations.
        heads: Heads in scope, or ``None`` for every head of the model.
        clip_norm: L2 bound C per layer and chunk; sets the Gaussian sensitivity.
        score_top_r: Heads each chunk votes for; set iff ``stage`` is ``select``.
    """

    kind: Literal["secure-sum-request"] = "secure-sum-request"
    release_id: NonEmptyStr
    stage: Literal["select", "extract"]
    heads: HeadList | None
    clip_norm: PositiveFloat
    score_top_r: PositiveInt | None

    @model_validator(mode="after")
    def _check_score_top_r(self) -> Self:
        if (self.stage == "select") != (self.score_top_r is not None):
            need = "set" if self.stage == "select" else "None"
            raise ValueError(
                f"score_top_r must be {need} when stage is {self.stage!r}, "
                f"got {self.score_top_r!r}."
            )
        return self


class NoisyVectorBroadcast(WireMessage):
    """Coordinator to site: the noisy mean activations; arrays travel beside the body.

    Attributes:
        heads: Row ``i`` of the arrays belongs to ``heads[i]``.
    """

    kind: Literal["noisy-vector"] = "noisy-vector"
    release_id: NonEmptyStr
    heads: HeadList


class ReleaseRequest(WireMessage):
    """Coordinator to site: the signed task-vector artifact, for the site to store.

    Attributes:
        manifest_json: The artifact manifest, as signed.
        tensors: The safetensors bytes, as signed.
        signature: Ed25519 signature over manifest and tensors.
    """

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    kind: Literal["release-request"] = "release-request"
    release_id: NonEmptyStr
    manifest_json: str
    tensors: bytes
    signature: bytes


class ReleaseAck(WireMessage):
    """Site to coordinator: the artifact verified and is stored; its ledger is committed."""

    kind: Literal["release-ack"] = "release-ack"
    release_id: NonEmptyStr
    site_name: NonEmptyStr
    artifact_sha256: Annotated[str, AfterValidator(_sha256_hex)]


class AbortNotice(WireMessage):
    """Coordinator to site: the release stops.

    Attributes:
        noisy_output: Whether any noisy output (Gumbel picks or the Gaussian draw) already
            exists. False: the site refunds its reservation. True: the release counts as
            spent in every ledger although no artifact follows (fail closed).
    """

    kind: Literal["abort"] = "abort"
    release_id: NonEmptyStr
    reason: str
    noisy_output: bool


AnyMessage: TypeAlias = Annotated[
    PlanRequest
    | PlanAccept
    | ErrorReply
    | SecureSumRequest
    | NoisyVectorBroadcast
    | ReleaseRequest
    | ReleaseAck
    | AbortNotice,
    Field(discriminator="kind"),
]
"""Any message, told apart by its ``kind`` field."""

"""One pydantic model per message of a release, discriminated on ``kind``.

Models are frozen, forbid unknown fields and validate strictly, so a body that decodes
is exactly what the sender meant. Encoding to Flower records lives in ``protocol.codec``
and nowhere else.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, NoReturn, Self, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

from dpmtv_common.errors import (
    ConfigError,
    DataError,
    DpmtvError,
    ModelMismatchError,
    PolicyError,
    PrivacyBudgetExceededError,
)
from dpmtv_common.heads import HeadLayout, check_head_layers
from protocol.errors import (
    ErrorCode,
    MessageDecodeError,
    PlanMismatchError,
    RemoteError,
    StageOrderError,
    VersionMismatchError,
)
from protocol.plan import (
    MAX_HEADS,
    BoundedStr,
    HeadCount,
    HeadList,
    PositiveFloat,
    ReleaseId,
    ReleasePlan,
)
from protocol.sum_keys import KeyAdvert

__all__ = [
    "AbortNotice",
    "AnyMessage",
    "CENTRE_ARRAY_KEY",
    "ErrorReply",
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
    (PolicyError, ErrorCode.POLICY),
    (ModelMismatchError, ErrorCode.MODEL_MISMATCH),
    (VersionMismatchError, ErrorCode.VERSION_MISMATCH),
    (StageOrderError, ErrorCode.STAGE_ORDER),
    (PlanMismatchError, ErrorCode.PLAN_MISMATCH),
    (DataError, ErrorCode.INSUFFICIENT_DATA),
    (ConfigError, ErrorCode.BAD_REQUEST),
    (MessageDecodeError, ErrorCode.BAD_REQUEST),
    (DpmtvError, ErrorCode.REFUSED),
)
# A reply's reason is fixed text chosen by its code, never the exception's message: a site's
# exception text can quote its private records (a bad manifest line, a file name), and the
# reply goes to the coordinator. The details stay in the sender's own log.
_FIXED_REASONS: dict[ErrorCode, str] = {
    ErrorCode.VERSION_MISMATCH: "the peer speaks another protocol version.",
    ErrorCode.MODEL_MISMATCH: "the plan or artifact names another model than the site's.",
    ErrorCode.BUDGET_EXCEEDED: "the plan does not fit the site's remaining privacy budget.",
    ErrorCode.INSUFFICIENT_DATA: "the site's data cannot serve this plan.",
    ErrorCode.POLICY: "the plan or request lies outside the site's own policy.",
    ErrorCode.PLAN_MISMATCH: "the request does not match the plan the site accepted.",
    ErrorCode.BAD_REQUEST: "the request is malformed or out of bounds.",
    ErrorCode.STAGE_ORDER: "the request is out of order for this release.",
    ErrorCode.REFUSED: "the peer refused the request.",
    ErrorCode.INTERNAL: "internal error at the peer; its operator can find the cause in its logs.",
}
_MAX_REASON_CHARS = 2000
_MAX_TYPE_CHARS = 64
_MAX_MANIFEST_CHARS = 1 << 20  # a manifest is a few kB: plan, privacy numbers, layout
_MAX_TENSOR_BYTES = 1 << 30  # every head of a large model in float32 is ~100 MB


def _error_type(value: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value) is None or len(value) > _MAX_TYPE_CHARS:
        raise ValueError(f"error_type must be a Python identifier of <= 64 chars, got {value!r}.")
    return value


def _reason(value: str) -> str:
    if len(value) > _MAX_REASON_CHARS:
        raise ValueError(
            f"reason must be at most {_MAX_REASON_CHARS} characters, got {len(value)}."
        )
    return value


def _dtype_name(value: str) -> str:
    if value not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model_dtype must be float32, bfloat16 or float16, got {value!r}.")
    return value


def _sha256_hex(value: str, info: ValidationInfo) -> str:
    if re.fullmatch(r"[0-9a-f]{64}", value) is None:
        raise ValueError(f"{info.field_name} must be 64 lowercase hex digits, got {value!r}.")
    return value


def _package_version(value: str) -> str:
    if re.fullmatch(r"[0-9A-Za-z.+!_-]{1,64}", value) is None:
        raise ValueError(
            f"dpmtv_version must be a package version of 1-64 characters "
            f"[0-9A-Za-z.+!_-], got {value!r}."
        )
    return value


class WireMessage(BaseModel):
    """Base of every message: frozen, no unknown fields, strict types."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


CENTRE_ARRAY_KEY = "dpmtv-centre"
"""Where a centred plan's public centre travels beside its ``PlanRequest`` (flat float64)."""


class PlanRequest(WireMessage):
    """Coordinator to site: the plan of this release, for the site to accept or refuse.

    A centred plan (``plan.centre_sha256``) carries its public centre beside the message, as
    a flat float64 array under :data:`CENTRE_ARRAY_KEY`; the site refuses one whose digest
    is not the plan's.
    """

    kind: Literal["plan-request"] = "plan-request"
    plan: ReleasePlan


class PlanAccept(WireMessage):
    """Site to coordinator: the site accepts the plan and will contribute ``num_chunks``.

    Attributes:
        num_chunks: m_i, the site's disjoint chunks of K + 1 examples.
        num_layers: L of the site's model (the coordinator needs no model of its own).
        num_heads: H, attention heads a layer.
        head_dim: D, dimensions a head.
        model_dtype: The dtype the site extracts in (``float32``, ``bfloat16``, ``float16``);
            the coordinator refuses a consortium that mixes them, and records it.
        head_layers: The decoder layers that carry heads, strictly ascending within
            ``[0, num_layers)``; None means every layer. A hybrid's linear-attention or
            convolution layers carry none. The coordinator refuses a consortium that
            disagrees, and "all heads" of the release are the heads of these layers.
        prompt_template_sha256: SHA-256 hex of the chat template the site renders every
            prompt with (``client.models.prompt_template_digest``): the processor's, which
            the fingerprint covers, or the adapter's built-in one, which it does not. The
            coordinator refuses a consortium that mixes them, and the manifest records it.
        instruction_sha256: SHA-256 hex of the task instruction the site's prompts carry
            (``client.models.instruction_digest``: no instruction and an empty one share the
            digest of the empty string, as they build the same prompts). The coordinator
            refuses a consortium that mixes them, and the manifest records it.
        dpmtv_version: The dpmtv package version the site runs; recorded in the manifest,
            never refused (the template digest already covers what it changes in a prompt).
        keys: The site's X25519 key for this release's secure sums, signed with its roster
            identity (``protocol.sum_keys``); the site service always sends it, and the
            coordinator keeps no site without it.
    """

    kind: Literal["plan-accept"] = "plan-accept"
    release_id: ReleaseId
    site_name: BoundedStr
    num_chunks: Annotated[int, Field(ge=0)]
    num_layers: Annotated[int, Field(ge=1)]
    num_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]
    model_dtype: Annotated[str, AfterValidator(_dtype_name)] | None = None
    head_layers: Annotated[tuple[int, ...], Field(max_length=MAX_HEADS)] | None = None
    prompt_template_sha256: Annotated[str, AfterValidator(_sha256_hex)]
    instruction_sha256: Annotated[str, AfterValidator(_sha256_hex)]
    dpmtv_version: Annotated[str, AfterValidator(_package_version)]
    keys: KeyAdvert | None = None

    @model_validator(mode="after")
    def _check_head_layers(self) -> Self:
        if self.head_layers is not None:
            check_head_layers(self.head_layers, self.num_layers)
        return self

    def layout(self) -> HeadLayout:
        """The site's model's head layout (which layers carry its heads)."""
        return HeadLayout(self.num_layers, self.num_heads, self.head_layers)


class ErrorReply(WireMessage):
    """Either side: the request failed or was refused; an exception carried as data."""

    kind: Literal["error"] = "error"
    code: ErrorCode
    error_type: Annotated[str, AfterValidator(_error_type)] = "DpmtvError"
    reason: Annotated[str, AfterValidator(_reason)]

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorReply:
        """Turn a local exception into a reply that carries no text of the exception.

        The reply holds a code, the exception's class name (a typed dpmtv error) or
        ``InternalError`` (anything else), and the fixed reason of the code. Exception text
        may quote private records, paths or stack details: it stays in the sender's log.
        """
        for exc_type, code in _CODE_OF_EXCEPTION:
            if isinstance(exc, exc_type):
                name = type(exc).__name__[:_MAX_TYPE_CHARS]
                return cls(code=code, error_type=name, reason=_FIXED_REASONS[code])
        code = ErrorCode.INTERNAL
        return cls(code=code, error_type="InternalError", reason=_FIXED_REASONS[code])

    def raise_remote(self) -> NoReturn:
        """Raise this reply as a local :class:`~protocol.errors.RemoteError`."""
        raise RemoteError(self.code, f"{self.error_type}: {self.reason}")


class SecureSumRequest(WireMessage):
    """Coordinator to site: what one secure sum asks for (inside ``SumInstructions``).

    Attributes:
        stage: ``select`` sums per-chunk head votes; ``extract`` sums clipped activations.
        heads: Heads in scope, or ``None`` for every head of the model.
        clip_norm: L2 bound C per layer and chunk; sets the Gaussian sensitivity.
        score_top_r: Heads each chunk votes for; set iff ``stage`` is ``select``.
        reference_heads: Release-first order with private selection: the heads of the noisy
            vector the votes are scored against, whose rows travel in the same message
            (beside it, under ``REFERENCE_ARRAY_KEY``), so the site keeps the exact vector
            it was sent before it votes. None when no vector is sent; only a ``select``
            request may carry one.
    """

    kind: Literal["secure-sum-request"] = "secure-sum-request"
    release_id: ReleaseId
    stage: Literal["select", "extract"]
    heads: HeadList | None
    clip_norm: PositiveFloat
    score_top_r: HeadCount | None
    reference_heads: HeadList | None = None

    @model_validator(mode="after")
    def _check_score_top_r(self) -> Self:
        if (self.stage == "select") != (self.score_top_r is not None):
            need = "set" if self.stage == "select" else "None"
            raise ValueError(
                f"score_top_r must be {need} when stage is {self.stage!r}, "
                f"got {self.score_top_r!r}."
            )
        if self.stage != "select" and self.reference_heads is not None:
            raise ValueError(
                f"reference_heads must be None when stage is {self.stage!r}, got "
                f"{len(self.reference_heads)} heads."
            )
        return self


class ReleaseRequest(WireMessage):
    """Coordinator to site: the signed task-vector artifact, for the site to store.

    Attributes:
        manifest_json: The artifact manifest, as signed.
        tensors: The safetensors bytes, as signed.
        signature: Ed25519 signature over manifest and tensors.
    """

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    kind: Literal["release-request"] = "release-request"
    release_id: ReleaseId
    manifest_json: Annotated[str, Field(max_length=_MAX_MANIFEST_CHARS)]
    tensors: Annotated[bytes, Field(max_length=_MAX_TENSOR_BYTES)]
    signature: Annotated[bytes, Field(max_length=1024)]


class ReleaseAck(WireMessage):
    """Site to coordinator: the artifact verified and is stored; its ledger is committed."""

    kind: Literal["release-ack"] = "release-ack"
    release_id: ReleaseId
    site_name: BoundedStr
    artifact_sha256: Annotated[str, AfterValidator(_sha256_hex)]


class AbortNotice(WireMessage):
    """Coordinator to site: the release stops.

    Attributes:
        noisy_output: The coordinator's view of whether any noisy output (Gumbel picks or
            the Gaussian draw) exists, for the sites' logs. A site never refunds on this
            word: it refunds only if its own record shows that none of its data left it.
    """

    kind: Literal["abort"] = "abort"
    release_id: ReleaseId
    reason: Annotated[str, AfterValidator(_reason)]
    noisy_output: bool


AnyMessage: TypeAlias = Annotated[
    PlanRequest
    | PlanAccept
    | ErrorReply
    | SecureSumRequest
    | ReleaseRequest
    | ReleaseAck
    | AbortNotice,
    Field(discriminator="kind"),
]
"""Any message, told apart by its ``kind`` field."""

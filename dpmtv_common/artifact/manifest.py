"""The manifest of a task-vector artifact: what was released, for which model, at what privacy.

Two models share the fields. :class:`ReleaseDescription` is what the releasing code knows;
:class:`ArtifactManifest` adds what the artifact writer derives (tensor layout and hash, plan
hash, signing key id) so that the two can never disagree with the tensors.

The signature covers :func:`manifest_to_canonical_bytes`: sorted keys, no spaces, ASCII,
no NaN or infinity. Any parsed manifest re-serializes to the same bytes, so ``manifest.json``
itself may be pretty-printed for people to read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import UTC, datetime
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dpmtv_common.crypto import KEY_ID_HEX_CHARS

__all__ = [
    "ArtifactManifest",
    "FORMAT_VERSION",
    "ReleaseDescription",
    "hash_plan",
    "manifest_to_canonical_bytes",
]

FORMAT_VERSION = 1
"""The artifact layout this module writes and reads."""
_MODEL_DTYPES = ("bfloat16", "float16", "float32")
"""Values of ``ReleaseDescription.model_dtype`` (torch dtype names without ``torch.``)."""

_OPTIONAL_FIELDS = (
    "model_dtype",
    "max_image_crops",
    "prompt_template_sha256",
    "instruction_sha256",
    "dpmtv_versions",
)
"""Fields added after the first artifacts were signed: left out of the signed bytes when None."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_KEY_ID_HEX = re.compile(rf"[0-9a-f]{{{KEY_ID_HEX_CHARS}}}")


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def hash_plan(plan: dict[str, Any]) -> str:
    """Return the SHA-256 hex digest of the plan's canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(_canonical_json(plan)).hexdigest()


def _utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _name(info: ValidationInfo) -> str:
    return info.field_name or "value"  # pydantic always sets it for field validators


def _require(condition: bool, name: str, constraint: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{name} must {constraint}, got {value!r}.")


def _json_object(name: str, value: dict[str, Any]) -> dict[str, Any]:
    """Return ``value`` as plain JSON (tuples become lists); refuse what JSON cannot hold."""
    try:
        normalized: dict[str, Any] = json.loads(_canonical_json(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{name} must hold only JSON values (str keys, finite numbers), got {value!r} ({exc})."
        ) from exc
    return normalized


class ReleaseDescription(BaseModel):
    """What a release is and what it cost in privacy, as known by the code that made it.

    Attributes:
        protocol_version: ``protocol.PROTOCOL_VERSION`` of the run that made the release.
        release_id: Unique name of the release (e.g. the run id plus the task).
        created: ISO-8601 time with a UTC offset (``...Z`` or ``+00:00``); defaults to now.
        model_fingerprint: The model's ``fingerprint_model_dir`` value.
        task: The task the vector encodes.
        plan: The release plan, as JSON.
        epsilon: Total privacy loss of the release; finite and > 0.
        delta: Failure probability of the guarantee; in (0, 1).
        accountant: Which accountant computed ``(epsilon, delta)``: "rdp", "pld", "analytic"...
        accountant_parameters: Its inputs, e.g. noise_multiplier, picks, epsilon_per_pick.
        num_chunks: Number of disjoint chunks ``m`` the private examples were split into.
        shots: In-context examples per chunk ``K``.
        clip_norm: L2 bound C on each chunk's contribution; sets the Gaussian sensitivity.
        noise_std: Standard deviation sigma of the Gaussian noise added to the released sum.
        model_dtype: The dtype the activations were extracted in (``"float32"``,
            ``"bfloat16"``, ``"float16"``), or None when the release did not record it
            (artifacts made before the field existed). A bfloat16 vector is rounded to 8 bits
            of mantissa; a site may refuse to apply a vector made in another dtype.
        max_image_crops: The plan's cap on crops an image (taken from
            ``plan["max_image_crops"]`` when not given), or None for the processor as shipped
            (also every artifact made before the field existed). Queries must be prompted
            under the same cap as the chunks were.
        prompt_template_sha256: SHA-256 hex of the chat template every prompt of the release
            was rendered with (the sites agreed on it), or None in artifacts made before the
            field existed. The fingerprint covers a template shipped with the model, not one
            a dpmtv adapter or plugin supplies; a site refuses an artifact of another digest.
        instruction_sha256: SHA-256 hex of the task instruction every prompt of the release
            carried (the sites agreed on it; no instruction is the digest of the empty
            string, ``client.models.instruction_digest``), or None in artifacts made before
            the field existed. The instruction lives in each site's data, outside the
            fingerprint; a site refuses an artifact of another digest, and inference one whose
            digest is not that of the instruction its queries carry.
        dpmtv_versions: The distinct dpmtv versions the contributing sites ran, sorted, or
            None in artifacts made before the field existed. Recorded, never refused.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    protocol_version: str
    release_id: str
    created: str = Field(default_factory=_utc_now_iso)
    model_fingerprint: str
    task: str
    plan: dict[str, Any]
    epsilon: float
    delta: float
    accountant: str
    accountant_parameters: dict[str, Any]
    num_chunks: int
    shots: int
    clip_norm: float
    noise_std: float
    model_dtype: str | None = None
    max_image_crops: int | None = None
    prompt_template_sha256: str | None = None
    instruction_sha256: str | None = None
    dpmtv_versions: list[str] | None = None

    @field_validator("prompt_template_sha256", "instruction_sha256")
    @classmethod
    def _prompt_digest(cls, value: str | None, info: ValidationInfo) -> str | None:
        valid = value is None or _SHA256_HEX.fullmatch(value) is not None
        _require(valid, _name(info), "be 64 lowercase hex digits or None", value)
        return value

    @field_validator("dpmtv_versions")
    @classmethod
    def _versions(cls, value: list[str] | None) -> list[str] | None:
        valid = value is None or (
            bool(value) and all(v.strip() for v in value) and value == sorted(set(value))
        )
        _require(valid, "dpmtv_versions", "be distinct non-empty strings, sorted, or None", value)
        return value

    @field_validator("model_dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        known = value is None or value in _MODEL_DTYPES
        _require(known, "model_dtype", f"be one of {list(_MODEL_DTYPES)} or None", value)
        return value

    @field_validator("protocol_version", "release_id", "model_fingerprint", "task", "accountant")
    @classmethod
    def _non_empty(cls, value: str, info: ValidationInfo) -> str:
        _require(bool(value.strip()), _name(info), "be a non-empty string", value)
        return value

    @field_validator("created")
    @classmethod
    def _utc_timestamp(cls, value: str) -> str:
        try:
            offset = datetime.fromisoformat(value).utcoffset()
        except ValueError:
            offset = None
        _require(offset is not None and not offset, "created", "be ISO-8601 in UTC", value)
        return value

    @field_validator("plan", "accountant_parameters")
    @classmethod
    def _plain_json(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return _json_object(_name(info), value)

    @field_validator("epsilon", "clip_norm", "noise_std")
    @classmethod
    def _finite_positive(cls, value: float, info: ValidationInfo) -> float:
        _require(math.isfinite(value) and value > 0, _name(info), "be finite and > 0", value)
        return value

    @field_validator("delta")
    @classmethod
    def _probability(cls, value: float) -> float:
        _require(0.0 < value < 1.0, "delta", "lie in (0, 1)", value)
        return value

    @field_validator("num_chunks", "shots")
    @classmethod
    def _at_least_one(cls, value: int, info: ValidationInfo) -> int:
        _require(value >= 1, _name(info), "be >= 1", value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _crop_cap_from_plan(cls, data: Any) -> Any:
        # The releasing code states the plan; the cap it fixed is read from there, once.
        if isinstance(data, dict) and "max_image_crops" not in data:
            plan = data.get("plan")
            if isinstance(plan, dict):
                return {**data, "max_image_crops": plan.get("max_image_crops")}
        return data

    @model_validator(mode="after")
    def _crop_cap_is_the_plans(self) -> ReleaseDescription:
        # One value, stated twice (plan and field): they must never disagree, or a site
        # would prompt queries under another cap than the chunks were prompted under.
        planned = self.plan.get("max_image_crops")
        _require(
            self.max_image_crops == planned,
            "max_image_crops",
            f"equal the plan's max_image_crops {planned!r}",
            self.max_image_crops,
        )
        return self


class ArtifactManifest(ReleaseDescription):
    """The signed description of a task-vector artifact (``manifest.json``).

    Attributes:
        format_version: Layout version of the artifact; only 1 exists.
        plan_hash: :func:`hash_plan` of ``plan``.
        num_heads: Rows of the ``heads`` and ``values`` tensors.
        d_head: Columns of ``values``: the width of one attention head.
        num_layers_in_scope: Distinct layers among the heads (``L_scope``).
        tensors_sha256: SHA-256 hex of the whole ``tensors.safetensors`` file.
        signing_key_id: ``key_id`` of the Ed25519 key that signed the manifest.
    """

    format_version: int
    plan_hash: str
    num_heads: int
    d_head: int
    num_layers_in_scope: int
    tensors_sha256: str
    signing_key_id: str

    @field_validator("format_version")
    @classmethod
    def _known_format(cls, value: int) -> int:
        _require(value == FORMAT_VERSION, "format_version", f"be {FORMAT_VERSION}", value)
        return value

    @field_validator("plan_hash", "tensors_sha256")
    @classmethod
    def _sha256_hex(cls, value: str, info: ValidationInfo) -> str:
        _require(bool(_SHA256_HEX.fullmatch(value)), _name(info), "be 64 hex digits", value)
        return value

    @field_validator("signing_key_id")
    @classmethod
    def _key_id(cls, value: str) -> str:
        constraint = f"be {KEY_ID_HEX_CHARS} lowercase hex digits"
        _require(bool(_KEY_ID_HEX.fullmatch(value)), "signing_key_id", constraint, value)
        return value

    @field_validator("num_heads", "d_head", "num_layers_in_scope")
    @classmethod
    def _positive_size(cls, value: int, info: ValidationInfo) -> int:
        _require(value >= 1, _name(info), "be >= 1", value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ArtifactManifest:
        _require(
            self.num_layers_in_scope <= self.num_heads,
            "num_layers_in_scope",
            f"be <= num_heads={self.num_heads}",
            self.num_layers_in_scope,
        )
        expected = hash_plan(self.plan)
        _require(self.plan_hash == expected, "plan_hash", f"equal {expected!r}", self.plan_hash)
        return self


def manifest_to_canonical_bytes(manifest: ArtifactManifest) -> bytes:
    """Return the bytes the signature covers: the manifest as canonical, ASCII JSON.

    An unset optional field (``model_dtype``, ``max_image_crops``, ``prompt_template_sha256``,
    ``instruction_sha256``, ``dpmtv_versions``) is left out, so artifacts signed before the
    field existed still verify (their signed bytes never held the key).
    """
    document = manifest.model_dump(mode="json")
    for optional in _OPTIONAL_FIELDS:
        if document.get(optional) is None:
            document.pop(optional, None)
    return _canonical_json(document)

"""The release plan: what one run releases, under which privacy parameters.

The coordinator broadcasts the plan in the ``plan`` stage; each site checks it against its
model, data and ledger before accepting. Both ledgers record :func:`plan_hash`, so the plan
must be canonical: head lists are sorted and unique, and every field is explicit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    model_serializer,
    model_validator,
)

from dpmtv_common.aliases import LayerHead
from dpmtv_common.artifact import hash_plan
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

__all__ = [
    "MAX_EPSILON",
    "MAX_HEADS",
    "MAX_IMAGE_CROPS",
    "MAX_SHOTS",
    "MAX_TEXT_CHARS",
    "NeighbouringRelation",
    "NoiseMode",
    "PrivacyUnit",
    "ReleaseOrder",
    "ReleasePlan",
    "SelectionMode",
    "plan_hash",
]


MAX_TEXT_CHARS = 200
"""Longest task name or model fingerprint a plan may carry (a plan is hashed and logged)."""
MAX_EPSILON = 100.0
"""Largest ε a plan may state: beyond it the guarantee is void and calibration only burns memory."""
MAX_SHOTS = 256
"""Largest K: far beyond any context window a site's model has."""
MAX_HEADS = 65_536
"""Largest head count a plan may name (k, r or a public list); sites check their own model."""
MAX_IMAGE_CROPS = 64
"""Largest crops-an-image cap a plan may state: more than any shipped processor makes (17)."""
_RELEASE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _name(info: ValidationInfo) -> str:
    return info.field_name or "value"


def _non_empty(value: str, info: ValidationInfo) -> str:
    if not value.strip():
        raise ValueError(f"{_name(info)} must be non-empty, got {value!r}.")
    return value


def _release_id(value: str, info: ValidationInfo) -> str:
    # A release id names files and ledger rows at every site: a plain token, never a path.
    if _RELEASE_ID.fullmatch(value) is None or ".." in value:
        raise ValueError(
            f"{_name(info)} must be 1-64 characters of letters, digits, '_', '.' or '-', "
            f"starting with a letter or digit and without '..', got {value[:80]!r}."
        )
    return value


def _bounded_text(value: str, info: ValidationInfo) -> str:
    if len(value) > MAX_TEXT_CHARS or not value.isprintable():
        raise ValueError(
            f"{_name(info)} must be at most {MAX_TEXT_CHARS} printable characters, "
            f"got {len(value)} characters starting {value[:40]!r}."
        )
    return value


def _at_most(bound: float) -> Callable[[Any, ValidationInfo], Any]:
    def check(value: Any, info: ValidationInfo) -> Any:
        if value > bound:
            raise ValueError(f"{_name(info)} must be at most {bound!r}, got {value!r}.")
        return value

    return check


def _positive_finite(value: float, info: ValidationInfo) -> float:
    # NaN fails every comparison, so test finiteness explicitly before the sign.
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{_name(info)} must be finite and > 0, got {value!r}.")
    return value


def _at_least_one(value: int, info: ValidationInfo) -> int:
    if value < 1:
        raise ValueError(f"{_name(info)} must be >= 1, got {value!r}.")
    return value


def _open_unit(value: float, info: ValidationInfo) -> float:
    if not 0 < value < 1:
        raise ValueError(f"{_name(info)} must lie strictly between 0 and 1, got {value!r}.")
    return value


def _canonical_heads(value: tuple[LayerHead, ...], info: ValidationInfo) -> tuple[LayerHead, ...]:
    # One canonical order lets both sides index activation rows without sending the
    # layout twice, and keeps plan_hash independent of how a list was typed in.
    if not value:
        raise ValueError(f"{_name(info)} must hold at least one head, got {value!r}.")
    if len(value) > MAX_HEADS:
        raise ValueError(f"{_name(info)} must hold at most {MAX_HEADS} heads, got {len(value)}.")
    try:
        HeadSet(value)
    except ConfigError as exc:
        raise ValueError(
            f"{_name(info)} must be sorted, unique (layer, head) pairs >= 0, got {value!r}; "
            "build it with HeadSet.of(...).heads."
        ) from exc
    return value


NonEmptyStr = Annotated[str, AfterValidator(_non_empty)]
"""A string with at least one non-space character."""
BoundedStr = Annotated[str, AfterValidator(_non_empty), AfterValidator(_bounded_text)]
"""A non-empty printable string of at most ``MAX_TEXT_CHARS`` characters."""
ReleaseId = Annotated[str, AfterValidator(_release_id)]
"""A plain token naming a release: safe as a file name, a ledger key and a log field."""
PositiveFloat = Annotated[float, AfterValidator(_positive_finite)]
"""A finite float > 0."""
PositiveInt = Annotated[int, AfterValidator(_at_least_one)]
"""An int >= 1."""
_OpenUnitFloat = Annotated[float, AfterValidator(_open_unit)]
HeadCount = Annotated[int, AfterValidator(_at_least_one), AfterValidator(_at_most(MAX_HEADS))]
"""An int in [1, MAX_HEADS]."""
HeadList = Annotated[tuple[LayerHead, ...], AfterValidator(_canonical_heads)]
"""A non-empty, sorted, duplicate-free tuple of ``(layer, head)`` pairs."""


def _sha256_hex(value: str, info: ValidationInfo) -> str:
    if re.fullmatch(r"[0-9a-f]{64}", value) is None:
        raise ValueError(f"{_name(info)} must be 64 lowercase hex digits, got {value[:80]!r}.")
    return value


def _version(value: str, info: ValidationInfo) -> str:
    if re.fullmatch(r"\d+\.\d+", value) is None:
        raise ValueError(f"{_name(info)} must be 'MAJOR.MINOR', got {value!r}.")
    return value


def _timestamp(value: str, info: ValidationInfo) -> str:
    # A naive timestamp means different instants at different sites; ledgers compare them.
    try:
        aware = datetime.fromisoformat(value).tzinfo is not None
    except ValueError:
        aware = False
    if not aware:
        raise ValueError(
            f"{_name(info)} must be an ISO-8601 timestamp with a UTC offset, got {value!r}; "
            "use datetime.now(UTC).isoformat()."
        )
    return value


class SelectionMode(StrEnum):
    """How the released heads are chosen."""

    PUBLIC = "public"
    """A head list computed on public data, fixed in the plan (no privacy cost)."""
    PRIVATE = "private"
    """Noisy top-k over secure-summed per-chunk votes (costs ``selection_share`` of epsilon)."""
    ALL = "all"
    """No selection: every head is released (baseline)."""


class ReleaseOrder(StrEnum):
    """Whether private selection runs before or after the activation release."""

    SELECT_FIRST = "select-first"
    RELEASE_FIRST = "release-first"

    @classmethod
    def default_for(cls, selection: SelectionMode) -> ReleaseOrder:
        """The order a release runs in when none is named: release-first for private selection.

        Release-first scores the private picks against the noisy vector itself (design §9).
        With public or all heads nothing is selected after the release: release-first would
        only spread the one Gaussian over every carried layer instead of the released heads'
        (sensitivity 2·C·√L over more layers, and C then bounds whole layers), a strictly
        noisier release of the same heads, so those select first.
        """
        return cls.RELEASE_FIRST if selection is SelectionMode.PRIVATE else cls.SELECT_FIRST

    @classmethod
    def named_or_default(cls, named: str | None, selection: SelectionMode) -> ReleaseOrder:
        """The order ``named`` (a wire spelling), or the selection's default when none is."""
        return cls(named) if named else cls.default_for(selection)


class NoiseMode(StrEnum):
    """Who adds the Gaussian noise to the secure sum."""

    CENTRAL = "central"
    """The coordinator adds one draw after the secure sum."""
    DISTRIBUTED = "distributed"
    """Each site adds a discrete-Gaussian share; the coordinator never sees a clean sum."""


class NeighbouringRelation(StrEnum):
    """Which datasets count as neighbours in the DP guarantee."""

    REPLACE_ONE = "replace-one"


class PrivacyUnit(StrEnum):
    """What one neighbouring change protects."""

    EXAMPLE = "example"
    GROUP = "group"


class ReleasePlan(BaseModel):
    """Everything the sites must agree on before any private data is touched.

    Attributes:
        protocol_version: The coordinator's ``PROTOCOL_VERSION``.
        release_id: Names this release in every message and in both ledgers.
        task: Name of the task the vector is for.
        model_fingerprint: Hash of the model's weights index and config; sites refuse others.
        epsilon: Total epsilon of the release (selection and activations together).
        delta: Total delta of the release.
        neighbouring: The neighbouring relation the guarantee holds under.
        privacy_unit: What the guarantee protects.
        shots: K, demonstrations per chunk (each chunk holds K + 1 examples).
        clip_norm: L2 bound C on each layer's in-scope head activations of one chunk;
            sets the Gaussian sensitivity.
        selection: How the released heads are chosen.
        order: Whether private selection runs before or after the release.
        num_selected_heads: k, heads to select (must equal ``len(public_heads)`` in
            public mode; ignored in mode all).
        public_heads: The fixed head list; set iff ``selection`` is public.
        candidate_heads: Private selection's candidate set, or ``None`` for every head the
            model carries. A list computed on public data (``select-heads --k 2k``), fixed in
            the plan before any private data is read: each chunk votes among these heads
            only and the Gumbel top-k runs over them, with the same sensitivities and ε₀ per
            pick (a public restriction of the domain), so the picks land on heads that
            public data already found useful. In release-first order the Gaussian covers
            these heads only (no other head can be released). Private selection only; at
            least ``num_selected_heads`` and ``score_top_r`` heads. Left out of the
            canonical JSON when ``None``, so plans without it hash as they did before.
        selection_share: Share of epsilon spent on private selection (private mode only).
        score_top_r: Each chunk votes for its top-r heads; bounds a chunk's vote to r.
        min_sites: Fewest surviving sites the release may go on with; fewer aborts it.
        noise_mode: Who adds the noise.
        min_honest: t, the honest shares each distributed noise share is sized for
            (σ_site² = σ²/t); at most ``min_sites``. Unused in central mode.
        max_sites: Most sites a secure sum may hold (sizes the distributed headroom);
            required in distributed mode.
        max_chunks_per_site: Cap on chunks one site contributes, or ``None`` for no cap
            (required in distributed mode: it bounds a site's sum on SecAgg+'s grid).
        max_image_crops: Most crops (sub-images) one image may be split into, at every
            site and at inference, or ``None`` for the processor as shipped; 1 = no
            splitting. Image splitting multiplies image tokens (a 28-pixel image became 17
            crops, 1,342 tokens, with SmolVLM's defaults), so sites that split differently
            would prompt differently; a site whose processor cannot meet the cap refuses
            the plan. Left out of the canonical JSON when ``None``, so plans without a cap
            hash as they did before the field existed.
        centre_sha256: Digest (``ActivationCentre.digest``) of the public centre a centred
            release subtracts from every chunk's activations before clipping and adds back to
            the noisy mean, or ``None`` for a plain release. The centre travels beside the
            plan and every site refuses one whose digest is not this; its values never change
            the sensitivity or the calibration (``dpmtv_common.centre``). Left out of the
            canonical JSON when ``None``, so plans without it hash as they did before.
        created: ISO-8601 timestamp with a UTC offset.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    protocol_version: Annotated[str, AfterValidator(_version)]
    release_id: ReleaseId
    task: BoundedStr
    model_fingerprint: BoundedStr
    epsilon: Annotated[
        float, AfterValidator(_positive_finite), AfterValidator(_at_most(MAX_EPSILON))
    ]
    delta: _OpenUnitFloat
    neighbouring: NeighbouringRelation = NeighbouringRelation.REPLACE_ONE
    privacy_unit: PrivacyUnit = PrivacyUnit.EXAMPLE
    shots: Annotated[int, AfterValidator(_at_least_one), AfterValidator(_at_most(MAX_SHOTS))]
    clip_norm: PositiveFloat
    selection: SelectionMode
    order: ReleaseOrder
    num_selected_heads: HeadCount
    public_heads: HeadList | None
    candidate_heads: HeadList | None = None
    selection_share: _OpenUnitFloat
    score_top_r: HeadCount
    min_sites: PositiveInt
    noise_mode: NoiseMode = NoiseMode.CENTRAL
    min_honest: PositiveInt = 2
    max_sites: PositiveInt | None = None
    max_chunks_per_site: PositiveInt | None
    max_image_crops: (
        Annotated[int, AfterValidator(_at_least_one), AfterValidator(_at_most(MAX_IMAGE_CROPS))]
        | None
    ) = None
    centre_sha256: Annotated[str, AfterValidator(_sha256_hex)] | None = None
    created: Annotated[str, AfterValidator(_timestamp)]

    @model_serializer(mode="wrap")
    def _omit_unset_crop_cap(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Plans (and ledgers, records and artifacts that hash them) made before the field
        # existed never held the key: an unset cap must serialise, and hash, as they did.
        document: dict[str, Any] = handler(self)
        for optional in ("max_image_crops", "candidate_heads", "centre_sha256"):
            if getattr(self, optional) is None:
                document.pop(optional, None)
        return document

    @model_validator(mode="after")
    def _check_distributed(self) -> Self:
        if self.noise_mode is not NoiseMode.DISTRIBUTED:
            return self
        if self.max_sites is None or self.max_chunks_per_site is None:
            raise ValueError(
                "max_sites and max_chunks_per_site must be set in distributed noise mode, got "
                f"{self.max_sites!r} and {self.max_chunks_per_site!r}: they size SecAgg+'s grid."
            )
        if not self.min_honest <= self.min_sites <= self.max_sites:
            raise ValueError(
                f"min_honest <= min_sites <= max_sites must hold in distributed mode, got "
                f"{self.min_honest}, {self.min_sites}, {self.max_sites}."
            )
        return self

    @model_validator(mode="after")
    def _check_candidate_heads(self) -> Self:
        if self.candidate_heads is None:
            return self
        if self.selection is not SelectionMode.PRIVATE:
            raise ValueError(
                f"candidate_heads must be None when selection is {self.selection.value!r}, "
                f"got {len(self.candidate_heads)} heads: only private selection picks among them."
            )
        if len(self.candidate_heads) < self.num_selected_heads:
            raise ValueError(
                f"candidate_heads must hold at least num_selected_heads = "
                f"{self.num_selected_heads} heads, got {len(self.candidate_heads)}."
            )
        if len(self.candidate_heads) < self.score_top_r:
            raise ValueError(
                f"candidate_heads must hold at least score_top_r = {self.score_top_r} heads "
                f"(a chunk votes among them), got {len(self.candidate_heads)}."
            )
        return self

    @model_validator(mode="after")
    def _check_public_heads(self) -> Self:
        public = self.selection is SelectionMode.PUBLIC
        if self.public_heads is None:
            if public:
                raise ValueError(
                    "public_heads must be set when selection is 'public', got None; "
                    "compute it with the select-heads command."
                )
            return self
        if not public:
            raise ValueError(
                f"public_heads must be None when selection is {self.selection.value!r}, "
                f"got {self.public_heads!r}."
            )
        if len(self.public_heads) != self.num_selected_heads:
            raise ValueError(
                f"num_selected_heads must equal len(public_heads) = "
                f"{len(self.public_heads)} in public mode, got {self.num_selected_heads!r}."
            )
        return self


def plan_hash(plan: ReleasePlan) -> str:
    """Return the SHA-256 hex digest of the plan's canonical JSON.

    Canonical means ``model_dump(mode="json")`` with sorted keys and compact separators,
    so the hash is the same on every site and across Python versions.
    """
    # One definition of the canonical form, shared with the artifact manifest that records it.
    return hash_plan(plan.model_dump(mode="json"))

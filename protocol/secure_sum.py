"""The secure-sum protocol both sides speak: its messages, its signed statements, its grid.

One release runs one key agreement and then one secure sum per stage that needs a total over
sites (1 with public or all heads, 2 with private selection). A site's messages, in order::

    plan      PlanRequest          -> PlanAccept + KeyAdvert   (X25519 key, nonce commitment)
    graph     SumKeysRequest       -> NonceReveal              (every advert; sparse graphs only)
    sum 0     SumSharesRequest     -> MaskedInput + boxes      (every nonce; sealed shares out)
              SurvivorsRequest     -> SurvivorsSigned          (the boxes addressed to the site)
              UnmaskRequest        -> UnmaskReply              (all survivors' signatures)
    sum j>0   SumCollectRequest    -> MaskedInput
              SurvivorsRequest     -> SurvivorsSigned
              UnmaskRequest        -> UnmaskReply

Who masks with whom is a graph (``protocol.sum_graph``): complete up to 10 sites, else a
random regular graph drawn from every participant's nonce, each committed to in its signed
advertisement and revealed (``graph`` round) only after the site has seen every
advertisement; the site reveals once a release, and only for the advertisements it checked.
A complete graph needs no randomness and skips that round.

A site masks its quantised vector x (length d, in [0, Q) per coordinate) as
``x + PRG(b_j) + sum over neighbours k of ±PRG(s_ik,j)  (mod M)``: ``b_j`` is a fresh
self-mask seed per sum, Shamir-shared with its neighbours (any t rebuild it); ``s_ik,j`` is
derived from the pair's X25519 secret for sum j only (``dpmtv_common.crypto.key_agreement``).
For sum j the coordinator names the survivors U (whose masked input arrived); every survivor
signs U with its roster identity, and a site reveals anything only once *every* member of U
has signed the same U (Bell et al. 2020's consistency check, made all-signers) and U holds a
majority of the sum's participants, so two different survivor sets of one sum cannot both be
fully signed: one U a sum, across the whole graph. It then reveals its shares of ``b_j`` of
the survivors among its neighbours, and its own pair seeds with its neighbours that were in
sum j but are not in U (they sent nothing; their pair masks in the survivors' inputs must
cancel). A site signs U only with r surviving neighbours (``GraphShape.required_neighbours``),
so whatever the coordinator can unmask with its input holds at least the plan's minimum of
honest inputs (the bound: ``protocol.sum_graph``).

This module is pure (pydantic, numpy, hashlib): the site's state machine is
``client.secure_sum``, the coordinator's ``server.secure_sum``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Literal, Self

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.errors import ConfigError, IntegrityError
from protocol.messages import SecureSumRequest, WireMessage
from protocol.plan import ReleaseId, ReleasePlan, SelectionMode
from protocol.sum_keys import (
    Box,
    Digest,
    KeyAdvert,
    NodeId,
    Secret,
    Signature,
    length_prefixed,
)

__all__ = [
    "MASKED_ARRAY_KEY",
    "REFERENCE_ARRAY_KEY",
    "SUM_MESSAGE_KINDS",
    "AnySumMessage",
    "MAX_QUANTIZATION_RANGE",
    "MAX_SUM_SITES",
    "AddressedBox",
    "MaskedInput",
    "NodeBytes",
    "NonceReveal",
    "SumCollectRequest",
    "SumInstructions",
    "SumKeysRequest",
    "SumRanges",
    "SumSharesRequest",
    "SurvivorsRequest",
    "SurvivorsSigned",
    "UnmaskReply",
    "UnmaskRequest",
    "dequantise",
    "key_transcript",
    "planned_sum_count",
    "quantise",
    "ranges_for",
    "survivors_signed_bytes",
]

MASKED_ARRAY_KEY = "dpmtv-masked"
"""Array record key of a site's masked vector (int64 in [0, M))."""
REFERENCE_ARRAY_KEY = "dpmtv-reference"
"""Array record key of the noisy vector a release-first select sum is scored against."""
MAX_QUANTIZATION_RANGE = 2**30
MAX_MODULUS_RANGE = 2**62  # masks are int64; two values below 2^62 add without overflow
MAX_SUM_SITES = 100_000
_TRANSCRIPT_DOMAIN = b"dpmtv/secure-sum/keys/v1/transcript"
_DOMAIN_SURVIVORS = b"dpmtv/secure-sum/survivors/v1"


NodeList = Annotated[list[NodeId], Field(min_length=1, max_length=MAX_SUM_SITES)]
SumIndex = Annotated[int, Field(ge=0, le=3)]


class _Model(WireMessage):
    """Frozen, strict, no unknown fields (as every message); bytes travel as base64."""


class SumRanges(_Model):
    """The integer grid of one sum: coordinates in ``[-c, c]`` map to ``[0, Q]``, added mod M.

    Exact up to rounding iff ``n * Q < M`` for n sites (:meth:`check_no_wrap`).
    """

    clipping_range: float = Field(gt=0, allow_inf_nan=False)
    quantization_range: int = Field(ge=2, le=MAX_QUANTIZATION_RANGE)
    modulus_range: int = Field(ge=4, le=MAX_MODULUS_RANGE)

    @model_validator(mode="after")
    def _check_powers(self) -> Self:
        for name in ("quantization_range", "modulus_range"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}.")
        if self.modulus_range <= self.quantization_range:
            raise ValueError(
                f"modulus_range must exceed quantization_range={self.quantization_range}, "
                f"got {self.modulus_range}."
            )
        return self

    def check_no_wrap(self, sites: int) -> None:
        """Refuse a grid on which ``sites`` inputs (each in ``0..Q``) could wrap around M.

        Raises:
            ConfigError: ``sites * Q >= M``.
        """
        if sites * self.quantization_range >= self.modulus_range:
            raise ConfigError(
                f"a sum of {sites} sites must fit the modulus: {sites} * Q < M, got "
                f"Q = {self.quantization_range}, M = {self.modulus_range}."
            )


class SumInstructions(_Model):
    """What one secure sum asks for: its index in the release, the request, the grid."""

    sum_index: SumIndex
    request: SecureSumRequest
    ranges: SumRanges


class AddressedBox(_Model):
    """A sealed box of Shamir shares, with the node at the other end (receiver or sender)."""

    node_id: NodeId
    box: Box


class NodeBytes(_Model):
    """Bytes about one node: a share of its self-mask seed, a pair seed, a signature."""

    node_id: NodeId
    value: Secret


class SumKeysRequest(_Model):
    """Coordinator to site: every key advertisement, before a sparse graph is drawn."""

    kind: Literal["sum-keys-request"] = "sum-keys-request"
    release_id: ReleaseId
    adverts: Annotated[list[KeyAdvert], Field(min_length=2, max_length=MAX_SUM_SITES)]


class NonceReveal(_Model):
    """Site to coordinator: the graph nonce its advertisement committed to (once a release)."""

    kind: Literal["nonce-reveal"] = "nonce-reveal"
    release_id: ReleaseId
    nonce: Digest


class SumSharesRequest(_Model):
    """Coordinator to site: every advertisement, every revealed nonce, the first sum's request.

    ``nonces`` is empty for a complete graph (nothing to draw), else one per advertisement.
    """

    kind: Literal["sum-shares-request"] = "sum-shares-request"
    release_id: ReleaseId
    adverts: Annotated[list[KeyAdvert], Field(min_length=2, max_length=MAX_SUM_SITES)]
    nonces: Annotated[list[NodeBytes], Field(max_length=MAX_SUM_SITES)]
    instructions: SumInstructions


class SumCollectRequest(_Model):
    """Coordinator to site: a later sum's instructions (its participants are the last U)."""

    kind: Literal["sum-collect-request"] = "sum-collect-request"
    release_id: ReleaseId
    instructions: SumInstructions


class MaskedInput(_Model):
    """Site to coordinator: its masked vector rides in the array record; sum 0 adds boxes."""

    kind: Literal["masked-input"] = "masked-input"
    release_id: ReleaseId
    sum_index: SumIndex
    boxes: Annotated[list[AddressedBox], Field(max_length=MAX_SUM_SITES)]


class SurvivorsRequest(_Model):
    """Coordinator to site: the survivors U of a sum; for sum 0, the boxes sent to the site."""

    kind: Literal["survivors-request"] = "survivors-request"
    release_id: ReleaseId
    sum_index: SumIndex
    survivors: NodeList
    boxes: Annotated[list[AddressedBox], Field(max_length=MAX_SUM_SITES)]


class SurvivorsSigned(_Model):
    """Site to coordinator: its roster signature over :func:`survivors_signed_bytes`."""

    kind: Literal["survivors-signed"] = "survivors-signed"
    release_id: ReleaseId
    sum_index: SumIndex
    signature: Signature


class UnmaskRequest(_Model):
    """Coordinator to site: U again, with one signature over it from every member of U."""

    kind: Literal["unmask-request"] = "unmask-request"
    release_id: ReleaseId
    sum_index: SumIndex
    survivors: NodeList
    signatures: Annotated[list[NodeBytes], Field(max_length=MAX_SUM_SITES)]


class UnmaskReply(_Model):
    """Site to coordinator: shares of survivors' self-mask seeds, pair seeds of the dropped."""

    kind: Literal["unmask-reply"] = "unmask-reply"
    release_id: ReleaseId
    sum_index: SumIndex
    seed_shares: Annotated[list[NodeBytes], Field(max_length=MAX_SUM_SITES)]
    pair_seeds: Annotated[list[NodeBytes], Field(max_length=MAX_SUM_SITES)]


AnySumMessage = Annotated[
    SumKeysRequest
    | NonceReveal
    | SumSharesRequest
    | SumCollectRequest
    | MaskedInput
    | SurvivorsRequest
    | SurvivorsSigned
    | UnmaskRequest
    | UnmaskReply,
    Field(discriminator="kind"),
]
"""Every top-level message of a secure sum, discriminated on ``kind``."""
SUM_MESSAGE_KINDS = frozenset(
    model.model_fields["kind"].default
    for model in (
        SumKeysRequest,
        NonceReveal,
        SumSharesRequest,
        SumCollectRequest,
        MaskedInput,
        SurvivorsRequest,
        SurvivorsSigned,
        UnmaskRequest,
        UnmaskReply,
    )
)


def survivors_signed_bytes(
    *, release_id: str, sum_index: int, transcript: bytes, survivors: Iterable[int]
) -> bytes:
    """The statement a survivor signs: sum j of this key agreement has exactly these survivors."""
    nodes = sorted(set(survivors))
    return length_prefixed(
        _DOMAIN_SURVIVORS,
        release_id.encode(),
        transcript,
        sum_index.to_bytes(1, "big"),
        b"".join(node.to_bytes(8, "big") for node in nodes),
    )


def key_transcript(adverts: Sequence[KeyAdvert]) -> bytes:
    """SHA-256 over every signed advertisement, sorted by node: fixes the ring and the sums."""
    digest = hashlib.sha256(_TRANSCRIPT_DOMAIN)
    for advert in sorted(adverts, key=lambda a: a.node_id):
        digest.update(length_prefixed(advert.signed_bytes(), advert.signature))
    return digest.digest()


def planned_sum_count(plan: ReleasePlan) -> int:
    """Secure sums the plan's release runs: votes and activations (private), else one."""
    return 2 if plan.selection is SelectionMode.PRIVATE else 1


def ranges_for(max_abs_coordinate: float, sites: int) -> SumRanges:
    """A grid whose clipping range holds ``max_abs_coordinate`` and whose sum cannot wrap.

    c is the next power of two >= the bound, M = 2^62 and Q the largest power of two <= 2^30
    with ``sites * Q < M``. A site's rounding moves a coordinate by at most c / Q.
    """
    if not (math.isfinite(max_abs_coordinate) and max_abs_coordinate > 0):
        raise ConfigError(f"max_abs_coordinate must be finite and > 0, got {max_abs_coordinate!r}.")
    if not isinstance(sites, int) or not 2 <= sites <= MAX_SUM_SITES:
        raise ConfigError(f"sites must be an int in [2, {MAX_SUM_SITES}], got {sites!r}.")
    mantissa, exponent = math.frexp(max_abs_coordinate)
    try:
        clipping = math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)
    except OverflowError as exc:
        raise ConfigError(
            f"max_abs_coordinate must be at most 2^1023, got {max_abs_coordinate!r}."
        ) from exc
    grid = MAX_QUANTIZATION_RANGE
    while sites * grid >= MAX_MODULUS_RANGE:
        grid //= 2
    return SumRanges(
        clipping_range=clipping, quantization_range=grid, modulus_range=MAX_MODULUS_RANGE
    )


def quantise(values: npt.ArrayLike, ranges: SumRanges) -> Int64Array:
    """Map each coordinate of ``[-c, c]`` to the nearest of Q + 1 grid points ``0..Q``.

    Rounding is to nearest (error <= c / Q per coordinate). Integer-valued inputs on a grid
    whose step is 1 (the distributed mode's, ``Q = 2c``) are mapped exactly.

    Raises:
        ConfigError: A coordinate is not finite or lies beyond ``±c``: refused, never
            clipped, since a silent clip would bias the sum and break the sensitivity bound.
    """
    flat = np.asarray(values, dtype=np.float64).ravel()
    bound = ranges.clipping_range
    if not np.isfinite(flat).all():
        raise ConfigError("a secure-sum input must be finite, got NaN or infinity.")
    if flat.size and float(np.abs(flat).max()) > bound:
        raise ConfigError(
            f"a secure-sum input must lie within ±c = {bound} per coordinate, got a coordinate "
            "beyond it. Clip before summing, or size the plan's range for the chunk count."
        )
    scaled = np.rint((flat + bound) * (ranges.quantization_range / (2.0 * bound)))
    return np.clip(scaled, 0, ranges.quantization_range).astype(np.int64)


def dequantise(total: Int64Array, ranges: SumRanges, sites: int) -> Float64Array:
    """The real-valued sum of ``sites`` quantised inputs from their integer sum.

    Raises:
        IntegrityError: A coordinate exceeds ``sites * Q``: the unmasking went wrong.
    """
    values = np.asarray(total, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() > sites * ranges.quantization_range):
        raise IntegrityError(
            f"an unmasked sum of {sites} sites must lie in [0, {sites} * Q], got a coordinate "
            "outside it: a site's mask did not cancel."
        )
    step = 2.0 * ranges.clipping_range / ranges.quantization_range
    return values.astype(np.float64) * step - sites * ranges.clipping_range

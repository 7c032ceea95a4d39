"""A site's signed key for one release's secure sums (rides on its plan acceptance).

The advertisement also commits to the site's graph nonce (:func:`nonce_commitment`): the
nonce is revealed only once every advertisement is fixed, and the neighbourhood graph is
drawn from all of them (``protocol.sum_graph``), so no party can choose it. Split from
:mod:`protocol.secure_sum` so that :class:`~protocol.messages.PlanAccept` can carry it.
Bytes travel as base64 text in the messages' JSON.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

from dpmtv_common.roster import MEMBER_NAME_PATTERN
from protocol.plan import ReleaseId

__all__ = [
    "NONCE_BYTES",
    "Box",
    "Digest",
    "KeyAdvert",
    "MemberName",
    "NodeId",
    "PublicKey",
    "Secret",
    "Sha256Hex",
    "Signature",
    "advert_signed_bytes",
    "length_prefixed",
    "nonce_commitment",
]

_DOMAIN_KEYS = b"dpmtv/secure-sum/keys/v2"
_DOMAIN_NONCE = b"dpmtv/secure-sum/graph-nonce/v1"
NONCE_BYTES = 32
"""Bytes of a site's graph nonce (fresh from the OS CSPRNG, one a release)."""
_MAX_BOX_BYTES = 4096
_MAX_SECRET_BYTES = 1024


def _b64_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise ValueError(f"bytes must travel as base64 text, got {type(value).__name__}.")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"bytes must be base64, got {value[:40]!r}.") from exc


def _fixed(size: int) -> PlainValidator:
    def check(value: object) -> bytes:
        raw = _b64_bytes(value)
        if len(raw) != size:
            raise ValueError(f"must be {size} bytes, got {len(raw)}.")
        return raw

    return PlainValidator(check)


def _bounded(limit: int) -> PlainValidator:
    def check(value: object) -> bytes:
        raw = _b64_bytes(value)
        if not 0 < len(raw) <= limit:
            raise ValueError(f"must hold 1..{limit} bytes, got {len(raw)}.")
        return raw

    return PlainValidator(check)


_AS_BASE64 = PlainSerializer(lambda raw: base64.b64encode(raw).decode("ascii"), return_type=str)
PublicKey = Annotated[bytes, _fixed(32), _AS_BASE64]
Signature = Annotated[bytes, _fixed(64), _AS_BASE64]
Digest = Annotated[bytes, _fixed(32), _AS_BASE64]
Box = Annotated[bytes, _bounded(_MAX_BOX_BYTES), _AS_BASE64]
Secret = Annotated[bytes, _bounded(_MAX_SECRET_BYTES), _AS_BASE64]
NodeId = Annotated[int, Field(ge=0, lt=2**64)]
MemberName = Annotated[str, Field(pattern=MEMBER_NAME_PATTERN)]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class KeyAdvert(BaseModel):
    """A site's public key and graph-nonce commitment for one release, roster-signed."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    member: MemberName
    node_id: NodeId
    release_id: ReleaseId
    roster_sha256: Sha256Hex
    public_key: PublicKey
    nonce_commitment: Digest
    signature: Signature

    def signed_bytes(self) -> bytes:
        """What :attr:`signature` signs (:func:`advert_signed_bytes` of the other fields)."""
        return advert_signed_bytes(
            member=self.member,
            node_id=self.node_id,
            release_id=self.release_id,
            roster_sha256=self.roster_sha256,
            public_key=self.public_key,
            nonce_commitment=self.nonce_commitment,
        )


def advert_signed_bytes(
    *,
    member: str,
    node_id: int,
    release_id: str,
    roster_sha256: str,
    public_key: bytes,
    nonce_commitment: bytes,
) -> bytes:
    """The statement an advertisement signs: this member, as this node, uses this key and nonce."""
    return length_prefixed(
        _DOMAIN_KEYS,
        release_id.encode(),
        roster_sha256.encode(),
        member.encode(),
        node_id.to_bytes(8, "big"),
        public_key,
        nonce_commitment,
    )


def nonce_commitment(*, release_id: str, member: str, node_id: int, nonce: bytes) -> bytes:
    """SHA-256 binding a graph nonce to this release, member and node (hiding and binding)."""
    statement = length_prefixed(
        _DOMAIN_NONCE, release_id.encode(), member.encode(), node_id.to_bytes(8, "big"), nonce
    )
    return hashlib.sha256(statement).digest()


def length_prefixed(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two different part lists share an encoding."""
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)

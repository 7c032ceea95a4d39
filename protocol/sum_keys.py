"""A site's signed key for one release's secure sums (rides on its plan acceptance).

Split from :mod:`protocol.secure_sum` so that :class:`~protocol.messages.PlanAccept` can
carry it. Bytes travel as base64 text in the messages' JSON.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

from dpmtv_common.roster import MEMBER_NAME_PATTERN
from protocol.plan import ReleaseId

__all__ = [
    "Box",
    "KeyAdvert",
    "MemberName",
    "NodeId",
    "PublicKey",
    "Secret",
    "Sha256Hex",
    "Signature",
    "advert_signed_bytes",
    "length_prefixed",
]

_DOMAIN_KEYS = b"dpmtv/secure-sum/keys/v1"
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
Box = Annotated[bytes, _bounded(_MAX_BOX_BYTES), _AS_BASE64]
Secret = Annotated[bytes, _bounded(_MAX_SECRET_BYTES), _AS_BASE64]
NodeId = Annotated[int, Field(ge=0, lt=2**64)]
MemberName = Annotated[str, Field(pattern=MEMBER_NAME_PATTERN)]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class KeyAdvert(BaseModel):
    """A site's public key for one release, signed with its roster identity key."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    member: MemberName
    node_id: NodeId
    release_id: ReleaseId
    roster_sha256: Sha256Hex
    public_key: PublicKey
    signature: Signature

    def signed_bytes(self) -> bytes:
        """What :attr:`signature` signs (:func:`advert_signed_bytes` of the other fields)."""
        return advert_signed_bytes(
            member=self.member,
            node_id=self.node_id,
            release_id=self.release_id,
            roster_sha256=self.roster_sha256,
            public_key=self.public_key,
        )


def advert_signed_bytes(
    *, member: str, node_id: int, release_id: str, roster_sha256: str, public_key: bytes
) -> bytes:
    """The statement a key advertisement signs: this member, as this node, uses this key."""
    return length_prefixed(
        _DOMAIN_KEYS,
        release_id.encode(),
        roster_sha256.encode(),
        member.encode(),
        node_id.to_bytes(8, "big"),
        public_key,
    )


def length_prefixed(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two different part lists share an encoding."""
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)

"""One X25519 key agreement per release, and every secret of its secure sums derived from it.

A site makes one X25519 key pair per release and signs its public half with its roster
identity (``protocol.secure_sum``). Every pair of neighbours then shares one Diffie-Hellman
secret, from which HKDF-SHA256 derives, with a label naming the purpose:

* :func:`pair_mask_seed` — the seed of the pairwise mask of *one* secure sum (the release, the
  sum's index and both node ids are in the HKDF info). Revealing one sum's seed (to cancel a
  neighbour that dropped out of that sum) reveals nothing of another sum's seed: HKDF is a
  PRF in its info.
* :func:`share_box_key` — the key that seals the Shamir shares one site sends another
  (ChaCha20-Poly1305 with a random nonce, the release and both node ids as associated data,
  so a box cannot be replayed to another receiver, from another sender or in another release).

The private key never leaves the site and is never secret-shared (SecAgg+ as Bell et al. 2020
write it shares it, so that the coordinator can recompute a dropped site's masks; here the
surviving neighbours reveal the per-sum pair seeds instead, which keeps one key pair good for
every sum of a release). Primitives come from ``cryptography``; the tests pin them with
known-answer vectors (RFC 7748, RFC 5869, RFC 8439).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpmtv_common.errors import ConfigError, IntegrityError

__all__ = [
    "PUBLIC_KEY_BYTES",
    "SEED_BYTES",
    "AgreementKey",
    "open_box",
    "pair_mask_seed",
    "seal_box",
    "share_box_key",
]

PUBLIC_KEY_BYTES = 32
"""Bytes of a raw X25519 public key."""
SEED_BYTES = 32
"""Bytes of every derived seed and key."""

_NONCE_BYTES = 12
_SALT = b"dpmtv/secure-sum/v1"
_MASK_LABEL = b"pair-mask"
_BOX_LABEL = b"share-box"


@dataclass(frozen=True, eq=False)
class AgreementKey:
    """A site's X25519 key pair for one release (memory only, never written or shared)."""

    private_key: X25519PrivateKey

    @classmethod
    def generate(cls) -> AgreementKey:
        """A fresh key pair from the operating system's CSPRNG."""
        return cls(X25519PrivateKey.generate())

    @property
    def public_bytes(self) -> bytes:
        """The raw 32-byte public key, as neighbours receive it."""
        return self.private_key.public_key().public_bytes_raw()

    def shared_secret(self, peer_public: bytes) -> bytes:
        """The raw X25519 secret shared with the holder of ``peer_public``.

        Raises:
            IntegrityError: ``peer_public`` is not 32 bytes, or is a low-order point (the
                secret would be all zeros, known to anyone).
        """
        if not isinstance(peer_public, bytes) or len(peer_public) != PUBLIC_KEY_BYTES:
            size = len(peer_public) if isinstance(peer_public, bytes) else peer_public
            raise IntegrityError(f"an X25519 public key must be 32 bytes, got {size!r}.")
        try:
            return self.private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError as exc:  # cryptography refuses an all-zero result
            raise IntegrityError(f"an X25519 public key must not be low-order: {exc}") from exc


def pair_mask_seed(
    shared: bytes, *, release_id: str, sum_index: int, nodes: tuple[int, int]
) -> bytes:
    """The seed of the pairwise mask two neighbours add (one +, one -) in one secure sum.

    ``nodes`` may come in either order: both neighbours derive the same seed.
    """
    low, high = sorted(nodes)
    info = _info(_MASK_LABEL, release_id, sum_index, low, high)
    return _hkdf(shared, info)


def share_box_key(shared: bytes, *, release_id: str) -> bytes:
    """The key that seals the shares two neighbours send each other in one release."""
    return _hkdf(shared, _info(_BOX_LABEL, release_id))


def seal_box(key: bytes, plaintext: bytes, *, associated: bytes) -> bytes:
    """Encrypt and authenticate ``plaintext``: a random 12-byte nonce, then the ciphertext."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_box(key: bytes, box: bytes, *, associated: bytes) -> bytes:
    """Decrypt a box sealed by :func:`seal_box` under the same key and associated data.

    Raises:
        IntegrityError: The box is too short, forged, altered, or sealed for other
            associated data (another sender, receiver or release).
    """
    if not isinstance(box, bytes) or len(box) < _NONCE_BYTES + 16:
        raise IntegrityError("a sealed share box must hold a nonce and a tag, got fewer bytes.")
    try:
        return ChaCha20Poly1305(key).decrypt(box[:_NONCE_BYTES], box[_NONCE_BYTES:], associated)
    except InvalidTag as exc:
        raise IntegrityError("a sealed share box must authenticate, got a forged box.") from exc


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=_SALT, info=info).derive(secret)


def _info(label: bytes, release_id: str, *numbers: int) -> bytes:
    """Length-prefixed fields, so no two different field lists share an encoding."""
    if not isinstance(release_id, str) or not release_id:
        raise ConfigError(f"release_id must be a non-empty str, got {release_id!r}.")
    fields = [label, release_id.encode()]
    for number in numbers:
        if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 2**64:
            raise ConfigError(f"a derivation index must be an int in [0, 2^64), got {number!r}.")
        fields.append(number.to_bytes(8, "big"))
    return b"".join(len(field).to_bytes(4, "big") + field for field in fields)

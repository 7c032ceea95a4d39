"""Ed25519 signing keys, verify keys and the set of keys a reader trusts.

File formats:

- private key: PEM, PKCS#8, unencrypted, written with mode ``0600``. Protect it with file
  permissions or a secrets mount; an encrypted PEM would need a passphrase in config.
- public key: PEM, SubjectPublicKeyInfo (``-----BEGIN PUBLIC KEY-----``), readable by
  ``openssl pkey -pubin``.

A key is named by its ``key_id``: the first 16 hex characters (64 bits) of the SHA-256 of
the raw 32-byte public key. The id only selects a key; security rests on the signature.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dpmtv_common.errors import BadSignatureError, ConfigError, UnknownSigningKeyError
from dpmtv_common.files import write_atomic

__all__ = [
    "KEY_ID_HEX_CHARS",
    "SigningKey",
    "TrustedKeys",
    "VerifyKey",
]

KEY_ID_HEX_CHARS = 16
"""Length of a ``key_id`` in hex characters."""

_PRIVATE_KEY_MODE = 0o600


def _read_key_file(path: Path, *, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} file must be readable, got {str(path)!r}: {exc}.") from exc


def _write_file_atomic(path: Path, data: bytes, *, mode: int, overwrite: bool) -> None:
    """Write ``data`` to ``path`` via a same-directory temporary file and a rename.

    The temporary file is created with ``mode`` from the start, so a private key is never
    readable by others, not even for a moment.
    """
    if path.exists() and not overwrite:
        raise ConfigError(
            f"key file must not exist yet, got {str(path)!r}. Pass overwrite=True to replace it."
        )
    write_atomic(path, data, mode=mode)


@dataclass(frozen=True, eq=False)
class VerifyKey:
    """An Ed25519 public key that checks signatures."""

    public_key: Ed25519PublicKey
    key_id: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(self.raw_bytes).hexdigest()
        object.__setattr__(self, "key_id", digest[:KEY_ID_HEX_CHARS])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerifyKey) and other.raw_bytes == self.raw_bytes

    def __hash__(self) -> int:
        return hash(self.raw_bytes)

    @property
    def raw_bytes(self) -> bytes:
        """The 32-byte raw public key."""
        return self.public_key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def from_raw(cls, raw: bytes) -> VerifyKey:
        """Build a key from its 32 raw bytes."""
        if len(raw) != 32:
            raise ConfigError(f"raw Ed25519 public key must be 32 bytes, got {len(raw)!r}.")
        return cls(Ed25519PublicKey.from_public_bytes(raw))

    @classmethod
    def from_pem(cls, pem: bytes, *, source: str = "public key") -> VerifyKey:
        """Parse a PEM SubjectPublicKeyInfo block holding an Ed25519 key.

        Args:
            pem: The PEM bytes.
            source: Where the bytes came from, for error messages.
        """
        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError as exc:
            raise ConfigError(
                f"{source} must be a PEM public key block, got unparsable bytes ({exc})."
            ) from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{source} must be an Ed25519 key, got {type(key).__name__!r}.")
        return cls(key)

    def to_pem(self) -> bytes:
        """Serialize as PEM SubjectPublicKeyInfo."""
        return self.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> VerifyKey:
        """Read a public key written by :meth:`save`."""
        path = Path(path)
        pem = _read_key_file(path, what="public key")
        return cls.from_pem(pem, source=f"public key file {str(path)!r}")

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the public key as PEM (mode 0644: it is not secret)."""
        path = Path(path)
        _write_file_atomic(path, self.to_pem(), mode=0o644, overwrite=overwrite)
        return path

    def verify(self, data: bytes, signature: bytes) -> None:
        """Check that ``signature`` is this key's signature over ``data``.

        Raises:
            BadSignatureError: The signature does not verify (wrong bytes, key or length).
        """
        try:
            self.public_key.verify(signature, data)
        except InvalidSignature as exc:
            raise BadSignatureError(
                f"signature must verify under key {self.key_id!r}, got a {len(signature)}-byte "
                "signature that does not match the signed bytes."
            ) from exc


@dataclass(frozen=True, eq=False)
class SigningKey:
    """An Ed25519 private key that signs bytes."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> SigningKey:
        """Make a fresh key from the operating system's CSPRNG."""
        return cls(Ed25519PrivateKey.generate())

    @property
    def verify_key(self) -> VerifyKey:
        """The matching public key."""
        return VerifyKey(self.private_key.public_key())

    @property
    def key_id(self) -> str:
        """The ``key_id`` of the matching public key."""
        return self.verify_key.key_id

    def sign(self, data: bytes) -> bytes:
        """Return the 64-byte Ed25519 signature over ``data``."""
        return self.private_key.sign(data)

    @classmethod
    def from_pem(cls, pem: bytes, *, source: str = "private key") -> SigningKey:
        """Parse an unencrypted PEM PKCS#8 Ed25519 private key.

        Args:
            pem: The PEM bytes.
            source: Where the bytes came from, for error messages (never the key itself).
        """
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            # The exception text never holds key material, so it is safe to repeat.
            raise ConfigError(
                f"{source} must be an unencrypted PEM PKCS#8 block, got unparsable bytes ({exc})."
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{source} must be an Ed25519 key, got {type(key).__name__!r}.")
        return cls(key)

    def to_pem(self) -> bytes:
        """Serialize as unencrypted PEM PKCS#8."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        """Read a private key written by :meth:`save`."""
        path = Path(path)
        pem = _read_key_file(path, what="private key")
        return cls.from_pem(pem, source=f"private key file {str(path)!r}")

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the private key as PEM PKCS#8 with mode 0600."""
        path = Path(path)
        _write_file_atomic(path, self.to_pem(), mode=_PRIVATE_KEY_MODE, overwrite=overwrite)
        return path


class TrustedKeys:
    """The public keys whose signatures a reader accepts, looked up by ``key_id``."""

    def __init__(self, keys: Iterable[VerifyKey] = ()) -> None:
        self._keys: dict[str, VerifyKey] = {}
        for key in keys:
            known = self._keys.setdefault(key.key_id, key)
            if known != key:
                # Two different keys with one 64-bit id: never expected, so refuse to guess.
                raise ConfigError(f"key ids must be unique, got two keys with id {key.key_id!r}.")

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike[str]]) -> TrustedKeys:
        """Load each PEM public-key file in ``paths``."""
        return cls(VerifyKey.load(path) for path in paths)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The known key ids, sorted."""
        return tuple(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def get(self, key_id: str) -> VerifyKey:
        """Return the key with ``key_id``.

        Raises:
            UnknownSigningKeyError: No trusted key has that id.
        """
        try:
            return self._keys[key_id]
        except KeyError:
            known = ", ".join(self.key_ids) or "(none)"
            raise UnknownSigningKeyError(
                f"signing key id must be one of the trusted keys [{known}], got {key_id!r}. "
                "Add the signer's public key file to the trusted keys if you trust it."
            ) from None

    def __repr__(self) -> str:
        return f"TrustedKeys(key_ids={self.key_ids!r})"

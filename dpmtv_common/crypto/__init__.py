"""Cryptographic building blocks: Ed25519 signing keys and the trusted-key set."""

from __future__ import annotations

from dpmtv_common.crypto.signing import KEY_ID_HEX_CHARS, SigningKey, TrustedKeys, VerifyKey

__all__ = [
    "KEY_ID_HEX_CHARS",
    "SigningKey",
    "TrustedKeys",
    "VerifyKey",
]

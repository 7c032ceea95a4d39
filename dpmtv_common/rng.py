"""Randomness that is not DP noise: seeded generators, and a secret keyed permutation stream.

DP noise never comes from here: it comes from :mod:`dpmtv_common.privacy.noise`.

* :func:`make_rng` — a seeded PCG64 for data generation, benchmarks and tests: nothing whose
  secrecy or uniformity a privacy argument rests on.
* :class:`KeyStream` — ChaCha20 keyed by a 256-bit :func:`secret_seed`, for a site's chunk
  shuffle. The chunking argument (``client.activations.chunking``) needs a *uniform* permutation
  that only the site can reproduce: a 128-bit PCG64 seed cannot reach every order once n! > 2**128
  (n >= 35), and its output is predictable from a few draws. ChaCha20 from a 256-bit key is a
  cryptographic PRG, and :meth:`KeyStream.below` rejects instead of reducing modulo, so every
  integer, and with Fisher-Yates every permutation, is exactly equally likely given ideal bits.
  The same seed and label give the same stream, so a site recomputes the same chunks for each
  secure sum of one release; different labels give independent streams from one seed.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Final

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from dpmtv_common.errors import ConfigError

__all__ = ["SEED_BITS", "KeyStream", "make_rng", "secret_seed"]

SEED_BITS: Final = 256
"""Bits of a :func:`secret_seed`: ChaCha20's key size."""

_BUFFER_BYTES = 4096  # keystream drawn at a time; one ChaCha20 call per 64 blocks


def make_rng(seed: int) -> np.random.Generator:
    """A PCG64 generator for work whose randomness is not a privacy mechanism."""
    return np.random.default_rng(seed)


def secret_seed() -> int:
    """A 256-bit seed from the OS CSPRNG, for a site's secret chunk shuffle (a ChaCha20 key)."""
    return secrets.randbits(SEED_BITS)


class KeyStream:
    """The ChaCha20 keystream of ``(seed, label)``, read as unbiased integers.

    Args:
        seed: The 256-bit key, an integer in ``[0, 2**256)`` (:func:`secret_seed`).
        label: Separates independent streams drawn from one seed (e.g. one per chunk slot);
            hashed into the 96-bit nonce (the block counter starts at 0), so any bytes may be used.

    Raises:
        ConfigError: ``seed`` is not an integer in ``[0, 2**256)``.
    """

    def __init__(self, seed: int, label: bytes) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**SEED_BITS:
            raise ConfigError(f"seed must be an integer in [0, 2**{SEED_BITS}), got {seed!r}.")
        # cryptography's ChaCha20 takes a 16-byte block: a 32-bit little-endian block counter
        # then the 96-bit nonce. The counter starts at 0 so 2**32 blocks (256 GiB) are
        # available; the nonce is a hash of the label.
        nonce = bytes(4) + hashlib.sha256(b"dpmtv-keystream\x00" + label).digest()[:12]
        cipher = Cipher(algorithms.ChaCha20(seed.to_bytes(32, "big"), nonce), mode=None)
        self._encryptor = cipher.encryptor()
        self._buffer = b""
        self._offset = 0

    def read(self, size: int) -> bytes:
        """The next ``size`` keystream bytes."""
        if size < 0:
            raise ConfigError(f"size must be >= 0, got {size!r}.")
        while len(self._buffer) - self._offset < size:
            rest = self._buffer[self._offset :]
            self._buffer = rest + self._encryptor.update(bytes(max(_BUFFER_BYTES, size)))
            self._offset = 0
        out = self._buffer[self._offset : self._offset + size]
        self._offset += size
        return out

    def below(self, bound: int) -> int:
        """A uniform integer in ``[0, bound)``, by rejection (never modulo: no bias).

        Reads the fewest whole bytes that hold ``bound - 1``, masks to its bit length and
        redraws while the value is ``>= bound``: fewer than two draws on average.
        """
        if bound < 1:
            raise ConfigError(f"bound must be >= 1, got {bound!r}.")
        bits = (bound - 1).bit_length()
        if bits == 0:
            return 0
        mask = (1 << bits) - 1
        width = (bits + 7) // 8
        while True:
            value = int.from_bytes(self.read(width), "big") & mask
            if value < bound:
                return value

    def permutation(self, n: int) -> list[int]:
        """A uniform permutation of ``0..n-1`` (Fisher-Yates, Durstenfeld's in-place form)."""
        if n < 0:
            raise ConfigError(f"n must be >= 0, got {n!r}.")
        order = list(range(n))
        for i in range(n - 1, 0, -1):
            j = self.below(i + 1)
            order[i], order[j] = order[j], order[i]
        return order

"""Expand a secure-sum seed into uniform integer masks with ChaCha20.

The secure sum (SecAgg+ after Bell et al.: ``client.secure_sum`` at each site,
``server.secure_sum`` at the coordinator) hides each site's quantised vector under a
self-mask and pairwise masks, each expanded from a secret seed (a 32-byte self-mask seed, or
a 32-byte ECDH+HKDF shared key). Flower 1.42's own SecAgg+ expands them with
``pseudo_rand_gen``, which XOR-folds the seed into a 32-bit integer and seeds numpy's MT19937:
2^32 possible masks, and MT19937 is predictable from its output, so its mask is far weaker
than the 128+ bits of the key. This module is why the product runs its own secure sum.

:func:`expand_mask` keeps the whole seed: the ChaCha20 key is SHA-256 of a domain label and
the full seed, and the keystream is read as little-endian 64-bit words whose low bits become
the mask. ``num_range`` must be a power of two, so taking low bits is exactly uniform (no
modulo bias). Both ends expand masks with this one function (the sites' sessions, the
coordinator's unmasking, and the neighbour graph's seeded draw in ``protocol.sum_graph``), so
the masks cancel. Pure (``cryptography`` + numpy).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from dpmtv_common.aliases import Int64Array
from dpmtv_common.errors import ConfigError

__all__ = ["derive_mask_key", "expand_mask"]

_DOMAIN = b"dpmtv/secagg+/mask-prg/chacha20/v1\x00"
# cryptography's ChaCha20 takes a 16-byte nonce: 4-byte little-endian block counter, then a
# 12-byte nonce. Each seed is used for one mask only (pair seeds are derived per release, sum
# and pair, self-mask seeds drawn fresh for each sum), so a fixed all-zero nonce under a
# seed-derived key is safe.
_NONCE = bytes(16)
_MIN_SEED_BYTES = 16
_MAX_NUM_RANGE = 2**63  # masks are returned as int64, whose non-negative range ends here


def derive_mask_key(seed: bytes) -> bytes:
    """Derive the 32-byte ChaCha20 key from the whole seed (length-prefixed, domain-separated).

    Args:
        seed: The SecAgg+ secret (private-mask seed or pairwise shared key), at least 16 bytes.

    Raises:
        ConfigError: If ``seed`` is not bytes or holds fewer than 16 bytes.
    """
    if not isinstance(seed, bytes | bytearray) or len(seed) < _MIN_SEED_BYTES:
        size = len(seed) if isinstance(seed, bytes | bytearray) else type(seed).__name__
        raise ConfigError(f"seed must be at least {_MIN_SEED_BYTES} bytes, got {size!r}.")
    prefix = _DOMAIN + len(seed).to_bytes(8, "big")
    return hashlib.sha256(prefix + bytes(seed)).digest()


def expand_mask(seed: bytes, num_range: int, shapes: Sequence[tuple[int, ...]]) -> list[Int64Array]:
    """Expand ``seed`` into one array of uniform integers in ``[0, num_range)`` per shape.

    The arrays are consecutive slices of one ChaCha20 keystream, one 64-bit word per entry,
    so the same seed and shapes always give the same masks, and any other seed gives masks
    indistinguishable from independent ones.

    Args:
        seed: The SecAgg+ secret to expand (the whole of it is used).
        num_range: The mask modulus M, a power of two with 2 <= M <= 2^63.
        shapes: The shape of each mask array (``()`` gives a 0-d array).

    Returns:
        One ``int64`` array per shape, every entry uniform in ``[0, num_range)``.

    Raises:
        ConfigError: If ``num_range`` is not a power of two in range, a shape is invalid or
            the seed is too short.
    """
    key = derive_mask_key(seed)
    _check_num_range(num_range)
    sizes = [_shape_size(shape) for shape in shapes]
    encryptor = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * sum(sizes))) + encryptor.finalize()
    words = np.frombuffer(stream, dtype="<u8") & np.uint64(num_range - 1)
    values = words.astype(np.int64)
    bounds = np.cumsum([0, *sizes])
    return [
        values[start:stop].reshape(shape)
        for start, stop, shape in zip(bounds[:-1], bounds[1:], shapes, strict=True)
    ]


def _check_num_range(num_range: int) -> None:
    is_int = isinstance(num_range, int) and not isinstance(num_range, bool)
    if not is_int or num_range < 2 or num_range > _MAX_NUM_RANGE or num_range & (num_range - 1):
        raise ConfigError(f"num_range must be a power of two in [2, 2^63], got {num_range!r}.")


def _shape_size(shape: tuple[int, ...]) -> int:
    if not all(isinstance(dim, int | np.integer) and dim >= 0 for dim in shape):
        raise ConfigError(f"every shape must hold non-negative ints, got {shape!r}.")
    return math.prod(int(dim) for dim in shape)

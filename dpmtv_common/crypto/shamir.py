"""Shamir secret sharing as Flower's SecAgg+ does it, share for share, at numpy speed.

Flower (``flwr.common.secure_aggregation.crypto.shamir``) pads a secret to 16-byte blocks
(PKCS#7) and splits each block with PyCryptodome's ``Shamir.split(k, n, block)``: a random
polynomial of degree k - 1 over GF(2^128) (modulus x^128 + x^7 + x^2 + x + 1), its constant
term the block, its other coefficients drawn highest degree first, evaluated at x = 1..n, and
each element written as 16 big-endian bytes. Share i is ``i.to_bytes(4, "little")`` followed
by its element of every block. Reconstruction is Lagrange interpolation at 0 over every share
given. PyCryptodome multiplies bit by bit through string operations (about half a millisecond
a product), so a hundred-site SecAgg+ spent more time sharing keys than masking vectors.

Here the field, the encoding, the order of random draws and the interpolation are the same,
so shares and reconstructions are identical bit for bit (the unit tests run Flower's own code
on the same random bytes). Only the arithmetic is faster:

* :func:`create_shares` runs Horner's rule on every block and every participant at once: the
  points x = 1..n are small, so a product is a few shifts and XORs of numpy ``uint64`` pairs.
* :func:`combine_shares` multiplies by the Lagrange coefficients as GF(2)-linear maps (one
  128x128 bit matrix each, cached per set of share indices: without dropouts every site's
  secret is rebuilt from the same indices), i.e. one matrix product per secret.

Why not a prime field: the shares cross the wire between coordinator and sites, and a peer
running Flower's own code must read them. The field is Flower's; nothing here is new
cryptography.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from dpmtv_common.errors import ConfigError, InsufficientSharesError, IntegrityError

__all__ = ["BLOCK_BYTES", "INDEX_BYTES", "combine_shares", "create_shares"]

BLOCK_BYTES = 16
"""Bytes of one GF(2^128) element: one block of the padded secret in each share."""
INDEX_BYTES = 4
"""Bytes of the little-endian share index (1..n) at the start of each share."""

_BITS = 128
_MASK = (1 << _BITS) - 1
_REDUCTION = 0b10000111  # x^128 = x^7 + x^2 + x + 1 in GF(2^128)
_MAX_SHARES = (1 << 32) - 1  # the index must fit in its four bytes
_U64 = np.uint64
UInt64Array = npt.NDArray[np.uint64]


def create_shares(
    secret: bytes,
    threshold: int,
    num: int,
    *,
    random_bytes: Callable[[int], bytes] = os.urandom,
) -> list[bytes]:
    """Split ``secret`` into ``num`` shares, any ``threshold`` of which rebuild it.

    Args:
        secret: The bytes to share (a mask seed or a private key).
        threshold: Shares needed to rebuild it (polynomial degree + 1).
        num: Shares to make, for x = 1..num.
        random_bytes: Source of the polynomials' coefficients, called with 16 for each;
            the OS CSPRNG unless a test injects a known stream.

    Returns:
        Share i - 1 for x = i, framed as Flower frames it.

    Raises:
        ConfigError: ``threshold`` or ``num`` is out of range.
    """
    _check_counts(threshold, num)
    padded = _pad(secret)
    blocks = len(padded) // BLOCK_BYTES
    # Flower splits block after block; each split draws its k - 1 coefficients in turn.
    coefficients = [
        [random_bytes(BLOCK_BYTES) for _ in range(threshold - 1)]
        + [padded[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES]]
        for b in range(blocks)
    ]
    hi, lo = _elements_from_bytes(
        b"".join(coefficients[b][i] for i in range(threshold) for b in range(blocks))
    )
    hi, lo = hi.reshape(threshold, blocks), lo.reshape(threshold, blocks)
    points = np.arange(1, num + 1, dtype=_U64)
    share_hi = np.zeros((num, blocks), dtype=_U64)
    share_lo = np.zeros((num, blocks), dtype=_U64)
    for degree in range(threshold):  # Horner's rule, highest coefficient first
        share_hi, share_lo = _mul_small(share_hi, share_lo, points, num.bit_length())
        share_hi ^= hi[degree]
        share_lo ^= lo[degree]
    body = np.stack([share_hi, share_lo], axis=-1).astype(">u8").reshape(num, -1)
    return [
        (index + 1).to_bytes(INDEX_BYTES, "little") + body[index].tobytes() for index in range(num)
    ]


def combine_shares(shares: Sequence[bytes]) -> bytes:
    """Rebuild a secret from shares made by :func:`create_shares` (or by Flower).

    Every share given takes part in the interpolation, as in Flower; pass at least the
    threshold, from distinct participants.

    Raises:
        InsufficientSharesError: No share is given.
        IntegrityError: The shares are malformed, repeat an index, or do not rebuild a
            padded secret (wrong or too few shares).
    """
    if not shares:
        raise InsufficientSharesError("shares must hold at least one share, got none.")
    blocks = _blocks_of(shares)
    indices = tuple(int.from_bytes(share[:INDEX_BYTES], "little") for share in shares)
    if len(set(indices)) != len(indices):
        repeated = sorted({index for index in indices if indices.count(index) > 1})
        raise IntegrityError(f"share indices must be distinct, got {repeated!r} repeated.")
    # In index order: shares arrive in any order, and the cached matrix is per index set.
    order = sorted(range(len(shares)), key=indices.__getitem__)
    indices = tuple(indices[position] for position in order)
    body = b"".join(shares[position][INDEX_BYTES:] for position in order)
    values = np.frombuffer(body, dtype=np.uint8)
    bits = np.unpackbits(values.reshape(len(shares), blocks, BLOCK_BYTES), axis=-1)
    # (blocks, shares * 128) @ (shares * 128, 128): the sum over shares of lambda_j * y_j.
    stacked = bits.transpose(1, 0, 2).reshape(blocks, len(shares) * _BITS)
    product = stacked.astype(np.float64) @ _interpolation_matrix(indices)
    secret_bits = (product.astype(np.int64) & 1).astype(np.uint8)
    return _unpad(np.packbits(secret_bits, axis=-1).tobytes())


def _check_counts(threshold: int, num: int) -> None:
    for name, value in (("threshold", threshold), ("num", num)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}.")
    if not 1 <= threshold <= num <= _MAX_SHARES:
        raise ConfigError(
            f"threshold and num must satisfy 1 <= threshold <= num <= {_MAX_SHARES}, "
            f"got threshold={threshold!r}, num={num!r}."
        )


def _blocks_of(shares: Sequence[bytes]) -> int:
    lengths = {len(share) for share in shares}
    length = lengths.pop()
    if lengths or length < INDEX_BYTES + BLOCK_BYTES or (length - INDEX_BYTES) % BLOCK_BYTES:
        raise IntegrityError(
            f"shares must be {INDEX_BYTES} + 16k bytes long (k >= 1), all alike, got lengths "
            f"{sorted({len(share) for share in shares})!r}."
        )
    return (length - INDEX_BYTES) // BLOCK_BYTES


def _pad(secret: bytes) -> bytes:
    """PKCS#7 to whole blocks, as ``Crypto.Util.Padding.pad(secret, 16)``."""
    size = BLOCK_BYTES - len(secret) % BLOCK_BYTES
    return secret + bytes([size]) * size


def _unpad(padded: bytes) -> bytes:
    """Undo :func:`_pad`, refusing what ``Crypto.Util.Padding.unpad`` refuses."""
    size = padded[-1]
    if not 1 <= size <= BLOCK_BYTES or padded[-size:] != bytes([size]) * size:
        raise IntegrityError(
            "shares must rebuild a padded secret, got bytes that end in no valid padding "
            "(wrong shares, or fewer than the threshold)."
        )
    return padded[:-size]


def _elements_from_bytes(data: bytes) -> tuple[UInt64Array, UInt64Array]:
    """16-byte big-endian elements -> (high, low) 64-bit halves."""
    halves = np.frombuffer(data, dtype=">u8").astype(_U64).reshape(-1, 2)
    return halves[:, 0].copy(), halves[:, 1].copy()


def _mul_small(
    hi: UInt64Array, lo: UInt64Array, points: UInt64Array, bits: int
) -> tuple[UInt64Array, UInt64Array]:
    """Row i of (hi, lo) times ``points[i]`` (< 2^32) in GF(2^128).

    A carry-less product with a factor of ``bits`` bits overflows by fewer than ``bits``
    bits; x^128 = x^7 + x^2 + x + 1 folds them back in at most 38 bits: no second pass.
    """
    out_hi = np.zeros_like(hi)
    out_lo = np.zeros_like(lo)
    over = np.zeros_like(lo)
    for shift in range(bits):
        chosen = (np.uint64(0) - ((points >> _U64(shift)) & _U64(1)))[:, None]  # all ones
        if shift == 0:
            out_hi ^= hi & chosen
            out_lo ^= lo & chosen
            continue
        left, right = _U64(shift), _U64(64 - shift)
        out_hi ^= ((hi << left) | (lo >> right)) & chosen
        out_lo ^= (lo << left) & chosen
        over ^= (hi >> right) & chosen
    out_lo ^= over ^ (over << _U64(1)) ^ (over << _U64(2)) ^ (over << _U64(7))
    return out_hi, out_lo


def _gf_mul(a: int, b: int) -> int:
    """The product a * b in GF(2^128), on Python ints (for the few the cached matrices need)."""
    product = 0
    while b:
        if b & 1:
            product ^= a
        a <<= 1
        if a >> _BITS:
            a = (a & _MASK) ^ _REDUCTION
        b >>= 1
    return product


def _gf_inverse(a: int) -> int:
    """1 / a (a != 0): extended Euclid over GF(2)[x] with the field's modulus.

    Invariant: s_i * a = r_i modulo the modulus; it ends with r = gcd = 1.
    """
    r0, r1 = (1 << _BITS) | _REDUCTION, a
    s0, s1 = 0, 1
    while r1:
        if r0.bit_length() < r1.bit_length():
            r0, r1, s0, s1 = r1, r0, s1, s0
            continue
        shift = r0.bit_length() - r1.bit_length()
        r0 ^= r1 << shift
        s0 ^= s1 << shift
    modulus = (1 << _BITS) | _REDUCTION
    while s0.bit_length() > _BITS:  # never taken for a < 2^128; kept so the result is reduced
        s0 ^= modulus << (s0.bit_length() - _BITS - 1)
    return s0


def _lagrange_at_zero(indices: tuple[int, ...]) -> list[int]:
    """lambda_j = prod_{m != j} x_m / (x_j + x_m): the weight of share j at x = 0."""
    weights = []
    for j, x_j in enumerate(indices):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(indices):
            if m != j:
                numerator = _gf_mul(numerator, x_m)
                denominator = _gf_mul(denominator, x_j ^ x_m)
        weights.append(_gf_mul(numerator, _gf_inverse(denominator)))
    return weights


def _multiplication_matrix(factor: int) -> npt.NDArray[np.float64]:
    """M with bits(y) @ M = bits(factor * y) mod 2; bits in ``np.unpackbits`` order (MSB first)."""
    rows = []
    power = factor  # factor * x^k for k = 0, 1, ...
    for _ in range(_BITS):
        rows.append(power.to_bytes(BLOCK_BYTES, "big"))
        power <<= 1
        if power >> _BITS:
            power = (power & _MASK) ^ _REDUCTION
    bits = np.unpackbits(np.frombuffer(b"".join(reversed(rows)), dtype=np.uint8))
    return bits.reshape(_BITS, _BITS).astype(np.float64)


@lru_cache(maxsize=64)
def _interpolation_matrix(indices: tuple[int, ...]) -> npt.NDArray[np.float64]:
    """The Lagrange weights at 0 of ``indices`` as one (shares * 128, 128) bit matrix.

    Sums of at most shares * 128 ones stay exact in float64, and the product runs on BLAS.
    """
    matrices = [_multiplication_matrix(weight) for weight in _lagrange_at_zero(indices)]
    return np.concatenate(matrices, axis=0)

"""Validated SecAgg+ parameters for one secure sum (re-exported by ``server.secagg``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeGuard

from dpmtv_common.errors import ConfigError

__all__ = ["SecureSumSettings"]

MAX_QUANTIZATION_RANGE = 2**30  # Flower's stochastic rounding casts to int32
MAX_MODULUS_RANGE = 2**62
_SMALL_MODULUS = 2**32  # Flower's documented range; used when it still allows Q = 2^30
_LARGE_MODULUS = 2**40  # measured exact in notes/flower.md §2.3 (int64 masks)


@dataclass(frozen=True, kw_only=True)
class SecureSumSettings:
    """SecAgg+ parameters of one secure sum, checked so the sum can neither clip nor wrap.

    Each site quantises every coordinate x in ``[-c, c]`` to the integer grid
    ``round_stochastic((x + c) * Q / (2c))`` in ``[0, Q]``; the coordinator adds the n
    survivors' integers modulo M. Hence:

    * the sum is exact up to quantisation iff ``n * Q < M`` (checked here with
      ``max_sites`` as n; otherwise the modular sum wraps silently);
    * the quantisation error of one coordinate of the *sum* is at most
      ``n_sites * 2c / Q`` (stochastic rounding: unbiased, rms about ``sqrt(n) * c / Q``),
      see :meth:`quantization_error_bound`;
    * a coordinate beyond ``±c`` would be clipped by Flower without notice, so the site side
      (``client.secagg.secure_sum_reply``) refuses such input instead.

    Attributes:
        clipping_range: Per-coordinate bound c > 0 of what a site sends (its local sum).
        quantization_range: Grid size Q, a power of two <= 2^30.
        modulus_range: Mask modulus M, a power of two with Q < M <= 2^62.
        timeout: Seconds to wait for replies at each of the four stages (finite, > 0).
        max_sites: Largest number of sites a sum may include (sizes the wrap check).
        num_shares: Neighbourhood size, the site included: an odd int >= 3, or a fraction
            in (0, 1] of the sites (1.0 = everyone is everyone's neighbour, classic SecAgg).
        reconstruction_threshold: Shares needed to rebuild a secret: an int >= 2, or a
            fraction in (0, 1] of ``num_shares``.
        allow_weak_mask_prg: Permit Flower's 32-bit-seeded MT19937 mask expansion (flwr
            #7522) when the ChaCha20 one is not installed. Off by default: fail closed.
    """

    clipping_range: float
    quantization_range: int
    modulus_range: int
    timeout: float
    max_sites: int
    num_shares: int | float = 1.0
    reconstruction_threshold: int | float = 0.67
    allow_weak_mask_prg: bool = False

    def __post_init__(self) -> None:
        _check_positive_finite("clipping_range", self.clipping_range)
        _check_positive_finite("timeout", self.timeout)
        _check_power_of_two("quantization_range", self.quantization_range, MAX_QUANTIZATION_RANGE)
        _check_power_of_two("modulus_range", self.modulus_range, MAX_MODULUS_RANGE)
        if self.modulus_range <= self.quantization_range:
            raise ConfigError(
                f"modulus_range must be > quantization_range={self.quantization_range}, "
                f"got {self.modulus_range!r}."
            )
        if not _is_int(self.max_sites) or self.max_sites < 2:
            raise ConfigError(f"max_sites must be an int >= 2, got {self.max_sites!r}.")
        _check_shares(self.num_shares, self.reconstruction_threshold)
        _check_no_wrap(self.quantization_range, self.modulus_range, self.max_sites)

    @classmethod
    def for_plan(
        cls,
        *,
        max_abs_coordinate: float,
        max_sites: int,
        timeout: float,
        num_shares: int | float = 1.0,
        reconstruction_threshold: int | float = 0.67,
    ) -> SecureSumSettings:
        """Choose the ranges for sums whose site inputs never exceed ``max_abs_coordinate``.

        ``c`` is the next power of two >= ``max_abs_coordinate`` (a site summing m_i chunks
        clipped to C passes ``m_max * C``, so nothing is ever clipped), M is 2^32 when that
        still allows Q = 2^30 (at most 3 sites), else 2^40, and Q is the largest power of
        two <= 2^30 with ``max_sites * Q < M``. Error bound: ``n_sites * 2c / Q`` per
        coordinate of the sum (e.g. c = 64, Q = 2^30, n = 10: 1.2e-6).

        Raises:
            ConfigError: If an argument is out of range.
        """
        _check_positive_finite("max_abs_coordinate", max_abs_coordinate)
        if not _is_int(max_sites) or max_sites < 2:
            raise ConfigError(f"max_sites must be an int >= 2, got {max_sites!r}.")
        modulus = (
            _SMALL_MODULUS
            if max_sites * MAX_QUANTIZATION_RANGE < _SMALL_MODULUS
            else (_LARGE_MODULUS)
        )
        return cls(
            clipping_range=_next_power_of_two(max_abs_coordinate),
            quantization_range=_largest_grid(modulus, max_sites),
            modulus_range=modulus,
            timeout=timeout,
            max_sites=max_sites,
            num_shares=num_shares,
            reconstruction_threshold=reconstruction_threshold,
        )

    def quantization_error_bound(self, num_sites: int) -> float:
        """Return the largest quantisation error of one coordinate of a sum over ``num_sites``.

        Each site's stochastic rounding moves a coordinate by less than one grid step 2c/Q;
        float64 rounding of the result adds a relative error near 1e-16 on top.
        """
        return num_sites * 2.0 * self.clipping_range / self.quantization_range


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_positive_finite(name: str, value: object) -> None:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}.")


def _check_power_of_two(name: str, value: object, upper: int) -> None:
    if not _is_int(value) or not 2 <= value <= upper or value & (value - 1):
        raise ConfigError(
            f"{name} must be a power of two in [2, 2^{upper.bit_length() - 1}], got {value!r}."
        )


def _check_fraction_or_int(name: str, value: object, minimum: int) -> None:
    if _is_int(value):
        if value < minimum:
            raise ConfigError(f"{name} as an int must be >= {minimum}, got {value!r}.")
    elif not isinstance(value, float) or not 0.0 < value <= 1.0:
        raise ConfigError(
            f"{name} must be an int >= {minimum} or a float in (0, 1], got {value!r}."
        )


def _check_shares(num_shares: object, threshold: object) -> None:
    _check_fraction_or_int("num_shares", num_shares, 3)
    _check_fraction_or_int("reconstruction_threshold", threshold, 2)
    if _is_int(num_shares) and num_shares % 2 == 0:
        # flwr 1.42 widens an even neighbourhood by one at the coordinator only: every site
        # then holds one share too few and fails at share-keys (IndexError), so no sum.
        raise ConfigError(
            f"num_shares as an int must be odd (flwr 1.42 fails on an even size below the "
            f"number of sites), got {num_shares!r}. Use {num_shares + 1}."
        )
    if _is_int(num_shares) and _is_int(threshold) and threshold >= num_shares:
        raise ConfigError(
            f"reconstruction_threshold must be < num_shares={num_shares}, got {threshold!r}."
        )


def _check_no_wrap(quantization_range: int, modulus_range: int, max_sites: int) -> None:
    if quantization_range * max_sites < modulus_range:
        return
    raise ConfigError(
        f"quantization_range * max_sites must be < modulus_range, got {quantization_range} * "
        f"{max_sites} = {quantization_range * max_sites} >= {modulus_range}: the modular sum "
        f"would wrap around silently. Lower quantization_range to "
        f"{_largest_grid(modulus_range, max_sites)} or raise modulus_range to "
        f"{1 << (quantization_range * max_sites).bit_length()} "
        f"(or use SecureSumSettings.for_plan)."
    )


def _largest_grid(modulus_range: int, max_sites: int) -> int:
    """Return the largest power of two Q <= 2^30 with ``max_sites * Q < modulus_range``."""
    grid = MAX_QUANTIZATION_RANGE
    while grid > 1 and grid * max_sites >= modulus_range:
        grid //= 2
    return grid


def _next_power_of_two(value: float) -> float:
    """Return the smallest power of two >= ``value`` (exact: read from the float's exponent)."""
    mantissa, exponent = math.frexp(value)
    return math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)

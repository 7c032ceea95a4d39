"""The ε a distributed release's manifest states, for the noise actually present."""

from __future__ import annotations

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.distributed._accounting import (
    distributed_epsilon_bound,
    mechanism_delta,
)
from dpmtv_common.privacy.distributed._params import DistributedNoise

__all__ = ["release_epsilon"]


def release_epsilon(
    activations: DistributedNoise,
    votes: DistributedNoise | None,
    *,
    honest_shares: int,
    delta: float,
) -> EpsilonBound:
    """ε at total ``delta`` when ``honest_shares`` honest shares land in each sum.

    Privacy unit one example (or group), replace-one; the events are KLS21 zCDP with the
    sums' rounding-inflated sensitivities, composed in RDP (order-free). Call it with the
    survivors for the "all survivors honest" figure and with t (or the survivors minus any
    assumed fakes) for the guarantee a site relies on. The overflow aborts cost
    (1 + e^ε)·p of ``delta`` (:func:`mechanism_delta`); since that depends on the ε being
    computed, ε is evaluated at the δ left under a cap ε_cap and accepted once ε ≤ ε_cap.

    Raises:
        ConfigError: if the overflow probabilities leave no δ for the mechanisms, or
            ``honest_shares`` < 1.
    """
    sums = [activations] if votes is None else [activations, votes]
    overflow = sum(params.overflow_probability for params in sums)
    events = [params.event(honest_shares) for params in sums]
    first = distributed_epsilon_bound(
        events, delta=mechanism_delta(epsilon=0.0, delta=delta, overflow_probability=overflow)
    ).epsilon
    # The first cap nearly always holds: p is ~1e-12, so the δ it costs moves ε by < 1e-6.
    for cap in (first + 1e-6, first + 1.0, 2.0 * first + 10.0):
        left = mechanism_delta(epsilon=cap, delta=delta, overflow_probability=overflow)
        epsilon = distributed_epsilon_bound(events, delta=left).epsilon
        if epsilon <= cap:
            # The mechanisms are (ε, left)-DP with ε ≤ cap, so the aborts cost at most
            # (1 + e^cap)·p and the total δ stays within ``delta``.
            return EpsilonBound(epsilon, delta, "rdp", {"rdp": epsilon})
    raise ConfigError(
        f"delta must leave room for the overflow probability {overflow!r} at the computed "
        f"epsilon, got {delta!r}."
    )

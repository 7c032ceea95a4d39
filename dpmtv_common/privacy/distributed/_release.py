"""The ε a distributed release's manifest states, for the noise actually present."""

from __future__ import annotations

from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.distributed._composition import combined_epsilon_bound
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
    sums' rounding-inflated sensitivities, composed in RDP (order-free), and the sums'
    overflow aborts cost (1 + e^ε)·p of ``delta``. Call it with t (or the survivors minus
    any assumed fakes) for the guarantee a site relies on, and with the survivors for the
    figure if all of them are honest.

    Raises:
        ConfigError: if the overflow probabilities leave no δ for the mechanisms, or
            ``honest_shares`` < 1.
    """
    sums = [activations] if votes is None else [activations, votes]
    return combined_epsilon_bound(
        [],
        [params.event(honest_shares) for params in sums],
        delta=delta,
        overflow_probability=sum(params.overflow_probability for params in sums),
    )

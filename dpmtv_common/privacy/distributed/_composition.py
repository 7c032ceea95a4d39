"""Ledger-side composition: central and distributed releases of one population, in RDP.

A site's ledger may hold releases of both modes. Central releases are ``ReleaseEvent`` (one
Gaussian, z = σ/Δ₂, and k Gumbel picks, k·ε₀²/8-zCDP); distributed ones are
:class:`DistributedGaussianEvent` ((ρ, ξ)-zCDP, KLS21). All are RDP curves, so they compose by
adding them (Mironov 2017), whatever the order. PLD is valid only while no distributed event
is present (see ``_accounting``); then :func:`combined_epsilon_bound` defers to the central
accountant, which reports the smaller of RDP and PLD.

Overflow aborts: the real protocol differs from the analysed one only when a distributed sum
aborts, so over the composition TV ≤ Σp and the total δ is δ_M + (1 + e^ε)·Σp
(:func:`mechanism_delta`). That cost depends on the ε being computed, so ε is evaluated at
the δ left under a cap ε_cap and accepted once ε ≤ ε_cap.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.accounting import EpsilonBound, central_epsilon_bound
from dpmtv_common.privacy.distributed._accounting import (
    DistributedGaussianEvent,
    mechanism_delta,
)
from dpmtv_common.privacy.events import ReleaseEvent

__all__ = [
    "combined_epsilon_bound",
    "release_events_epsilon_bound",
    "distributed_event_from_json",
    "distributed_event_to_json",
]

# The fixed point of the overflow cost: a relative margin far below any figure printed, and
# steps to spare (each step shrinks the gap by a factor of about (1 + e^ε)·p·|dε/dδ| << 1).
_CAP_MARGIN = 1e-12
_FIXED_POINT_STEPS = 64

_EVENT_KEYS = ("dimension", "honest_shares", "min_honest", "noise_multiplier", "share_noise_std")


def distributed_event_to_json(event: DistributedGaussianEvent) -> str:
    """Canonical JSON of a distributed event (sorted keys), for a ledger row."""
    return json.dumps({key: getattr(event, key) for key in _EVENT_KEYS}, sort_keys=True)


def distributed_event_from_json(text: str) -> DistributedGaussianEvent:
    """Inverse of :func:`distributed_event_to_json`; rejects unknown or missing keys."""
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"event must be JSON, got {text[:80]!r}.") from exc
    if not isinstance(data, dict) or sorted(data) != list(_EVENT_KEYS):
        raise ConfigError(f"event keys must be {list(_EVENT_KEYS)}, got {text[:80]!r}.")
    return DistributedGaussianEvent(
        noise_multiplier=float(data["noise_multiplier"]),
        min_honest=int(data["min_honest"]),
        honest_shares=int(data["honest_shares"]),
        share_noise_std=float(data["share_noise_std"]),
        dimension=int(data["dimension"]),
    )


def _rdp_epsilon(
    central: Sequence[ReleaseEvent], distributed: Sequence[DistributedGaussianEvent], delta: float
) -> float:
    from dp_accounting import dp_event, rdp

    accountant = rdp.RdpAccountant()
    for release in central:
        if release.noise_multiplier is not None:
            accountant.compose(dp_event.GaussianDpEvent(noise_multiplier=release.noise_multiplier))
        if release.picks > 0:
            accountant.compose(dp_event.ZCDpEvent(rho=release.selection_rho))
    for event in distributed:
        accountant.compose(dp_event.ZCDpEvent(rho=event.rho, xi=event.xi))
    return float(accountant.get_epsilon(delta))


def _with_overflow(
    epsilon_at: Callable[[float], float], delta: float, overflow_probability: float
) -> float:
    """The least ε with ε ≥ ε_M(δ − (1 + e^ε)·p): the fixed point, approached from below.

    g(c) = ε_M at the δ left under a cap c is increasing in c and nearly flat (p ~ 1e-12
    moves δ by a few parts in a million), so iterating c ← g(c) from g(0) climbs to the
    smallest fixed point in one or two steps. Each step tries a cap a hair above the last ε;
    the first cap that holds (g(cap) ≤ cap) gives a valid ε ≤ cap: the mechanisms are then
    (ε, left)-DP and the aborts cost at most (1 + e^cap)·p. A coarse cap (a whole unit above)
    would also hold, but its larger abort cost leaves less δ and so a larger ε than the
    plan's calibration, which solved the same fixed point at the plan's ε.
    """
    cap = epsilon_at(
        mechanism_delta(epsilon=0.0, delta=delta, overflow_probability=overflow_probability)
    )
    for _ in range(_FIXED_POINT_STEPS):
        cap += _CAP_MARGIN * max(1.0, cap)
        left = mechanism_delta(epsilon=cap, delta=delta, overflow_probability=overflow_probability)
        epsilon = epsilon_at(left)
        if epsilon <= cap:
            return epsilon
        cap = epsilon
    raise ConfigError(
        f"delta must leave room for the overflow probability {overflow_probability!r} at the "
        f"computed epsilon, got {delta!r}."
    )


def combined_epsilon_bound(
    central: Sequence[ReleaseEvent],
    distributed: Sequence[DistributedGaussianEvent],
    *,
    delta: float,
    overflow_probability: float = 0.0,
) -> EpsilonBound:
    """ε at total ``delta`` of every release of one population, central and distributed.

    Args:
        central: central-mode events (analytic/RDP/PLD as in ``accounting.central_epsilon_bound``).
        distributed: distributed-mode events, each with the honest shares actually present.
        delta: total δ, the distributed sums' overflow aborts included.
        overflow_probability: Σp over every distributed sum composed here (0 if none).

    Raises:
        ConfigError: if both sequences are empty, δ is out of range, or the overflow
            probability leaves no δ for the mechanisms.
    """
    if not central and not distributed:
        raise ConfigError("events must not be empty, got no central and no distributed event.")
    if not distributed:
        return central_epsilon_bound(central, delta=delta)
    if not (overflow_probability > 0.0):
        raise ConfigError(
            f"overflow_probability must be > 0 with distributed events, got "
            f"{overflow_probability!r}."
        )
    epsilon = _with_overflow(
        lambda left: _rdp_epsilon(central, distributed, left), delta, overflow_probability
    )
    return EpsilonBound(epsilon, delta, "rdp", {"rdp": epsilon})


def release_events_epsilon_bound(events: Sequence[ReleaseEvent], *, delta: float) -> EpsilonBound:
    """ε at total ``delta`` of ledger events, some carrying distributed sums as (ρ, ξ)-zCDP.

    Every event's Gaussian draw, Gumbel picks and distributed sums are RDP curves and add up
    (order-free); the distributed sums' overflow aborts cost (1 + e^ε)·Σp of ``delta``.
    """
    overflow = sum(event.overflow_probability for event in events)

    def epsilon_at(left: float) -> float:
        from dp_accounting import dp_event, rdp

        accountant = rdp.RdpAccountant()
        for event in events:
            if event.noise_multiplier is not None:
                accountant.compose(
                    dp_event.GaussianDpEvent(noise_multiplier=event.noise_multiplier)
                )
            if event.picks > 0:
                accountant.compose(dp_event.ZCDpEvent(rho=event.selection_rho))
            if event.is_distributed:
                accountant.compose(
                    dp_event.ZCDpEvent(rho=event.distributed_rho, xi=event.distributed_xi)
                )
        return float(accountant.get_epsilon(left))

    epsilon = _with_overflow(epsilon_at, delta, overflow) if overflow > 0 else epsilon_at(delta)
    return EpsilonBound(epsilon, delta, "rdp", {"rdp": epsilon})

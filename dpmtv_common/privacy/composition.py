"""The ε a ledger has spent: one entry point above the central and distributed accountants.

A site's ledger may hold releases of both noise modes. Central events (one Gaussian and k
Gumbel picks) are bounded by :func:`~dpmtv_common.privacy.accounting.central_epsilon_bound`
(the smaller of RDP and PLD, or the analytic value of a lone Gaussian); once any event carries
a distributed-noise sum, every event is composed in RDP with the sums' overflow aborts counted
in δ (:func:`~dpmtv_common.privacy.distributed.release_events_epsilon_bound`). Choosing the
accountant here, above both, keeps each of them free of the other (dp-accounting's own split:
events apart from accountants).

Both bounds are valid upper bounds for the neighbouring relation that fixed each event's L2
sensitivity (replace-one in dpmtv); nothing here draws noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.accounting import EpsilonBound, central_epsilon_bound
from dpmtv_common.privacy.distributed import release_events_epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent

__all__ = ["epsilon_bound"]


def epsilon_bound(events: Sequence[ReleaseEvent], *, delta: float) -> EpsilonBound:
    """The smallest valid ε at ``delta`` for the sequential composition of ``events``.

    Events with distributed-noise sums are composed in RDP only, with their overflow aborts
    counted in δ (``dpmtv_common.privacy.distributed`` says why no PLD is claimed for them);
    central-only compositions take the central accountant's bound.

    A pure function of its arguments, remembered per process: every site of a simulated
    consortium checks the same plan, and each check composed the same curves again.

    Raises:
        ConfigError: ``delta`` out of (0, 1) or no events.
    """
    if not (0.0 < delta < 1.0):
        raise ConfigError(f"delta must lie in (0, 1), got {delta!r}.")
    if not events:
        raise ConfigError("events must not be empty, got [].")
    if not any(event.is_distributed for event in events):
        return central_epsilon_bound(events, delta=delta)
    bound = _remembered_distributed(tuple(events), delta)
    return replace(bound, by_accountant=dict(bound.by_accountant))  # callers get their own


@lru_cache(maxsize=1024)
def _remembered_distributed(events: tuple[ReleaseEvent, ...], delta: float) -> EpsilonBound:
    return release_events_epsilon_bound(events, delta=delta)

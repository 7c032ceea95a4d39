"""One release's privacy parameters, from its total (epsilon, delta) and split.

A release spends its budget on at most two mechanisms on the same private chunks: private
head selection (k Gumbel picks at ε₀ each) and one Gaussian sum of clipped activations. The
split fixes ε₀ = share·ε/k (the share the picks would cost alone under basic composition);
the Gaussian's noise multiplier z is then the smallest that keeps the tight composition of
both (RDP or PLD, whichever is smaller) within (ε, δ). Sites and coordinator run the same
calibration, so a site reserves in its own ledger exactly the event the coordinator accounts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.accounting import (
    EpsilonBound,
    calibrate_noise_multiplier,
    epsilon_per_pick_from_share,
)
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.mechanisms import GaussianSumMechanism, GumbelTopKMechanism

__all__ = ["ReleaseCalibration"]


@dataclass(frozen=True)
class ReleaseCalibration:
    """Calibrated mechanisms of one release.

    Attributes:
        epsilon: total ε of the release.
        delta: total δ.
        picks: k private picks (0 when the heads are public or all heads are released).
        epsilon_per_pick: ε₀ of each pick (0 when picks == 0).
        noise_multiplier: z = σ/Δ₂ of the Gaussian sum.
        bound: the (ε, δ) bound the composition achieves, and the accountant that gave it.
    """

    epsilon: float
    delta: float
    picks: int
    epsilon_per_pick: float
    noise_multiplier: float
    bound: EpsilonBound

    @classmethod
    def for_budget(
        cls, *, epsilon: float, delta: float, private_picks: int, selection_share: float
    ) -> ReleaseCalibration:
        """Calibrate a release; ``private_picks == 0`` means no private selection runs."""
        if private_picks < 0:
            raise ConfigError(f"private_picks must be >= 0, got {private_picks!r}.")
        per_pick = (
            epsilon_per_pick_from_share(epsilon=epsilon, share=selection_share, picks=private_picks)
            if private_picks
            else 0.0
        )
        return _calibrated(epsilon, delta, private_picks, per_pick)

    @property
    def event(self) -> ReleaseEvent:
        """What the release runs, for the ledgers."""
        return ReleaseEvent(self.noise_multiplier, self.picks, self.epsilon_per_pick)

    def gaussian(self, *, clip_norm: float, heads: HeadSet) -> GaussianSumMechanism:
        """The Gaussian sum mechanism over the released heads' layers."""
        return GaussianSumMechanism(
            clip_norm=clip_norm,
            num_layers_in_scope=heads.num_layers_in_scope,
            noise_multiplier=self.noise_multiplier,
        )

    def gumbel(self) -> GumbelTopKMechanism:
        """The Gumbel top-k mechanism of the private selection."""
        if self.picks == 0:
            raise ConfigError("this release runs no private selection (picks == 0).")
        return GumbelTopKMechanism(picks=self.picks, epsilon_per_pick=self.epsilon_per_pick)


@lru_cache(maxsize=64)
def _calibrated(epsilon: float, delta: float, picks: int, per_pick: float) -> ReleaseCalibration:
    # PLD calibration takes seconds and every stage of a release asks for the same one.
    result = calibrate_noise_multiplier(
        epsilon=epsilon, delta=delta, picks=picks, epsilon_per_pick=per_pick
    )
    return ReleaseCalibration(
        epsilon, delta, picks, per_pick, result.noise_multiplier, result.bound
    )

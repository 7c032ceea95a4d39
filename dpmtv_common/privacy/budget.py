"""Privacy budgets: a validated (epsilon, delta) pair."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpmtv_common.errors import ConfigError

__all__ = ["PrivacyBudget"]


@dataclass(frozen=True)
class PrivacyBudget:
    """An (epsilon, delta) differential-privacy guarantee or allowance.

    Attributes:
        epsilon: Privacy-loss bound; finite and > 0.
        delta: Failure probability; in (0, 1). Keep it below 1/n for n private examples.
    """

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ConfigError(f"epsilon must be finite and > 0, got {self.epsilon!r}.")
        if not (0.0 < self.delta < 1.0):
            raise ConfigError(f"delta must lie in (0, 1), got {self.delta!r}.")

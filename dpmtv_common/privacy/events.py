"""What a release did, kept apart from what it costs (as dp-accounting keeps events apart).

A :class:`ReleaseEvent` records the mechanisms one task-vector release ran on one population
of private examples: at most one Gaussian sum (its noise multiplier ``z = noise_std / Δ₂``)
and ``picks`` rounds of Gumbel top-k at ``epsilon_per_pick`` each. Ledgers store events and
re-run the accountant over all of them, so repeated releases compose tightly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpmtv_common.errors import ConfigError

__all__ = ["ReleaseEvent"]

_DISTRIBUTED_KEYS = ("distributed_rho", "distributed_xi", "overflow_probability")


@dataclass(frozen=True)
class ReleaseEvent:
    """The mechanisms one release ran on one data population.

    Attributes:
        noise_multiplier: ``z = noise_std / l2_sensitivity`` of the single Gaussian draw, or
            None when the release drew no Gaussian noise.
        picks: Number of Gumbel top-k picks (k), 0 when no private selection ran.
        epsilon_per_pick: ε₀ of each pick (each pick is ε₀-bounded-range, so
            ε₀²/8-zCDP by Cesar & Rogers 2021).
        distributed_rho: ρ of the release's distributed-noise sums (sites' discrete
            Gaussian shares, KLS21 Thm 1: (ρ, ξ)-zCDP at the honest shares the release
            assumes), 0 in central mode.
        distributed_xi: ξ of those sums.
        overflow_probability: Σp of those sums (an abort when a share leaves SecAgg+'s
            range; costs (1 + e^ε)·p of δ).
    """

    noise_multiplier: float | None
    picks: int = 0
    epsilon_per_pick: float = 0.0
    distributed_rho: float = 0.0
    distributed_xi: float = 0.0
    overflow_probability: float = 0.0

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if z is not None and not (math.isfinite(z) and z > 0):
            raise ConfigError(f"noise_multiplier must be finite and > 0 or None, got {z!r}.")
        if self.picks < 0:
            raise ConfigError(f"picks must be >= 0, got {self.picks!r}.")
        if self.picks > 0 and not (
            math.isfinite(self.epsilon_per_pick) and self.epsilon_per_pick > 0
        ):
            raise ConfigError(
                f"epsilon_per_pick must be finite and > 0 when picks > 0, "
                f"got {self.epsilon_per_pick!r}."
            )
        self._check_distributed()
        if z is None and self.picks == 0 and self.distributed_rho == 0:
            raise ConfigError(
                "a release event must run a Gaussian draw, a pick or a distributed sum."
            )

    def _check_distributed(self) -> None:
        for name in ("distributed_rho", "distributed_xi", "overflow_probability"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be finite and >= 0, got {value!r}.")
        if (self.distributed_rho > 0) != (self.overflow_probability > 0):
            raise ConfigError(
                "overflow_probability must be > 0 exactly when distributed_rho is, got "
                f"{self.overflow_probability!r} and {self.distributed_rho!r}."
            )

    @property
    def is_distributed(self) -> bool:
        """Whether the release ran distributed-noise sums (RDP-only accounting)."""
        return self.distributed_rho > 0

    @property
    def selection_rho(self) -> float:
        """ZCDP parameter of the picks: ρ = k·ε₀²/8 (bounded-range composition)."""
        return self.picks * self.epsilon_per_pick**2 / 8.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the distributed keys only when the release had such sums)."""
        data: dict[str, Any] = {
            "noise_multiplier": self.noise_multiplier,
            "picks": self.picks,
            "epsilon_per_pick": self.epsilon_per_pick,
        }
        if self.is_distributed:
            data |= {name: getattr(self, name) for name in _DISTRIBUTED_KEYS}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReleaseEvent:
        """Inverse of :meth:`to_dict`; rejects unknown or missing keys."""
        central = {"noise_multiplier", "picks", "epsilon_per_pick"}
        if set(data) not in (central, central | set(_DISTRIBUTED_KEYS)):
            raise ConfigError(
                f"event keys must be {sorted(central)} (plus {list(_DISTRIBUTED_KEYS)} for a "
                f"distributed release), got {sorted(data)!r}."
            )
        z = data["noise_multiplier"]
        return cls(
            noise_multiplier=None if z is None else float(z),
            picks=int(data["picks"]),
            epsilon_per_pick=float(data["epsilon_per_pick"]),
            **{name: float(data.get(name, 0.0)) for name in _DISTRIBUTED_KEYS},
        )

    def to_json(self) -> str:
        """Canonical JSON (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ReleaseEvent:
        """Inverse of :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"event must be JSON, got {text[:80]!r}.") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"event must be a JSON object, got {text[:80]!r}.")
        return cls.from_dict(data)

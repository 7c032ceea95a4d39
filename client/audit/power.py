"""How many audit runs it takes to catch a planted bug, and how likely they are to catch it.

How this connects: ``dpmtv-site audit`` builds a canary pair (:mod:`client.audit.empirical`), then
asks this module how many releases a side its checks need. The planted bug that sizes them is
**σ halved** (in distributed mode: every site's share halved, so the summed noise is too): the
outputs are then 2·μ_canary-GDP apart, where μ_canary = ‖Δ‖/σ is what this canary shows at
the claimed σ, a fraction (about the canary's strength ‖Δ‖/Δ₂) of the claimed μ
(:func:`client.audit.empirical.plan_claim`: Δ₂/σ central, √(2ρ) at t honest shares distributed).
Which check can catch it depends on that strength:

* the **calibration check** (μ̂'s lower limit above μ_canary: the noise is not what the
  plan says) can always catch it, since 2·μ_canary > μ_canary;
* the **violation flag** (μ̂'s lower limit above the claimed μ: the claim itself is refuted)
  only when the canary's strength is above 1/2, and then needs more runs the closer
  2·μ_canary comes to the claim.

The runs are the fewest that reach the asked power with either check (the violation flag
when it needs no more runs than the calibration check); the power of a given number of runs
is that of the check that sizes best. Both come from
:func:`dpmtv_common.privacy.auditing.detection_power` (normal approximation of μ̂).
"""

from __future__ import annotations

from dataclasses import dataclass

from client.audit.empirical import CanaryPair, plan_claim
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout
from dpmtv_common.privacy.auditing import detection_power, runs_for_power
from protocol import ReleasePlan

__all__ = ["AuditPower", "audit_power", "claimed_mu"]

MAX_RUNS = 100_000
"""The most runs a side an audit is sized to (about an hour for the embedded model)."""


@dataclass(frozen=True)
class AuditPower:
    """The runs an audit makes, and how likely they are to flag σ halved.

    Attributes:
        check: ``"violation"`` (the claim itself can be refuted) or ``"calibration"``.
        mu_claimed: What the plan guarantees for any pair
        (:func:`client.audit.empirical.plan_claim`). mu_canary: ‖Δ‖/σ, what this canary shows at the
        claimed σ. runs: Releases a side.
        power: Probability that σ halved is flagged by ``check`` at ``runs``.
    """

    check: str
    mu_claimed: float
    mu_canary: float
    runs: int
    power: float

    @property
    def strength(self) -> float:
        """‖Δ‖/Δ₂: how close the canary comes to the worst-case pair."""
        return self.mu_canary / self.mu_claimed

    def line(self) -> str:
        """One line for the report."""
        what = (
            "a violation of the claimed mu"
            if self.check == "violation"
            else f"noise NOT as calibrated (canary strength {self.strength:.2f}; a violation "
            "of the claim needs a strength over 0.5, and more runs the closer it is to 0.5)"
        )
        return (
            f"power: sigma halved is flagged as {what} with probability {self.power:.2f} "
            f"at {self.runs} runs a side"
        )


def claimed_mu(plan: ReleasePlan, pair: CanaryPair, layout: HeadLayout) -> tuple[float, float]:
    """(μ claimed, ‖Δ‖/σ): the plan's GDP claim and what this canary shows at the claimed σ."""
    head_dim = int(pair.without.total.shape[1])
    claim = plan_claim(plan, pair.without.heads, layout=layout, head_dim=head_dim)
    return claim.mu, pair.distance / claim.noise_std


def audit_power(
    plan: ReleasePlan,
    pair: CanaryPair,
    *,
    runs: int | None,
    power: float,
    confidence: float,
    layout: HeadLayout,
) -> AuditPower:
    """Size the runs for ``power`` (``runs`` None), or state the power of the given ``runs``.

    ``layout`` is the model's head layout (the distributed grid's vote length needs it).

    Raises:
        ConfigError: The canary changes nothing, or no number of runs up to
            :data:`MAX_RUNS` reaches ``power``.
    """
    mu_claimed, mu_canary = claimed_mu(plan, pair, layout)
    if mu_canary <= 0.0:
        raise ConfigError(
            "the canary must change the clipped sum, got a canary that changes nothing; choose "
            "another canary record."
        )
    halved = 2 * mu_canary
    bars = {"violation": mu_claimed, "calibration": mu_canary}  # the violation flag first
    if runs is None:
        needed = {
            check: runs_for_power(
                mu_true=halved, mu_bar=bar, power=power, confidence=confidence, max_runs=MAX_RUNS
            )
            for check, bar in bars.items()
        }
        reachable = {check: n for check, n in needed.items() if n is not None}
        if not reachable:
            raise ConfigError(
                f"--power must be reachable within {MAX_RUNS} runs a side, got {power!r} "
                f"(canary strength {mu_canary / mu_claimed:.3g}, mu canary {mu_canary:.3g}): "
                "lower --power or --confidence, or pass --runs to run anyway."
            )
        runs = min(reachable.values())
    powers = {
        check: detection_power(mu_true=halved, mu_bar=bar, runs=runs, confidence=confidence)
        for check, bar in bars.items()
    }
    check = max(powers, key=lambda name: powers[name])  # ties: the violation flag
    return AuditPower(check, mu_claimed, mu_canary, runs, powers[check])

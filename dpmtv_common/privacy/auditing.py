"""Statistics of an empirical privacy audit: ε lower bounds from two samples of outputs.

``client.audit.empirical`` runs a release configuration many times on a neighbouring pair (the data,
and the data with one record replaced by a canary) and projects every output on the canary's
direction; these functions turn the two samples of projections into what the audit reports:

* :func:`mu_estimate` — the Gaussian-DP μ̂ (difference of means over the pooled sd) with a
  normal-approximation confidence interval;
* :func:`epsilon_of_gdp` — the smallest ε a μ-GDP mechanism has at δ (Dong, Roth & Su 2019);
* :func:`clopper_pearson_epsilon` — a non-parametric ε lower bound: a threshold chosen on one
  half of the runs, Clopper-Pearson limits on its error rates on the other half
  (Jagielski, Ullman & Oprea 2020);
* :func:`detection_power` and :func:`runs_for_power` — how likely μ̂'s lower confidence limit
  clears a bar when the true μ is above it, and how many runs make that likely: an audit is
  sized for a stated power instead of a guessed number of runs.

They draw no noise and state no guarantee: a lower bound below the claim does not prove the
claim, it only fails to refute it for that canary.
"""

from __future__ import annotations

import math

import numpy as np

from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError

__all__ = [
    "clopper_pearson_epsilon",
    "detection_power",
    "epsilon_of_gdp",
    "mu_estimate",
    "runs_for_power",
]

_MIN_RUNS = 20  # below this the normal approximation of mu_estimate is not trusted


def epsilon_of_gdp(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for a μ-GDP mechanism (Dong, Roth & Su 2019).

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2); infinite μ gives infinite ε.
    """
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"delta must lie in (0, 1), got {delta!r}.")
    if mu <= 0.0:
        return 0.0
    if mu > 100.0:  # ε > 5000 at any δ of interest; e^ε overflows in floating point
        return math.inf
    from scipy import optimize, stats  # here: scipy costs a CLI start half a second

    def excess(epsilon: float) -> float:
        tail = float(stats.norm.cdf(-epsilon / mu + mu / 2))
        # e^ε·Φ(·) in log space: ε reaches hundreds for large μ, where e^ε alone overflows.
        shifted = math.exp(epsilon + float(stats.norm.logcdf(-epsilon / mu - mu / 2)))
        return tail - shifted - delta

    if excess(0.0) <= 0.0:
        return 0.0
    upper = mu * mu / 2 + mu * 10.0  # δ(ε) is far below any δ of interest there
    return float(optimize.brentq(excess, 0.0, upper, xtol=1e-9))


def _clopper_pearson_upper(failures: int, trials: int, alpha: float) -> float:
    if failures >= trials:
        return 1.0
    from scipy import stats  # here: scipy costs a CLI start half a second

    return float(stats.beta.ppf(1 - alpha, failures + 1, trials - failures))


def _threshold_epsilon(fpr: float, fnr: float, delta: float) -> float:
    if fpr <= 0.0:
        return math.inf
    return max(math.log(max(1 - delta - fnr, 1e-300) / fpr), 0.0)


def _best_threshold(without: Float64Array, with_canary: Float64Array, delta: float) -> float:
    """The threshold of the largest empirical ε on the selection half (outputs above: 'in')."""
    candidates = np.unique(np.concatenate([without, with_canary]))
    best, best_epsilon = float(candidates[0]), -1.0
    for threshold in candidates[:: max(1, len(candidates) // 400)]:
        fpr = float(np.mean(without > threshold))
        fnr = float(np.mean(with_canary <= threshold))
        epsilon = _threshold_epsilon(max(fpr, 0.5 / len(without)), fnr, delta)
        if epsilon > best_epsilon:
            best, best_epsilon = float(threshold), epsilon
    return best


def clopper_pearson_epsilon(
    without: Float64Array, with_canary: Float64Array, *, delta: float, confidence: float
) -> float:
    """Non-parametric ε lower bound: threshold from the first half, rates from the second."""
    half0, half1 = len(without) // 2, len(with_canary) // 2
    threshold = _best_threshold(without[:half0], with_canary[:half1], delta)
    test0, test1 = without[half0:], with_canary[half1:]
    alpha = (1 - confidence) / 2  # both rates at once (union bound)
    fpr = _clopper_pearson_upper(int(np.sum(test0 > threshold)), len(test0), alpha)
    fnr = _clopper_pearson_upper(int(np.sum(test1 <= threshold)), len(test1), alpha)
    return _threshold_epsilon(fpr, fnr, delta)


def mu_estimate(
    without: Float64Array, with_canary: Float64Array, confidence: float
) -> tuple[float, float, float]:
    """μ̂ = mean difference / pooled sd, with a normal-approximation confidence interval.

    Var(μ̂) ≈ 1/n₀ + 1/n₁ + μ̂²/(2(n₀ + n₁ − 2)) (difference of means over an estimated sd).
    """
    from scipy import stats  # here: scipy costs a CLI start half a second

    n0, n1 = len(without), len(with_canary)
    difference = float(with_canary.mean() - without.mean())
    pooled = math.sqrt(
        (float(without.var(ddof=1)) * (n0 - 1) + float(with_canary.var(ddof=1)) * (n1 - 1))
        / (n0 + n1 - 2)
    )
    if pooled == 0.0:
        mu = math.inf if difference > 0 else 0.0
        return mu, mu, mu
    mu = difference / pooled
    spread = math.sqrt(1 / n0 + 1 / n1 + mu * mu / (2 * (n0 + n1 - 2)))
    z = float(stats.norm.isf((1 - confidence) / 2))
    return mu, mu - z * spread, mu + z * spread


def _mu_spread(mu: float, runs: int) -> float:
    """Standard error of μ̂ with ``runs`` a side (the variance :func:`mu_estimate` uses)."""
    return math.sqrt(2 / runs + mu * mu / (2 * (2 * runs - 2)))


def detection_power(*, mu_true: float, mu_bar: float, runs: int, confidence: float) -> float:
    """P(μ̂'s lower confidence limit > ``mu_bar``) when the outputs are ``mu_true``-GDP apart.

    Normal approximation of :func:`mu_estimate` with ``runs`` releases a side: the lower limit
    is μ̂ − z·se with z the two-sided ``confidence`` quantile, so the power is
    Φ((mu_true − mu_bar)/se − z), se evaluated at ``mu_true``.

    Raises:
        ConfigError: ``runs`` below 20 or ``confidence`` outside [0.5, 1).
    """
    from scipy import stats  # here: scipy costs a CLI start half a second

    _check_runs_and_confidence(runs, confidence)
    z = float(stats.norm.isf((1 - confidence) / 2))
    return float(stats.norm.cdf((mu_true - mu_bar) / _mu_spread(mu_true, runs) - z))


def runs_for_power(
    *, mu_true: float, mu_bar: float, power: float, confidence: float, max_runs: int = 1_000_000
) -> int | None:
    """The fewest runs a side (>= 20) whose :func:`detection_power` reaches ``power``.

    Returns:
        None when no number of runs up to ``max_runs`` reaches it (always so when
        ``mu_true <= mu_bar``: the bar cannot be cleared more often than by chance).

    Raises:
        ConfigError: ``power`` outside (0, 1), or ``confidence`` outside [0.5, 1).
    """
    if not 0.0 < power < 1.0:
        raise ConfigError(f"power must lie in (0, 1), got {power!r}.")
    _check_runs_and_confidence(_MIN_RUNS, confidence)

    def enough(runs: int) -> bool:
        return (
            detection_power(mu_true=mu_true, mu_bar=mu_bar, runs=runs, confidence=confidence)
            >= power
        )

    if not enough(max_runs):
        return None
    low, high = _MIN_RUNS, max_runs  # power grows with runs: bisect on the smallest that is enough
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle + 1, high)
    return low


def _check_runs_and_confidence(runs: int, confidence: float) -> None:
    if runs < _MIN_RUNS:
        raise ConfigError(f"runs must be >= {_MIN_RUNS} a side, got {runs!r}.")
    if not 0.5 <= confidence < 1.0:
        raise ConfigError(f"confidence must lie in [0.5, 1), got {confidence!r}.")

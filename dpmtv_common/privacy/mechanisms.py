"""The two DP mechanisms of a release, and the clipping that bounds their sensitivity.

Privacy unit and neighbouring relation (design §1): one private example, or one ``group``
of examples when a site states user-level privacy; two datasets are neighbours when one unit
is **replaced** by another and the number of units n is public. Each site cuts its units into
disjoint chunks with a secret shuffle that depends on n alone, so replacing one unit changes
exactly one chunk, and the chunk count m is a public function of n.

* :func:`clip_per_layer` scales, for every layer, the concatenation of that layer's in-scope
  heads to L2 norm ≤ C (float64). A chunk contribution then has norm ≤ C·√L_scope.
* :class:`GaussianSumMechanism` adds one draw of N(0, σ² I) to the sum of clipped chunk
  contributions. Replace-one moves one contribution anywhere in a ball of radius C·√L_scope,
  so Δ₂ = 2·C·√L_scope and σ = z·Δ₂.
* :class:`GumbelTopKMechanism` picks k heads from per-head score sums where every chunk gives
  each head a score in [0, 1] (Δ∞ = 1). Replace-one can raise some scores and lower others
  (not monotone), so the Gumbel scale is β = 2Δ∞/ε₀; each pick is ε₀-bounded-range, the k
  picks are k·ε₀²/8-zCDP (Durfee & Rogers 2019; Cesar & Rogers 2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.noise import NoiseSource

__all__ = [
    "GaussianSumMechanism",
    "GumbelTopKMechanism",
    "clip_per_layer",
    "clip_scores",
    "sum_clipped_contributions",
]


def _check_finite_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be finite and > 0, got {value!r}.")


def clip_per_layer(
    activations: npt.ArrayLike, *, row_layers: npt.ArrayLike, clip_norm: float
) -> Float64Array:
    """Scale each layer's block of rows to L2 norm at most ``clip_norm``.

    Args:
        activations: shape (n_heads, d_head): one row per in-scope head.
        row_layers: shape (n_heads,): the decoder layer of each row; rows of one layer are
            clipped together, as one vector.
        clip_norm: L2 bound C applied to every layer's concatenated heads; it sets the
            Gaussian sensitivity 2·C·√L_scope under replace-one.

    Returns:
        A new float64 array. A block at or below the bound is returned unchanged; a zero
        block stays zero (no division by zero).

    Raises:
        ConfigError: on non-finite input, a shape mismatch, or clip_norm <= 0.
    """
    _check_finite_positive("clip_norm", clip_norm)
    values = np.array(activations, dtype=np.float64)
    layers = np.asarray(row_layers)
    if values.ndim != 2 or layers.shape != (values.shape[0],):
        raise ConfigError(
            f"activations must be (n, d) with row_layers (n,), got {values.shape!r} and "
            f"{layers.shape!r}."
        )
    if not np.all(np.isfinite(values)):
        raise ConfigError("activations must be finite, got NaN or infinity.")
    for layer in np.unique(layers):
        rows = layers == layer
        norm = float(np.linalg.norm(values[rows]))
        if norm > clip_norm:
            values[rows] *= clip_norm / norm
    return values


def clip_scores(scores: npt.ArrayLike) -> Float64Array:
    """Clamp per-head chunk scores into [0, 1], the range that makes Δ∞ = 1."""
    values = np.array(scores, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise ConfigError("scores must be finite, got NaN or infinity.")
    return np.clip(values, 0.0, 1.0)


@dataclass(frozen=True)
class GaussianSumMechanism:
    """One Gaussian draw on a sum of per-layer-clipped chunk contributions.

    Sensitivity: Δ₂ = 2·C·√L_scope (L2 norm, replace-one: one chunk's contribution, of norm
    ≤ C·√L_scope, is replaced by another). Noise: N(0, σ² I) with σ = noise_multiplier·Δ₂,
    drawn once for the whole consortium, never per site. Privacy unit: one example (or one
    group). The mean is the noisy sum divided by the public chunk count m (post-processing).
    Guarantee: the analytic Gaussian (Balle & Wang 2018) at z = noise_multiplier.

    Attributes:
        clip_norm: per-layer L2 bound C.
        num_layers_in_scope: layers with at least one released head (L_scope).
        noise_multiplier: z = σ/Δ₂, from the accountant.
    """

    clip_norm: float
    num_layers_in_scope: int
    noise_multiplier: float

    def __post_init__(self) -> None:
        _check_finite_positive("clip_norm", self.clip_norm)
        _check_finite_positive("noise_multiplier", self.noise_multiplier)
        if self.num_layers_in_scope < 1:
            raise ConfigError(
                f"num_layers_in_scope must be >= 1, got {self.num_layers_in_scope!r}."
            )

    @property
    def l2_sensitivity(self) -> float:
        """Δ₂ = 2·C·√L_scope."""
        return 2.0 * self.clip_norm * math.sqrt(self.num_layers_in_scope)

    @property
    def noise_std(self) -> float:
        """σ = z·Δ₂, the standard deviation of every coordinate's noise."""
        return self.noise_multiplier * self.l2_sensitivity

    def privatize_sum(self, clipped_sum: npt.ArrayLike, *, noise: NoiseSource) -> Float64Array:
        """Return ``clipped_sum + N(0, σ² I)``: the only noise a release ever gets."""
        values = np.asarray(clipped_sum, dtype=np.float64)
        return noise.add_gaussian(values, noise_std=self.noise_std)

    def noisy_mean(
        self, clipped_sum: npt.ArrayLike, *, num_chunks: int, noise: NoiseSource
    ) -> Float64Array:
        """Noisy sum divided by the public chunk count m (m ≥ 1)."""
        if num_chunks < 1:
            raise ConfigError(f"num_chunks must be >= 1, got {num_chunks!r}.")
        return self.privatize_sum(clipped_sum, noise=noise) / float(num_chunks)


@dataclass(frozen=True)
class GumbelTopKMechanism:
    """One-shot Gumbel top-k over summed per-head scores (k rounds of the exponential mechanism).

    Sensitivity: Δ∞ = 1 per head (every chunk scores every head in [0, 1]; replace-one changes
    one chunk). Scores are not monotone under replace-one, so the Gumbel scale is
    β = 2·Δ∞/ε₀. Each pick is ε₀-DP and ε₀-bounded-range; the k picks cost ρ = k·ε₀²/8 zCDP
    (Cesar & Rogers 2021) or k·ε₀ pure DP. Privacy unit: one example (or one group).

    Attributes:
        picks: k, the number of heads selected.
        epsilon_per_pick: ε₀ of each pick.
        score_sensitivity: Δ∞, 1 for scores in [0, 1].
    """

    picks: int
    epsilon_per_pick: float
    score_sensitivity: float = 1.0

    def __post_init__(self) -> None:
        if self.picks < 1:
            raise ConfigError(f"picks must be >= 1, got {self.picks!r}.")
        _check_finite_positive("epsilon_per_pick", self.epsilon_per_pick)
        _check_finite_positive("score_sensitivity", self.score_sensitivity)

    @property
    def gumbel_scale(self) -> float:
        """β = 2·Δ∞/ε₀ (non-monotone scores)."""
        return 2.0 * self.score_sensitivity / self.epsilon_per_pick

    @property
    def zcdp_rho(self) -> float:
        """ρ = k·ε₀²/8."""
        return self.picks * self.epsilon_per_pick**2 / 8.0

    def select(self, score_sums: npt.ArrayLike, *, noise: NoiseSource) -> tuple[int, ...]:
        """Indices of the k selected heads, best first."""
        scores = np.asarray(score_sums, dtype=np.float64)
        return noise.gumbel_top_k(scores, k=self.picks, scale=self.gumbel_scale)


def sum_clipped_contributions(
    contributions: npt.ArrayLike, *, row_layers: npt.ArrayLike, clip_norm: float
) -> Float64Array:
    """Clip every chunk's contribution per layer, then sum them (a site's local work).

    Args:
        contributions: shape (m, n_heads, d_head): one contribution per chunk.
        row_layers: shape (n_heads,): the layer of each head row.
        clip_norm: per-layer L2 bound C.

    Returns:
        The float64 sum, shape (n_heads, d_head); zeros when m = 0.
    """
    chunks = np.asarray(contributions, dtype=np.float64)
    if chunks.ndim != 3:
        raise ConfigError(f"contributions must have shape (m, n, d), got {chunks.shape!r}.")
    total = np.zeros(chunks.shape[1:], dtype=np.float64)
    for chunk in chunks:
        total += clip_per_layer(chunk, row_layers=row_layers, clip_norm=clip_norm)
    return total

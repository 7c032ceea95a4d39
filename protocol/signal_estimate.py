"""Before anything is spent: how much signal a planned release can leave, from public numbers.

A released head is a mean of m clipped chunk activations plus Gaussian noise of σ/m per
coordinate. This module predicts the released vector's signal-to-noise ratio (the same
‖signal‖/‖noise‖ that :class:`protocol.ReleaseOutcome` reports afterwards) from the plan, the
number of chunks m and the model's head shape alone, so that ``dpmtv-site data check`` and
``dpmtv-site release`` can say *before* a budget is reserved that a dataset is too small for
the planned ε. It reads no data: every input is public (m is a function of n and K).

The prediction is an **upper bound** in the usual regime: it assumes the clipping binds
(every layer's in-scope activations have norm ≥ C, so each clipped layer contributes exactly
C, spread evenly over its heads). Activations below C, or a mean that partly cancels across
chunks, only lower the real figure. With ``z`` the Gaussian's noise multiplier (σ = z·Δ₂,
Δ₂ = 2·C·√L_scope), k released heads, H heads a layer, d dims a head:

* select-first (Gaussian on S only, L_S layers): SNR = m / (2·z·√(k·d));
* release-first or all heads (Gaussian on every carried head, L layers): SNR = m / (2·z·√(L·H·d));
  release-first private selection among c public candidate heads: SNR = m / (2·z·√(c·d)).

C cancels: a larger C buys nothing here, which is why the estimate needs no activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpmtv_common.errors import ConfigError
from protocol.calibration import plan_calibration
from protocol.distributed import plan_distributed_calibration
from protocol.plan import NoiseMode, ReleaseOrder, ReleasePlan, SelectionMode

__all__ = ["SignalEstimate", "plan_noise_multiplier", "predict_signal_to_noise"]


@dataclass(frozen=True)
class SignalEstimate:
    """A predicted signal-to-noise ratio and what it rests on.

    Attributes:
        signal_to_noise: The predicted ‖signal‖/‖noise‖ of the released vector (upper bound).
        num_chunks: m, the chunk count it assumes.
        noise_multiplier: z of the Gaussian sum the plan calibrates to.
        coordinates_in_noise: k·d (select-first) or L·H·d (release-first, all): what the
            Gaussian covers, per unit of signal.
    """

    signal_to_noise: float
    num_chunks: int
    noise_multiplier: float
    coordinates_in_noise: int

    def chunks_for(self, target: float) -> int:
        """The m at which the same plan would reach ``target`` (SNR grows linearly in m)."""
        if not target > 0:
            raise ConfigError(f"target must be > 0, got {target!r}.")
        per_chunk = self.signal_to_noise / self.num_chunks
        return math.ceil(target / per_chunk)


def plan_noise_multiplier(plan: ReleasePlan) -> float:
    """Z of the plan's Gaussian: σ = z·Δ₂ on the sum (distributed: the least the plan allows)."""
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        # At exactly t honest shares, the least noise the plan allows: an upper bound on SNR.
        return plan_distributed_calibration(plan).activation_noise_multiplier
    return plan_calibration(plan).noise_multiplier


def predict_signal_to_noise(
    plan: ReleasePlan, *, num_chunks: int, num_layers: int, num_heads: int, head_dim: int
) -> SignalEstimate:
    """Predict the released vector's SNR (an upper bound; module docstring for the formulas).

    Args:
        plan: The release plan (ε, δ, selection, order, k, noise mode).
        num_chunks: m, the chunks the release will sum (public: a function of n and K).
        num_layers: L, the layers that carry heads.
        num_heads: H, heads a layer.
        head_dim: d, dims a head.
    """
    sizes = {"num_chunks": num_chunks, "num_layers": num_layers}
    sizes |= {"num_heads": num_heads, "head_dim": head_dim}
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value!r}.")
    z = plan_noise_multiplier(plan)
    select_first = (
        plan.order is ReleaseOrder.SELECT_FIRST and plan.selection is not SelectionMode.ALL
    )
    if select_first:
        coordinates = min(plan.num_selected_heads, num_layers * num_heads) * head_dim
    elif plan.selection is SelectionMode.PRIVATE and plan.candidate_heads is not None:
        coordinates = len(plan.candidate_heads) * head_dim  # the Gaussian's candidates
    else:
        coordinates = num_layers * num_heads * head_dim
    ratio = num_chunks / (2.0 * z * math.sqrt(coordinates))
    return SignalEstimate(ratio, num_chunks, z, coordinates)

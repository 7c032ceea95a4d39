"""The calibration both sides derive from a plan: a site reserves what the coordinator spends."""

from __future__ import annotations

from dpmtv_common.privacy.calibration import ReleaseCalibration
from protocol.plan import ReleasePlan, SelectionMode

__all__ = ["plan_calibration", "plan_gumbel_scale"]


def plan_calibration(plan: ReleasePlan) -> ReleaseCalibration:
    """Calibrate the plan's mechanisms: k Gumbel picks only in private selection mode."""
    private_picks = plan.num_selected_heads if plan.selection is SelectionMode.PRIVATE else 0
    return ReleaseCalibration.for_budget(
        epsilon=plan.epsilon,
        delta=plan.delta,
        private_picks=private_picks,
        selection_share=plan.selection_share,
    )


def plan_gumbel_scale(plan: ReleasePlan) -> float | None:
    """β of the plan's central Gumbel top-k picks; None when it picks nothing privately.

    For simulating the picks on public data. A distributed plan noises the vote histogram
    with discrete-Gaussian shares instead; its central twin's β stands in for it there.
    """
    if plan.selection is not SelectionMode.PRIVATE:
        return None
    return plan_calibration(plan).gumbel().gumbel_scale

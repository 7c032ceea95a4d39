"""Say before a release whether the planned ε leaves any signal (``data check``, ``release``).

The figures come from :func:`protocol.predict_signal_to_noise`: public inputs only (m from n
and K, the model's head shape, the plan), an upper bound that assumes the clipping binds.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.models import HeadShape
from protocol import (
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    SignalEstimate,
    predict_signal_to_noise,
)

__all__ = ["LOW_SIGNAL_TO_NOISE", "SignalReport", "signal_report"]

LOW_SIGNAL_TO_NOISE = 1.0
"""Below this predicted ratio the released vector is mostly noise: warn (measured on the
embedded models, DP-MTV keeps most of MTV's gain only from a measured SNR of about 1-2)."""


@dataclass(frozen=True)
class SignalReport:
    """The prediction and the lines that explain it."""

    estimate: SignalEstimate
    lines: tuple[str, ...]
    warning: str | None
    order_warning: str | None = None

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every warning, in the order to print them."""
        return tuple(w for w in (self.warning, self.order_warning) if w)


def signal_report(plan: ReleasePlan, *, num_chunks: int, shape: HeadShape) -> SignalReport:
    """Predict the release's SNR at ``num_chunks`` and say what m would be enough."""
    layout = shape.layout()
    sizes = {
        "num_chunks": max(num_chunks, 1),
        "num_layers": len(layout.carried_layers),
        "num_heads": shape.num_heads,
        "head_dim": shape.head_dim,
    }
    estimate = predict_signal_to_noise(plan, **sizes)
    what = (
        f"eps={plan.epsilon:g}, delta={plan.delta:g} per {plan.privacy_unit.value}, "
        f"{plan.selection.value} selection, "
        f"{plan.order.value}, k={plan.num_selected_heads}, {plan.noise_mode.value} noise"
    )
    lines = (
        f"  predicted signal/noise at most {estimate.signal_to_noise:.3g} "
        f"(m = {num_chunks}; {what}; noise multiplier z = {estimate.noise_multiplier:.3g})",
        f"  chunks for signal/noise 1 / 3: m >= {estimate.chunks_for(1.0)} / "
        f"{estimate.chunks_for(3.0)} (the consortium's pooled m counts)",
    )
    warning = None
    if num_chunks < 1 or estimate.signal_to_noise < LOW_SIGNAL_TO_NOISE:
        warning = (
            f"at m = {num_chunks} chunks the released vector would be mostly noise (predicted "
            f"signal/noise at most {estimate.signal_to_noise:.2g} at eps={plan.epsilon:g} per "
            f"{plan.privacy_unit.value}): "
            f"pool more examples (m >= {estimate.chunks_for(1.0)}), raise epsilon, release "
            "fewer heads (--order select-first with public or private heads), or lower --shots."
        )
    return SignalReport(estimate, lines, warning, _order_warning(plan, estimate, sizes))


def _order_warning(
    plan: ReleasePlan, estimate: SignalEstimate, sizes: dict[str, int]
) -> str | None:
    """Public heads released release-first: the same heads, select-first, carry less noise."""
    if plan.selection is not SelectionMode.PUBLIC or plan.order is not ReleaseOrder.RELEASE_FIRST:
        return None
    first = plan.model_copy(update={"order": ReleaseOrder.SELECT_FIRST})
    better = predict_signal_to_noise(first, **sizes).signal_to_noise
    return (
        "--order release-first with public heads noises every layer, though nothing is "
        "selected after the release: select-first (the default for public heads) releases "
        f"the same heads at predicted signal/noise {better:.3g} instead of "
        f"{estimate.signal_to_noise:.3g}; leave --order out (and choose C' for it)."
    )

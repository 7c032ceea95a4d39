"""What a release states and what it reserves: manifest fields and the ledger event.

How this connects: :func:`protocol.release.run_release` produces a :class:`ReleaseOutcome`;
:func:`release_description` turns it and the plan into the artifact manifest's fields, and
:func:`reserve_plan` reserves the plan's calibrated cost (:func:`plan_release_event`) in a
ledger before any data is read.
"""

from __future__ import annotations

from collections.abc import Iterable

from dpmtv_common.artifact import ReleaseDescription
from dpmtv_common.errors import CalibrationError
from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import PrivacyLedger
from protocol.calibration import plan_calibration
from protocol.distributed import plan_distributed_event
from protocol.plan import NoiseMode, ReleasePlan, plan_hash
from protocol.release import DistributedOutcome, ReleaseOutcome
from protocol.version import PROTOCOL_VERSION

__all__ = ["plan_epsilon_bound", "plan_release_event", "release_description", "reserve_plan"]


def release_description(
    plan: ReleasePlan,
    outcome: ReleaseOutcome,
    *,
    prompt_template_sha256: str,
    instruction_sha256: str,
    dpmtv_versions: Iterable[str],
    model_dtype: str | None = None,
) -> ReleaseDescription:
    """The manifest fields of a finished release: plan, privacy spent, m, K, C, σ, layout.

    Every manifest states its noise mode; a distributed one also t, the grid (γ, Δ̃), the
    share's noise multiplier, the survivors and ε if every survivor is honest. Every one also
    states the digest of the chat template all prompts were rendered with, the digest of the
    task instruction they carried, and the dpmtv versions that rendered them
    (``dpmtv_versions``: one per site, repeats allowed).
    """
    parameters = {
        **plan_release_event(plan).to_dict(),
        "noise_mode": plan.noise_mode.value,
        "neighbouring": plan.neighbouring.value,
        "privacy_unit": plan.privacy_unit.value,
        "num_layers_in_scope": outcome.gaussian_heads.num_layers_in_scope,
        "gaussian_heads": len(outcome.gaussian_heads),
        "signal_to_noise": outcome.signal_to_noise,
    }
    if outcome.distributed is not None:
        parameters |= _distributed_parameters(plan, outcome, outcome.distributed)
    bound = outcome.bound
    return ReleaseDescription(
        protocol_version=PROTOCOL_VERSION,
        release_id=plan.release_id,
        model_fingerprint=plan.model_fingerprint,
        task=plan.task,
        plan=plan.model_dump(mode="json"),
        epsilon=bound.epsilon,
        delta=plan.delta,
        accountant=bound.accountant,
        accountant_parameters=parameters,
        num_chunks=outcome.num_chunks,
        shots=plan.shots,
        clip_norm=plan.clip_norm,
        noise_std=outcome.noise_std,
        model_dtype=model_dtype,
        prompt_template_sha256=prompt_template_sha256,
        instruction_sha256=instruction_sha256,
        dpmtv_versions=sorted(set(dpmtv_versions)),
    )


def _distributed_parameters(
    plan: ReleasePlan, outcome: ReleaseOutcome, details: DistributedOutcome
) -> dict[str, object]:
    activations = details.release.activations(outcome.gaussian_heads)
    return {
        "min_honest": plan.min_honest,
        "mechanism": "distributed discrete Gaussian (KLS21), shares sized for min_honest",
        "scale": activations.scale,
        "grid_l2_sensitivity": activations.grid_l2_sensitivity,
        "share_noise_multiplier": activations.noise_multiplier,
        "survivors": details.survivors,
        "epsilon_if_all_survivors_honest": details.bound_if_all_honest.epsilon,
    }


def plan_release_event(plan: ReleasePlan) -> ReleaseEvent:
    """The event a ledger reserves for ``plan`` (its mechanisms at the plan's noise)."""
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        return plan_distributed_event(plan)
    return plan_calibration(plan).event


def plan_epsilon_bound(plan: ReleasePlan) -> EpsilonBound:
    """ε of the plan's calibrated event alone, as ledgers account it; never above the plan's ε.

    The calibration solves for the plan's (ε, δ), so the accounted ε is at most the plan's up
    to float rounding in the accountants. A larger one (a regression in an accountant, or a
    calibration that cannot meet the plan) would make every site spend more than the plan it
    accepted, and more than a per-release cap equal to the plan's ε: refused, fail closed.

    Raises:
        CalibrationError: The accounted ε exceeds the plan's.
    """
    bound = epsilon_bound([plan_release_event(plan)], delta=plan.delta)
    if not bound.epsilon <= plan.epsilon:
        raise CalibrationError(
            f"accounted epsilon must be at most the plan's epsilon={plan.epsilon!r}, got "
            f"{bound.epsilon!r} ({bound.accountant}); this plan cannot be released as stated."
        )
    return bound


def reserve_plan(ledger: PrivacyLedger, plan: ReleasePlan, *, owned_by_run: bool = False) -> None:
    """Reserve the plan's calibrated cost in a ledger (refused with the numbers if over)."""
    event = plan_release_event(plan)
    bound = plan_epsilon_bound(plan)
    ledger.reserve(
        release_id=plan.release_id,
        plan_hash=plan_hash(plan),
        event=event,
        epsilon=bound.epsilon,
        delta=plan.delta,
        accountant=bound.accountant,
        owned_by_run=owned_by_run,
        privacy_unit=plan.privacy_unit.value,
    )

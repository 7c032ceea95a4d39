"""What a site checks before it lets anything of its data move: pure functions, no I/O.

How this connects: :class:`client.release.site.Site` calls one check per message, with the plan the
site accepted (from its own :mod:`client.release.record`) and the site's own settings; a
check raises a typed error and the service turns it into a fixed-text ``ErrorReply``.

* :func:`check_plan` — before any reservation: protocol version, model, trust mode, the
  site's minimum number of sites, its per-release (ε, δ) caps, head counts and public heads
  inside the heads the model carries, and the privacy unit of its data.

"All heads" are the heads the site's model carries (``ModelShape.layout``): a coordinator
asking for a head in a hybrid's headless layer (plan, extract sum, artifact) is refused.
* :func:`check_secure_sum` — before a contribution: a stage the plan has, once, in the plan's
  order, with the plan's clip norm, top-r and head scope (a coordinator asking for a larger
  clip norm, another head set or a second sum gets nothing).
* :func:`check_reference` — the noisy vector of a release-first plan, once.
* :func:`check_artifact` — the signed artifact must be the one this plan produces: same plan
  hash and id, ε and σ recomputed here from the plan, heads and unit as accepted, and (when
  the site holds the noisy vector) the very values it was sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from client.release.record import ReleaseRecord
from client.settings import SiteSettings
from dpmtv_common.aliases import Float64Array, LayerHead
from dpmtv_common.artifact import ArtifactManifest, TaskVectorArtifact
from dpmtv_common.errors import ConfigError, ModelMismatchError, PolicyError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.distributed import DistributedNoise, check_min_honest
from protocol import (
    DistributedRelease,
    NoiseMode,
    PlanMismatchError,
    ReleaseOrder,
    ReleasePlan,
    SecureSumRequest,
    SelectionMode,
    StageOrderError,
    check_candidate_picks,
    check_compatible,
    check_plan_scope,
    gaussian_heads,
    plan_calibration,
)
from protocol.secure_sum import SumRanges

__all__ = [
    "ModelShape",
    "check_artifact",
    "check_plan",
    "check_reference",
    "check_secure_sum",
    "distributed_grid",
    "distributed_release",
    "gaussian_scope",
    "secure_sum_stages",
]


@dataclass(frozen=True)
class ModelShape:
    """The site model's head layout (L, H, the layers that carry heads) and head width D."""

    layout: HeadLayout
    head_dim: int

    @classmethod
    def of_record(cls, record: ReleaseRecord) -> ModelShape:
        """The shape the site accepted the record's plan on."""
        return cls(record.layout, record.head_dim)


_REL_TOLERANCE = 1e-9  # ε and σ are recomputed by the same code: only float noise may differ


def check_plan(
    plan: ReleasePlan,
    *,
    settings: SiteSettings,
    fingerprint: str,
    shape: ModelShape,
    data_unit: str,
) -> None:
    """Refuse a plan this site must not serve; runs before any reservation or data access.

    Raises:
        VersionMismatchError, ModelMismatchError, PolicyError, ConfigError: as the
            check that failed says.
    """
    check_compatible(plan.protocol_version)
    if plan.model_fingerprint != fingerprint:
        raise ModelMismatchError(
            f"plan model_fingerprint must be this site's {fingerprint!r}, "
            f"got {plan.model_fingerprint!r}."
        )
    _check_policy(plan, settings, data_unit)
    _check_heads_fit(plan, shape)
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        _check_distributed(plan, settings, shape)


def _check_distributed(plan: ReleasePlan, settings: SiteSettings, shape: ModelShape) -> None:
    # Shares sized for more honest sites than this site assumes would leave it less noise
    # than its ε needs; and the plan's grids must fit SecAgg+ before anything is reserved.
    check_min_honest(
        plan_min_honest=plan.min_honest,
        site_min_honest=settings.min_honest,
        min_sites=plan.min_sites,
    )
    release = distributed_release(plan, shape)
    release.activations(shape.layout.all_heads())
    release.votes()


def distributed_grid(
    record: ReleaseRecord, request: SecureSumRequest, ranges: SumRanges | None
) -> DistributedNoise | None:
    """The grid of a distributed plan's secure sum, checked against the sum's ranges.

    None in central mode. The site recomputes the grid from the plan and its model shape;
    other ranges would change the quantisation its noise share was sized for.

    Raises:
        PlanMismatchError: The coordinator sent other ranges (c, Q, M).
        StageOrderError: A vote sum in a plan without one.
    """
    plan = record.plan
    if plan.noise_mode is not NoiseMode.DISTRIBUTED:
        return None
    shape = ModelShape.of_record(record)
    release = distributed_release(plan, shape)
    if request.stage == "select":
        grid = release.votes()
    else:
        heads = HeadSet(request.heads) if request.heads is not None else shape.layout.all_heads()
        grid = release.activations(heads)
    if grid is None:  # a select sum without private selection: check_secure_sum refuses
        raise StageOrderError("this plan has no vote sum.")
    expected = (grid.clipping_range, grid.quantization_range, grid.modulus_range)
    got = (
        None
        if ranges is None
        else (ranges.clipping_range, ranges.quantization_range, ranges.modulus_range)
    )
    if got != expected:
        raise PlanMismatchError(
            f"the ranges (c, Q, M) of a distributed sum must be the plan's {expected}, got {got}."
        )
    return grid


def distributed_release(plan: ReleasePlan, shape: ModelShape) -> DistributedRelease:
    """The plan's distributed grids for this site's model shape (votes: dense ``L * H``)."""
    return DistributedRelease(plan, shape.layout.dense_size, shape.head_dim)


def _check_policy(plan: ReleasePlan, settings: SiteSettings, data_unit: str) -> None:
    if plan.noise_mode.value != settings.noise_mode:
        raise PolicyError(
            f"plan noise_mode must be this site's {settings.noise_mode!r}, "
            f"got {plan.noise_mode.value!r}."
        )
    if plan.min_sites < settings.min_sites:
        raise PolicyError(
            f"plan min_sites must be at least this site's minimum {settings.min_sites}, "
            f"got {plan.min_sites}."
        )
    if plan.epsilon > settings.max_release_epsilon or plan.delta > settings.max_release_delta:
        raise PolicyError(
            f"plan (epsilon, delta) must lie within this site's per-release cap "
            f"({settings.max_release_epsilon}, {settings.max_release_delta}), "
            f"got ({plan.epsilon}, {plan.delta})."
        )
    if plan.privacy_unit.value != data_unit:
        raise PolicyError(
            f"plan privacy_unit must be the unit of this site's data {data_unit!r}, "
            f"got {plan.privacy_unit.value!r}."
        )


def _check_heads_fit(plan: ReleasePlan, shape: ModelShape) -> None:
    carried = len(shape.layout.all_heads())
    if plan.selection is not SelectionMode.ALL and plan.num_selected_heads > carried:
        raise ConfigError(
            f"plan num_selected_heads must be at most the model's {carried} heads, "
            f"got {plan.num_selected_heads}."
        )
    check_plan_scope(plan, shape.layout)  # public heads carried; top-r of private votes


def secure_sum_stages(plan: ReleasePlan) -> tuple[str, ...]:
    """The secure sums a plan has, in the order it runs them."""
    if plan.selection is not SelectionMode.PRIVATE:
        return ("extract",)
    if plan.order is ReleaseOrder.SELECT_FIRST:
        return ("select", "extract")
    return ("extract", "select")


def check_secure_sum(record: ReleaseRecord, request: SecureSumRequest) -> None:
    """Refuse a secure sum the accepted plan does not call for, now, exactly as asked.

    Raises:
        StageOrderError: Not a stage of the plan, already contributed, or out of order.
        PlanMismatchError: A field differs from the plan (clip norm, top-r, heads).
    """
    plan = record.plan
    stages = secure_sum_stages(plan)
    if request.stage not in stages:
        raise StageOrderError(
            f"secure sum stage must be one of the plan's {stages}, got {request.stage!r}."
        )
    if request.stage in record.sent:
        raise StageOrderError(
            f"secure sum {request.stage!r} of release {record.release_id!r} must run once; "
            "this site already contributed to it."
        )
    before = stages[: stages.index(request.stage)]
    if any(stage not in record.sent for stage in before):
        raise StageOrderError(
            f"secure sum {request.stage!r} must follow {before}, got it after {record.sent}."
        )
    if request.clip_norm != plan.clip_norm:
        raise PlanMismatchError(
            f"secure sum clip_norm must be the plan's {plan.clip_norm}, got {request.clip_norm}."
        )
    if request.stage == "select":
        _check_select(record, request)
    else:
        _check_extract_heads(record, request)


def _check_select(record: ReleaseRecord, request: SecureSumRequest) -> None:
    plan = record.plan
    if request.score_top_r != plan.score_top_r or request.heads is not None:
        raise PlanMismatchError(
            f"select sum must ask for top-{plan.score_top_r} votes over the plan's heads, "
            f"got top-{request.score_top_r} over {request.heads!r}."
        )
    if plan.order is ReleaseOrder.RELEASE_FIRST and record.reference_sha256 is None:
        raise StageOrderError("select sum of a release-first plan must follow the noisy vector.")


def _check_extract_heads(record: ReleaseRecord, request: SecureSumRequest) -> None:
    plan = record.plan
    layout = record.layout
    fixed = gaussian_heads(plan, layout)
    asked = request.heads
    if fixed is not None:  # the plan fixes the Gaussian's heads before any data is read
        given = layout.all_heads().heads if asked is None else asked
        if given != fixed.heads:
            raise PlanMismatchError(
                f"extract sum of this plan must cover its {len(fixed)} "
                f"{_scope_name(plan)}, got {len(given)} heads."
            )
        return
    if asked is None:
        raise PlanMismatchError("extract sum of this plan must name its heads, got None.")
    layout.check_carried(asked, "extract heads")
    check_candidate_picks(plan, asked, "extract heads")
    if len(asked) != plan.num_selected_heads:
        raise PlanMismatchError(
            f"extract sum must cover the plan's k={plan.num_selected_heads} selected heads, "
            f"got {len(asked)}."
        )


def _scope_name(plan: ReleasePlan) -> str:
    """How the heads a plan fixes for its Gaussian are named in a refusal."""
    if plan.selection is SelectionMode.PUBLIC and plan.order is ReleaseOrder.SELECT_FIRST:
        return "public heads"
    if plan.selection is SelectionMode.PRIVATE and plan.candidate_heads is not None:
        return "candidate heads"
    return "carried heads (every head)"


def check_reference(record: ReleaseRecord, heads: tuple[LayerHead, ...], values: object) -> None:
    """Refuse a noisy vector the plan does not call for, or one of the wrong heads or shape.

    The vector of a release-first private plan covers the plan's Gaussian heads (its
    candidates, or every carried head), placed dense ``(L, H, D)``.

    Raises:
        StageOrderError: Not a release-first private plan, before extract, or a second one.
        PlanMismatchError: Heads or shape differ from the plan's and the site's model.
    """
    plan = record.plan
    if plan.selection is not SelectionMode.PRIVATE or plan.order is not ReleaseOrder.RELEASE_FIRST:
        raise StageOrderError("a noisy vector is only sent in release-first private plans.")
    if "extract" not in record.sent or record.reference_sha256 is not None:
        raise StageOrderError("the noisy vector must come once, after the extract sum.")
    scope = gaussian_scope(record, HeadSet(()))
    if heads != scope.heads:
        raise PlanMismatchError(
            f"noisy vector must cover the plan's {len(scope)} {_scope_name(plan)}, "
            f"got {len(heads)} heads."
        )
    array = np.asarray(values)
    expected = (record.num_layers, record.num_heads, record.head_dim)  # dense, headless too
    if array.shape != expected:
        raise PlanMismatchError(
            f"noisy vector must have shape (L, H, D) = {expected}, got {array.shape}."
        )
    if not np.isfinite(array).all():
        raise PlanMismatchError("noisy vector must be finite, got NaN or infinity.")


def gaussian_scope(record: ReleaseRecord, released: HeadSet) -> HeadSet:
    """The heads the plan's Gaussian draw covered: what its σ was calibrated for.

    The plan's fixed heads (:func:`protocol.gaussian_heads`), else ``released`` (private
    picks made first).
    """
    return gaussian_heads(record.plan, record.layout) or released


def check_artifact(
    record: ReleaseRecord, artifact: TaskVectorArtifact, reference: Float64Array | None
) -> None:
    """Refuse a (validly signed) artifact that is not what the accepted plan produces.

    Raises:
        PlanMismatchError: Any field differs from what the site recomputes from its plan.
    """
    plan, manifest = record.plan, artifact.manifest
    _same("release_id", manifest.release_id, record.release_id)
    _same("plan_hash", manifest.plan_hash, record.plan_hash)
    _same("delta", manifest.delta, plan.delta)
    _same("clip_norm", manifest.clip_norm, plan.clip_norm)
    _same("shots", manifest.shots, plan.shots)
    if manifest.model_dtype is not None:
        _same("model_dtype", manifest.model_dtype, record.model_dtype)
    _check_prompt_digests(record, manifest)
    parameters = manifest.accountant_parameters
    _same("privacy_unit", parameters.get("privacy_unit"), plan.privacy_unit.value)
    _same("neighbouring", parameters.get("neighbouring"), plan.neighbouring.value)
    _check_released_heads(record, artifact.heads)
    scope = gaussian_scope(record, artifact.heads)
    epsilon, sigma = _recomputed_privacy(record, scope)
    _close("epsilon", manifest.epsilon, epsilon)
    _close("noise_std", manifest.noise_std, sigma)
    if "extract" in record.sent and manifest.num_chunks < record.num_chunks:
        raise PlanMismatchError(
            f"artifact num_chunks must count this site's {record.num_chunks} chunks, "
            f"got {manifest.num_chunks}."
        )
    if reference is not None:
        _check_values_match_reference(record, artifact, reference)


def _check_prompt_digests(record: ReleaseRecord, manifest: ArtifactManifest) -> None:
    """The chat template and the instruction the site reported must be the artifact's.

    A record holds None only when written before its field existed; a manifest without a
    digest the record holds is refused too (a coordinator may not drop what pins a prompt).
    """
    if record.prompt_template_sha256 is not None:
        template = manifest.prompt_template_sha256
        _same("prompt_template_sha256", template, record.prompt_template_sha256)
    if record.instruction_sha256 is not None:
        _same("instruction_sha256", manifest.instruction_sha256, record.instruction_sha256)


def _recomputed_privacy(record: ReleaseRecord, scope: HeadSet) -> tuple[float, float]:
    """(ε, σ) the artifact must state, recomputed from the accepted plan alone."""
    plan = record.plan
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        release = distributed_release(plan, ModelShape.of_record(record))
        bound = release.bound(scope, honest_shares=plan.min_honest)
        return bound.epsilon, release.noise_std(scope)
    calibration = plan_calibration(plan)
    sigma = calibration.gaussian(clip_norm=plan.clip_norm, heads=scope).noise_std
    return calibration.bound.epsilon, sigma


def _check_released_heads(record: ReleaseRecord, heads: HeadSet) -> None:
    plan = record.plan
    record.layout.check_carried(heads.heads, "artifact heads")
    if plan.selection is SelectionMode.ALL:
        _same("heads", heads.heads, record.layout.all_heads().heads)
    elif plan.selection is SelectionMode.PUBLIC:
        _same("heads", heads.heads, plan.public_heads)
    else:
        _same("number of heads", len(heads), plan.num_selected_heads)
        check_candidate_picks(plan, heads.heads, "artifact heads")
        if record.extract_heads is not None and plan.order is ReleaseOrder.SELECT_FIRST:
            _same("heads", heads.heads, record.extract_heads)  # the picks it summed


def _check_values_match_reference(
    record: ReleaseRecord, artifact: TaskVectorArtifact, reference: Float64Array
) -> None:
    # Release-first: the artifact's rows must be the noisy vector the site was sent, so a
    # coordinator cannot score against one vector and publish another.
    rows = reference.reshape(-1, record.head_dim)  # dense (L * H, D), headless slots included
    expected = rows[record.layout.dense_indices(artifact.heads)].astype(np.float32)
    if not np.allclose(artifact.values, expected, rtol=1e-6, atol=0.0):
        raise PlanMismatchError(
            "artifact values must be the rows of the noisy vector this site was sent, got others."
        )


def _same(name: str, got: object, expected: object) -> None:
    if got != expected:
        raise PlanMismatchError(
            f"artifact {name} must be the accepted plan's {_short(expected)}, got {_short(got)}."
        )


def _close(name: str, got: float, expected: float) -> None:
    if not math.isclose(got, expected, rel_tol=_REL_TOLERANCE):
        raise PlanMismatchError(
            f"artifact {name} must be {expected!r} as recomputed from the plan, got {got!r}."
        )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:117]}..."

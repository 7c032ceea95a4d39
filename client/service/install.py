"""Install a released artifact into the site service's state, checked as the service checks it.

A federated artifact reaches the service through its release stage, which checks it against
the plan the site accepted (``client.release.policy.check_artifact``). A single-holder artifact
(``dpmtv-site release``), or one copied from elsewhere, has no accepted plan at the site: it
is installed with :func:`install_artifact`, which refuses anything the service would refuse to
serve (the signature of a trusted key, the tensors' hash, this model's fingerprint, dtype and
chat template, heads that exist, finite values of the model's head width) and anything whose
manifest is not what its own signed plan produces (plan hash, id, δ, C, K, unit and relation,
the released heads, ε and σ recomputed from the plan). It never replaces an installed
artifact, and the copy is staged and renamed in, so the service never sees a half-copied one.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from client.release.policy import ModelShape, distributed_release
from client.release.site import Site
from client.service.releases import servable_artifact
from dpmtv_common.artifact import TaskVectorArtifact
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from protocol import (
    NoiseMode,
    PlanMismatchError,
    ReleasePlan,
    SelectionMode,
    check_candidate_picks,
    gaussian_heads,
    plan_calibration,
)

__all__ = ["install_artifact"]

_REL_TOLERANCE = 1e-9  # ε and σ are recomputed by the same code: only float noise may differ


def install_artifact(site: Site, source: Path) -> Path:
    """Check the artifact at ``source`` for this site's service, copy it in; its new folder.

    Raises:
        ConfigError: Not an artifact folder, already installed, or refused by a check (the
            artifact errors of ``dpmtv_common.errors`` for signature, hash and model).
    """
    if not source.is_dir():
        raise ConfigError(f"ARTIFACT must be an artifact folder, got {str(source)!r}.")
    artifact = servable_artifact(site, source)
    check_own_plan(artifact, site.shape())
    release_id = artifact.manifest.release_id
    folder = site.settings.artifacts_folder
    target = folder / release_id  # a token the manifest's plan validated: never a path
    if target.exists() or target.is_symlink():
        raise ConfigError(
            f"release {release_id!r} must not be installed already, got {str(target)!r}; "
            "an installed artifact is never replaced."
        )
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".incoming-", dir=folder) as tmp:
        staged = Path(tmp) / "artifact"
        shutil.copytree(source, staged, symlinks=False)
        servable_artifact(site, staged)  # the copy is what will be served: check it again
        staged.rename(target)
    return target


def check_own_plan(artifact: TaskVectorArtifact, shape: ModelShape) -> None:
    """The manifest must be what its own signed plan produces for this model's shape.

    Raises:
        PlanMismatchError: A field differs from what the plan gives.
    """
    manifest = artifact.manifest
    plan = ReleasePlan.model_validate_json(json.dumps(manifest.plan))  # as it was signed
    _same("release_id", manifest.release_id, plan.release_id)
    _same("model_fingerprint", plan.model_fingerprint, manifest.model_fingerprint)
    _same("delta", manifest.delta, plan.delta)
    _same("clip_norm", manifest.clip_norm, plan.clip_norm)
    _same("shots", manifest.shots, plan.shots)
    parameters = manifest.accountant_parameters
    _same("privacy_unit", parameters.get("privacy_unit"), plan.privacy_unit.value)
    _same("neighbouring", parameters.get("neighbouring"), plan.neighbouring.value)
    scope = _gaussian_scope(plan, shape, artifact.heads)
    epsilon, sigma = _recomputed(plan, shape, scope)
    _close("epsilon", manifest.epsilon, epsilon)
    _close("noise_std", manifest.noise_std, sigma)


def _gaussian_scope(plan: ReleasePlan, shape: ModelShape, released: HeadSet) -> HeadSet:
    """The heads the plan's Gaussian covered, after checking the released heads fit the plan."""
    carried = shape.layout.all_heads()
    shape.layout.check_carried(released.heads, "artifact heads")
    if plan.selection is SelectionMode.ALL:
        _same("heads", released.heads, carried.heads)
        return carried
    if plan.selection is SelectionMode.PUBLIC:
        _same("heads", released.heads, plan.public_heads)
        return gaussian_heads(plan, shape.layout) or released
    _same("number of heads", len(released), plan.num_selected_heads)
    check_candidate_picks(plan, released.heads, "artifact heads")
    return gaussian_heads(plan, shape.layout) or released


def _recomputed(plan: ReleasePlan, shape: ModelShape, scope: HeadSet) -> tuple[float, float]:
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        release = distributed_release(plan, shape)
        bound = release.bound(scope, honest_shares=plan.min_honest)
        return bound.epsilon, release.noise_std(scope)
    calibration = plan_calibration(plan)
    sigma = calibration.gaussian(clip_norm=plan.clip_norm, heads=scope).noise_std
    return calibration.bound.epsilon, sigma


def _same(name: str, got: object, expected: object) -> None:
    if got != expected:
        raise PlanMismatchError(
            f"artifact {name} must be its own plan's {str(expected)[:120]}, got {str(got)[:120]}."
        )


def _close(name: str, got: float, expected: float) -> None:
    if not math.isclose(got, expected, rel_tol=_REL_TOLERANCE):
        raise PlanMismatchError(
            f"artifact {name} must be {expected!r} as recomputed from its plan, got {got!r}."
        )

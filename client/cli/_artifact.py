"""Loading an artifact for a site's model: verified signature, same model, ready to patch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from client.hooks import PatchPolicy
from client.inference import TaskVectorPatch, check_instruction, rescale_heads
from client.models import LoadedModel, prompt_template_digest
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError

__all__ = ["artifact_model", "artifact_patch"]


def artifact_model(
    path: Path, *, loaded: LoadedModel, keys: TrustedKeys, requested: int | None = None
) -> LoadedModel:
    """``loaded`` prompted as the artifact's chunks were: under its ``max_image_crops``.

    Args:
        path: The artifact folder (verified again here: signature, integrity, model).
        loaded: The site's model, its processor as shipped.
        keys: The trusted keys.
        requested: A ``--max-image-crops`` given on the command line, which must then be
            the artifact's (queries prompted otherwise would not match the released heads).

    Raises:
        ConfigError: ``requested`` differs from the artifact's cap, or the processor cannot
            meet it.
    """
    artifact = load_artifact(path, trusted_keys=keys, expected_model_fingerprint=loaded.fingerprint)
    made_with = artifact.manifest.max_image_crops
    if requested is not None and requested != made_with:
        raise ConfigError(
            f"--max-image-crops must be the artifact's {made_with!r} (its chunks were prompted "
            f"under it), got {requested}; leave the option out to use the artifact's."
        )
    return loaded.with_image_crops(made_with)


def artifact_patch(
    path: Path,
    *,
    loaded: LoadedModel,
    keys: TrustedKeys,
    policy: PatchPolicy,
    instruction: str | None,
    rescale_norm: float | None = None,
) -> TaskVectorPatch:
    """Verify the artifact (signature, integrity, model, dtype, chat template, instruction).

    ``instruction`` is the one the queries will be prompted with (the evaluated dataset's,
    or ``--instruction``); it must be the release's. ``rescale_norm`` sets every head's
    vector to that L2 norm (a typical norm measured on public data; post-processing, no
    privacy cost).
    """
    artifact = load_artifact(path, trusted_keys=keys, expected_model_fingerprint=loaded.fingerprint)
    made_in = artifact.manifest.model_dtype
    if made_in is not None and made_in != loaded.dtype_name:
        raise ConfigError(
            f"--dtype must match the artifact's extraction dtype {made_in!r} (its heads were "
            f"read in that precision), got a model loaded in {loaded.dtype_name!r}; pass "
            f"--dtype {made_in}."
        )
    rendered_with = artifact.manifest.prompt_template_sha256
    if rendered_with is not None and rendered_with != prompt_template_digest(loaded):
        raise ConfigError(
            f"the model's chat template must be the one the artifact's prompts were rendered "
            f"with (sha256 {rendered_with}), got sha256 {prompt_template_digest(loaded)}; use "
            "the model directory and dpmtv version (or adapter plugin) the release used."
        )
    check_instruction(
        artifact.manifest,
        instruction,
        remedy="prompt the queries with the release's instruction (its dataset.json "
        "'instruction'; --instruction for infer)",
    )
    values = np.array(artifact.values, dtype=np.float64)
    if rescale_norm is not None:
        values = rescale_heads(values, target_norm=rescale_norm)
    return TaskVectorPatch(artifact.heads, torch.tensor(values, dtype=torch.float32), policy)

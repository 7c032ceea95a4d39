"""Loading an artifact for a site's model: verified signature, same model, ready to patch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from client.hooks import PatchPolicy
from client.inference import TaskVectorPatch, rescale_heads
from client.models import LoadedModel
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError

__all__ = ["artifact_patch"]


def artifact_patch(
    path: Path,
    *,
    loaded: LoadedModel,
    keys: TrustedKeys,
    policy: PatchPolicy,
    rescale_norm: float | None = None,
) -> TaskVectorPatch:
    """Verify the artifact (signature, integrity, model fingerprint) and make its patch.

    ``rescale_norm`` sets every head's vector to that L2 norm (a typical norm measured on
    public data; post-processing, no privacy cost).
    """
    artifact = load_artifact(path, trusted_keys=keys, expected_model_fingerprint=loaded.fingerprint)
    made_in = artifact.manifest.model_dtype
    if made_in is not None and made_in != loaded.dtype_name:
        raise ConfigError(
            f"--dtype must match the artifact's extraction dtype {made_in!r} (its heads were "
            f"read in that precision), got a model loaded in {loaded.dtype_name!r}; pass "
            f"--dtype {made_in}."
        )
    values = np.array(artifact.values, dtype=np.float64)
    if rescale_norm is not None:
        values = rescale_heads(values, target_norm=rescale_norm)
    return TaskVectorPatch(artifact.heads, torch.tensor(values, dtype=torch.float32), policy)

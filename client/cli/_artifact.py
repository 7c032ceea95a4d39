"""Loading an artifact for a site's model: verified signature, same model, ready to patch."""

from __future__ import annotations

from pathlib import Path

import torch

from client.hooks import PatchPolicy
from client.inference import TaskVectorPatch
from client.models import LoadedModel
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys

__all__ = ["artifact_patch"]


def artifact_patch(
    path: Path, *, loaded: LoadedModel, keys: TrustedKeys, policy: PatchPolicy
) -> TaskVectorPatch:
    """Verify the artifact (signature, integrity, model fingerprint) and make its patch."""
    artifact = load_artifact(path, trusted_keys=keys, expected_model_fingerprint=loaded.fingerprint)
    return TaskVectorPatch(artifact.heads, torch.as_tensor(artifact.values.copy()), policy)

"""Signed task-vector artifacts: safetensors tensors, a JSON manifest, an Ed25519 signature."""

from __future__ import annotations

from dpmtv_common.artifact.manifest import (
    FORMAT_VERSION,
    ArtifactManifest,
    ReleaseDescription,
    hash_plan,
    manifest_to_canonical_bytes,
)
from dpmtv_common.artifact.store import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    STALE_AFTER_S,
    TENSORS_FILE,
    StagingCleanup,
    TaskVectorArtifact,
    check_artifact_target,
    clean_stale_staging,
    load_artifact,
    write_artifact,
)

__all__ = [
    "ArtifactManifest",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "ReleaseDescription",
    "SIGNATURE_FILE",
    "STALE_AFTER_S",
    "StagingCleanup",
    "TENSORS_FILE",
    "TaskVectorArtifact",
    "check_artifact_target",
    "clean_stale_staging",
    "hash_plan",
    "load_artifact",
    "manifest_to_canonical_bytes",
    "write_artifact",
]

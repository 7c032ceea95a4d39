"""A small signed task-vector artifact (two heads of 16 values) for the inference tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dpmtv_common.artifact import ReleaseDescription, write_artifact
from dpmtv_common.crypto import SigningKey
from dpmtv_common.heads import HeadSet


def write_signed_artifact(
    folder: Path,
    *,
    release_id: str,
    model_fingerprint: str,
    signing_key: SigningKey,
    protocol_version: str,
    plan: dict[str, Any] | None = None,
    heads: tuple[tuple[int, int], ...] = ((0, 1), (1, 2)),
    values: np.ndarray | None = None,
    **release_fields: Any,
) -> Path:
    """Heads (0, 1) and (1, 2) at 0.1, signed with ``signing_key``, in ``folder / release_id``.

    ``heads`` and ``values`` replace them (an artifact made for another model, say).

    The manifest describes a shapes release of two shots (``plan`` defaults to just that);
    ``release_fields`` sets the manifest's other fields (a digest, say).
    """
    release = ReleaseDescription(
        protocol_version=protocol_version,
        release_id=release_id,
        model_fingerprint=model_fingerprint,
        task="shapes",
        plan={"shots": 2} if plan is None else plan,
        epsilon=1.0,
        delta=1e-5,
        accountant="rdp",
        accountant_parameters={},
        num_chunks=4,
        shots=2,
        clip_norm=1.0,
        noise_std=1.0,
        **release_fields,
    )
    return write_artifact(
        folder / release_id,
        heads=HeadSet.of(list(heads)),
        values=np.full((len(heads), 16), 0.1, dtype=np.float32) if values is None else values,
        release=release,
        signing_key=signing_key,
    )

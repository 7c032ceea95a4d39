"""The artifact records the plan's crop cap; artifacts made before the field still load."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from dpmtv_common.artifact import (
    MANIFEST_FILE,
    ReleaseDescription,
    hash_plan,
    load_artifact,
    manifest_to_canonical_bytes,
    write_artifact,
)
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import BadSignatureError
from dpmtv_common.heads import HeadSet

FINGERPRINT = "sha256:" + "cd" * 32
SIGNER = SigningKey.generate()
HEADS = HeadSet.of([(0, 1), (1, 2)])


def release(plan: dict[str, Any], **changes: Any) -> ReleaseDescription:
    fields: dict[str, Any] = {
        "protocol_version": "1.0",
        "release_id": "r-crops",
        "created": "2025-01-02T03:04:05Z",
        "model_fingerprint": FINGERPRINT,
        "task": "vqa",
        "plan": plan,
        "epsilon": 1.0,
        "delta": 1e-6,
        "accountant": "rdp",
        "accountant_parameters": {"noise_multiplier": 1.1},
        "num_chunks": 8,
        "shots": 4,
        "clip_norm": 1.0,
        "noise_std": 0.5,
        **changes,
    }
    return ReleaseDescription(**fields)


def write(directory: Path, description: ReleaseDescription) -> Path:
    values = np.ones((len(HEADS), 4), dtype=np.float32)
    return write_artifact(
        directory, heads=HEADS, values=values, release=description, signing_key=SIGNER
    )


def load(directory: Path):
    return load_artifact(
        directory,
        trusted_keys=TrustedKeys([SIGNER.verify_key]),
        expected_model_fingerprint=FINGERPRINT,
    )


@pytest.mark.parametrize("cap", [1, 3, 17])
def test_the_cap_is_read_from_the_plan_and_survives_write_and_load(tmp_path, cap):
    description = release({"shots": 4, "max_image_crops": cap})

    loaded = load(write(tmp_path / "a", description))

    assert description.max_image_crops == cap
    assert loaded.manifest.max_image_crops == cap
    assert b'"max_image_crops":%d' % cap in manifest_to_canonical_bytes(loaded.manifest)


def test_a_cap_that_disagrees_with_the_plan_is_refused():
    with pytest.raises(ValidationError, match="max_image_crops must equal the plan's"):
        release({"max_image_crops": 2}, max_image_crops=5)
    with pytest.raises(ValidationError, match="equal the plan's max_image_crops None, got 1"):
        release({"shots": 4}, max_image_crops=1)


def test_an_artifact_written_before_the_field_existed_loads_with_no_cap(tmp_path):
    # Arrange: what an older writer signed and stored: no max_image_crops key anywhere
    path = write(tmp_path / "old", release({"shots": 4}))
    document = json.loads((path / MANIFEST_FILE).read_text())
    for key in ("max_image_crops", "model_dtype"):
        document.pop(key)
    (path / MANIFEST_FILE).write_text(json.dumps(document))

    # Act
    manifest = load(path).manifest

    # Assert
    assert manifest.max_image_crops is None
    assert b"max_image_crops" not in manifest_to_canonical_bytes(manifest)


def test_the_signature_covers_the_cap(tmp_path):
    # Arrange: a relay rewrites the cap (in the plan and the field alike) without re-signing
    path = write(tmp_path / "signed", release({"max_image_crops": 1}))
    document = json.loads((path / MANIFEST_FILE).read_text())
    document["plan"]["max_image_crops"] = 17
    document["max_image_crops"] = 17
    document["plan_hash"] = hash_plan(document["plan"])
    (path / MANIFEST_FILE).write_text(json.dumps(document))

    # Act / Assert
    with pytest.raises(BadSignatureError):
        load(path)

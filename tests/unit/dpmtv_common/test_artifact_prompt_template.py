"""The manifest records the prompt template and instruction digests and the sites' dpmtv
versions, signed."""

import json

import pytest
from pydantic import ValidationError

from dpmtv_common.artifact import MANIFEST_FILE, manifest_to_canonical_bytes
from dpmtv_common.errors import BadSignatureError
from tests.unit.dpmtv_common.test_artifact_image_crops import load, release, write

DIGEST = "ab" * 32
INSTRUCTION = "ef" * 32


def signed_fields() -> dict[str, object]:
    return {
        "prompt_template_sha256": DIGEST,
        "instruction_sha256": INSTRUCTION,
        "dpmtv_versions": ["0.1.0", "0.2.0"],
    }


def test_the_digests_and_versions_survive_write_and_load(tmp_path):
    # Arrange
    description = release({}, **signed_fields())

    # Act
    manifest = load(write(tmp_path / "a", description)).manifest

    # Assert
    assert manifest.prompt_template_sha256 == DIGEST
    assert manifest.instruction_sha256 == INSTRUCTION
    assert manifest.dpmtv_versions == ["0.1.0", "0.2.0"]
    signed = manifest_to_canonical_bytes(manifest)
    assert f'"prompt_template_sha256":"{DIGEST}"'.encode() in signed
    assert f'"instruction_sha256":"{INSTRUCTION}"'.encode() in signed


@pytest.mark.parametrize(
    ("field", "forged"),
    [
        ("prompt_template_sha256", "cd" * 32),
        ("instruction_sha256", "cd" * 32),
        ("instruction_sha256", None),
        ("dpmtv_versions", ["0.1.0"]),
    ],
)
def test_the_signature_covers_the_digests_and_versions(tmp_path, field, forged):
    # Arrange: a relay rewrites the field without re-signing
    signed = release({}, **signed_fields())
    path = write(tmp_path / "signed", signed)
    document = json.loads((path / MANIFEST_FILE).read_text())
    document[field] = forged
    (path / MANIFEST_FILE).write_text(json.dumps(document))

    # Act / Assert
    with pytest.raises(BadSignatureError):
        load(path)


def test_an_artifact_written_before_the_fields_existed_loads_without_them(tmp_path):
    # Arrange: what an older writer signed and stored: neither key anywhere
    path = write(tmp_path / "old", release({}))
    document = json.loads((path / MANIFEST_FILE).read_text())
    for key in ("prompt_template_sha256", "instruction_sha256", "dpmtv_versions"):
        document.pop(key)
    (path / MANIFEST_FILE).write_text(json.dumps(document))

    # Act
    manifest = load(path).manifest

    # Assert
    assert manifest.prompt_template_sha256 is None
    assert manifest.instruction_sha256 is None
    assert manifest.dpmtv_versions is None
    assert b"prompt_template_sha256" not in manifest_to_canonical_bytes(manifest)
    assert b"instruction_sha256" not in manifest_to_canonical_bytes(manifest)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt_template_sha256": "AB" * 32}, "prompt_template_sha256 must be 64 lowercase"),
        ({"prompt_template_sha256": "ab" * 31}, "prompt_template_sha256 must be 64 lowercase"),
        ({"instruction_sha256": "EF" * 32}, "instruction_sha256 must be 64 lowercase"),
        ({"instruction_sha256": ""}, "instruction_sha256 must be 64 lowercase"),
        ({"dpmtv_versions": ["0.2.0", "0.1.0"]}, "dpmtv_versions must be distinct"),
        ({"dpmtv_versions": ["0.1.0", "0.1.0"]}, "dpmtv_versions must be distinct"),
        ({"dpmtv_versions": []}, "dpmtv_versions must be distinct"),
        ({"dpmtv_versions": [" "]}, "dpmtv_versions must be distinct"),
    ],
)
def test_a_malformed_digest_or_version_list_is_refused(changes, message):
    with pytest.raises(ValidationError, match=message):
        release({}, **changes)

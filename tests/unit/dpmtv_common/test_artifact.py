import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dpmtv_common.artifact import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    TENSORS_FILE,
    ArtifactManifest,
    ReleaseDescription,
    TaskVectorArtifact,
    hash_plan,
    load_artifact,
    manifest_to_canonical_bytes,
    write_artifact,
)
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import (
    ArtifactFormatError,
    BadSignatureError,
    ConfigError,
    IntegrityError,
    ModelMismatchError,
    UnknownSigningKeyError,
)
from dpmtv_common.heads import HeadSet

FINGERPRINT = "sha256:" + "ab" * 32
SIGNER = SigningKey.generate()
TRUSTED = TrustedKeys([SIGNER.verify_key])
HEADS = HeadSet.of([(0, 1), (0, 3), (2, 0)])


def make_release(**changes: Any) -> ReleaseDescription:
    fields: dict[str, Any] = {
        "protocol_version": "1.0",
        "release_id": "run-7/vqa",
        "created": "2025-01-02T03:04:05Z",
        "model_fingerprint": FINGERPRINT,
        "task": "vqa",
        "plan": {"heads": [[0, 1], [0, 3], [2, 0]], "num_chunks": 8, "note": "é"},
        "epsilon": 2.0,
        "delta": 1e-6,
        "accountant": "rdp",
        "accountant_parameters": {"noise_multiplier": 1.3, "picks": 3},
        "num_chunks": 8,
        "shots": 4,
        "clip_norm": 1.0,
        "noise_std": 0.65,
    }
    fields.update(changes)
    return ReleaseDescription(**fields)


def make_values(rows: int = 3, d_head: int = 4) -> npt.NDArray[np.float32]:
    return (np.arange(rows * d_head).reshape(rows, d_head) / 7).astype(np.float32)


def write_sample(directory: Path, **kwargs: Any) -> Path:
    arguments: dict[str, Any] = {"heads": HEADS, "values": make_values(), "release": make_release()}
    arguments.update(kwargs)
    return write_artifact(directory, signing_key=SIGNER, **arguments)


def load(
    directory: Path, expected: str | None = FINGERPRINT, trusted: TrustedKeys = TRUSTED
) -> TaskVectorArtifact:
    return load_artifact(directory, trusted_keys=trusted, expected_model_fingerprint=expected)


def resign(directory: Path, document: dict[str, Any], key: SigningKey = SIGNER) -> None:
    """Rewrite the manifest and sign it again, as an attacker holding `key` could."""
    manifest = ArtifactManifest.model_validate(document)
    (directory / MANIFEST_FILE).write_text(json.dumps(document))
    (directory / SIGNATURE_FILE).write_bytes(key.sign(manifest_to_canonical_bytes(manifest)))


def test_round_trip_preserves_heads_values_and_release(tmp_path: Path) -> None:
    # Arrange
    values = make_values()
    release = make_release()
    # Act
    path = write_sample(tmp_path / "art", values=values, release=release)
    artifact = load(path)
    # Assert
    assert artifact.heads == HEADS
    np.testing.assert_array_equal(artifact.values, values)
    assert artifact.values.dtype == np.float32
    assert artifact.manifest.model_dump(include=set(release.model_dump())) == release.model_dump()


def test_written_manifest_derives_layout_hashes_and_key_id(tmp_path: Path) -> None:
    # Act
    path = write_sample(tmp_path / "art", values=make_values(d_head=5))
    manifest = load(path).manifest
    # Assert
    assert (manifest.num_heads, manifest.d_head, manifest.num_layers_in_scope) == (3, 5, 2)
    assert manifest.format_version == 1
    assert manifest.signing_key_id == SIGNER.key_id
    assert manifest.plan_hash == hash_plan(make_release().plan)
    tensors = (path / TENSORS_FILE).read_bytes()
    assert manifest.tensors_sha256 == hashlib.sha256(tensors).hexdigest()


def test_directory_holds_exactly_the_three_files(tmp_path: Path) -> None:
    # Act
    path = write_sample(tmp_path / "art")
    # Assert
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [MANIFEST_FILE, SIGNATURE_FILE, TENSORS_FILE]
    )
    assert len((path / SIGNATURE_FILE).read_bytes()) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_float64_values_are_stored_as_float32(tmp_path: Path) -> None:
    # Arrange
    values = make_values().astype(np.float64)
    # Act
    artifact = load(write_sample(tmp_path / "art", values=values))
    # Assert
    assert artifact.values.dtype == np.float32
    assert not artifact.values.flags.writeable


def test_load_refuses_tampered_tensor_byte(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    data = bytearray((path / TENSORS_FILE).read_bytes())
    data[-1] ^= 0x01
    (path / TENSORS_FILE).write_bytes(bytes(data))
    # Act / Assert
    with pytest.raises(IntegrityError, match="changed after signing"):
        load(path)


def test_load_refuses_modified_manifest_field(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    document = json.loads((path / MANIFEST_FILE).read_text())
    document["epsilon"] = 0.5
    (path / MANIFEST_FILE).write_text(json.dumps(document))
    # Act / Assert
    with pytest.raises(BadSignatureError):
        load(path)


def test_load_accepts_reformatted_manifest_with_same_content(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    document = json.loads((path / MANIFEST_FILE).read_text())
    (path / MANIFEST_FILE).write_text(json.dumps(document, indent=None, ensure_ascii=False))
    # Act
    artifact = load(path)
    # Assert
    assert artifact.manifest.plan["note"] == "é"


def test_load_refuses_key_outside_trusted_keys(tmp_path: Path) -> None:
    # Arrange
    stranger = SigningKey.generate()
    path = write_artifact(
        tmp_path / "art",
        heads=HEADS,
        values=make_values(),
        release=make_release(),
        signing_key=stranger,
    )
    # Act / Assert
    with pytest.raises(UnknownSigningKeyError, match=SIGNER.key_id) as caught:
        load(path)
    assert stranger.key_id in str(caught.value)


def test_load_refuses_trusted_signature_over_other_bytes(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    (path / SIGNATURE_FILE).write_bytes(SIGNER.sign(b"some other message"))
    # Act / Assert
    with pytest.raises(BadSignatureError, match=SIGNER.key_id):
        load(path)


def test_load_refuses_key_id_swapped_to_another_trusted_key(tmp_path: Path) -> None:
    # Arrange
    other = SigningKey.generate()
    path = write_sample(tmp_path / "art")
    document = json.loads((path / MANIFEST_FILE).read_text())
    document["signing_key_id"] = other.key_id
    (path / MANIFEST_FILE).write_text(json.dumps(document))
    trusted = TrustedKeys([SIGNER.verify_key, other.verify_key])
    # Act / Assert
    with pytest.raises(BadSignatureError):
        load(path, trusted=trusted)


def test_load_refuses_wrong_model_fingerprint_and_shows_both(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    other = "sha256:" + "cd" * 32
    # Act / Assert
    with pytest.raises(ModelMismatchError) as caught:
        load(path, expected=other)
    assert other in str(caught.value)
    assert FINGERPRINT in str(caught.value)


def test_load_without_expected_fingerprint_skips_model_check(tmp_path: Path) -> None:
    # Act
    artifact = load(write_sample(tmp_path / "art"), expected=None)
    # Assert
    assert artifact.manifest.model_fingerprint == FINGERPRINT


@pytest.mark.parametrize("name", [MANIFEST_FILE, SIGNATURE_FILE, TENSORS_FILE])
def test_load_refuses_missing_file_and_names_it(tmp_path: Path, name: str) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    (path / name).unlink()
    # Act / Assert
    with pytest.raises(ArtifactFormatError, match=name):
        load(path)


def test_load_refuses_path_that_is_not_a_directory(tmp_path: Path) -> None:
    # Act / Assert
    with pytest.raises(ArtifactFormatError, match="directory"):
        load(tmp_path / "absent")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "must be JSON"),
        (b"\xff\xfe", "must be JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"format_version": 2}', "format_version must be 1, got 2"),
        (b'{"format_version": 1}', "valid manifest"),
    ],
)
def test_load_refuses_garbage_manifest(tmp_path: Path, content: bytes, message: str) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    (path / MANIFEST_FILE).write_bytes(content)
    # Act / Assert
    with pytest.raises(ArtifactFormatError, match=message):
        load(path)


def test_load_refuses_manifest_with_extra_field(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    document = json.loads((path / MANIFEST_FILE).read_text())
    document["comment"] = "unsigned"
    (path / MANIFEST_FILE).write_text(json.dumps(document))
    # Act / Assert
    with pytest.raises(ArtifactFormatError, match="comment"):
        load(path)


def test_load_refuses_signed_manifest_whose_shape_disagrees_with_tensors(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    document = json.loads((path / MANIFEST_FILE).read_text())
    document["d_head"] = 5
    resign(path, document)
    # Act / Assert
    with pytest.raises(ArtifactFormatError, match="'values' must be float32 of shape"):
        load(path)


def test_load_refuses_signed_garbage_tensors_file(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    garbage = b"\x00" * 16
    (path / TENSORS_FILE).write_bytes(garbage)
    document = json.loads((path / MANIFEST_FILE).read_text())
    document["tensors_sha256"] = hashlib.sha256(garbage).hexdigest()
    resign(path, document)
    # Act / Assert
    with pytest.raises(ArtifactFormatError, match="must be safetensors"):
        load(path)


def test_write_refuses_to_overwrite_existing_artifact(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art", values=make_values())
    # Act / Assert
    with pytest.raises(ConfigError, match="overwrite=True"):
        write_sample(path, values=make_values() + 1)
    np.testing.assert_array_equal(load(path).values, make_values())


def test_write_with_overwrite_replaces_artifact(tmp_path: Path) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    # Act
    write_sample(path, values=make_values() + 1, overwrite=True)
    # Assert
    np.testing.assert_array_equal(load(path).values, make_values() + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_overwrite_refuses_directory_with_foreign_files(tmp_path: Path) -> None:
    # Arrange
    target = tmp_path / "home"
    target.mkdir()
    (target / "thesis.tex").write_text("precious")
    # Act / Assert
    with pytest.raises(ConfigError, match=r"thesis\.tex"):
        write_sample(target, overwrite=True)
    assert (target / "thesis.tex").read_text() == "precious"


def test_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange
    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    # Act
    with pytest.raises(OSError, match="disk full"):
        write_sample(tmp_path / "art")
    # Assert
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_old_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange
    path = write_sample(tmp_path / "art")
    real_rename = os.rename

    def rename_failing_to_target(source: Any, destination: Any) -> None:
        if os.fspath(destination) == os.fspath(path.absolute()) and ".tmp-" in os.fspath(source):
            raise OSError("crash mid-swap")
        real_rename(source, destination)

    monkeypatch.setattr(os, "rename", rename_failing_to_target)
    # Act
    with pytest.raises(OSError, match="crash mid-swap"):
        write_sample(path, values=make_values() + 1, overwrite=True)
    # Assert
    monkeypatch.undo()
    np.testing.assert_array_equal(load(path).values, make_values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (np.zeros((2, 4), dtype=np.float32), r"shape \(3, d_head\)"),
        (np.zeros((3, 0), dtype=np.float32), r"shape \(3, d_head\)"),
        (np.zeros((3, 4), dtype=np.int64), "floating dtype"),
        (np.full((3, 4), np.nan, dtype=np.float32), "finite"),
        (np.full((3, 4), 1e39, dtype=np.float64), "finite"),
    ],
)
def test_write_refuses_bad_values(
    tmp_path: Path, values: npt.NDArray[np.generic], message: str
) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match=message):
        write_sample(tmp_path / "art", values=values)
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_empty_head_set(tmp_path: Path) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="at least one head"):
        write_sample(tmp_path / "art", heads=HeadSet(()), values=np.zeros((0, 4), np.float32))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("epsilon", 0.0, "epsilon must be finite and > 0, got 0.0."),
        ("epsilon", float("inf"), "epsilon must be finite and > 0, got inf."),
        ("delta", 1.0, r"delta must lie in \(0, 1\), got 1.0."),
        ("num_chunks", 0, "num_chunks must be >= 1, got 0."),
        ("shots", 0, "shots must be >= 1, got 0."),
        ("clip_norm", -1.0, "clip_norm must be finite and > 0"),
        ("noise_std", 0.0, "noise_std must be finite and > 0"),
        ("task", " ", "task must be a non-empty string"),
        ("created", "2025-01-02T03:04:05", "created must be ISO-8601 in UTC"),
        ("created", "2025-01-02T03:04:05+01:00", "created must be ISO-8601 in UTC"),
        ("plan", {"x": float("nan")}, "plan must hold only JSON values"),
        ("num_chunks", True, "valid integer"),
    ],
)
def test_release_description_rejects_out_of_range_fields(
    field: str, value: object, message: str
) -> None:
    # Act / Assert
    with pytest.raises(ValidationError, match=message):
        make_release(**{field: value})


def test_release_description_defaults_created_to_utc_now() -> None:
    # Arrange
    fields = make_release().model_dump(exclude={"created"})
    # Act
    release = ReleaseDescription(**fields)
    # Assert
    assert release.created.endswith("Z")


def test_manifest_rejects_plan_hash_of_another_plan(tmp_path: Path) -> None:
    # Arrange
    document = json.loads((write_sample(tmp_path / "art") / MANIFEST_FILE).read_text())
    document["plan_hash"] = "0" * 64
    # Act / Assert
    with pytest.raises(ValidationError, match="plan_hash must equal"):
        ArtifactManifest.model_validate(document)


def test_manifest_is_frozen(tmp_path: Path) -> None:
    # Arrange
    manifest = load(write_sample(tmp_path / "art")).manifest
    # Act / Assert
    with pytest.raises(ValidationError):
        manifest.epsilon = 9.0  # type: ignore[misc]


head_sets = st.sets(st.tuples(st.integers(0, 5), st.integers(0, 7)), min_size=1, max_size=6).map(
    HeadSet.of
)


@st.composite
def heads_and_values(
    draw: st.DrawFn,
) -> tuple[HeadSet, npt.NDArray[np.float32]]:
    heads = draw(head_sets)
    d_head = draw(st.integers(1, 5))
    elements = st.floats(-1e6, 1e6, allow_nan=False, width=32)
    rows = draw(
        st.lists(
            st.lists(elements, min_size=d_head, max_size=d_head),
            min_size=len(heads),
            max_size=len(heads),
        )
    )
    return heads, np.array(rows, dtype=np.float32).reshape(len(heads), d_head)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=heads_and_values())
def test_round_trip_holds_for_random_heads_and_values(
    tmp_path: Path, case: tuple[HeadSet, npt.NDArray[np.float32]]
) -> None:
    # Arrange
    heads, values = case
    # Act
    path = write_sample(tmp_path / "art", heads=heads, values=values, overwrite=True)
    artifact = load(path)
    # Assert
    assert artifact.heads == heads
    np.testing.assert_array_equal(artifact.values, values)
    assert artifact.manifest.num_layers_in_scope == heads.num_layers_in_scope

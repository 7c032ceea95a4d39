"""A killed write leaves no hidden staging folder forever: the next write tidies it."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpmtv_common.artifact import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    TENSORS_FILE,
    ReleaseDescription,
    load_artifact,
    write_artifact,
)
from dpmtv_common.artifact.store import STALE_AFTER_S, clean_stale_staging
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.heads import HeadSet

SIGNER = SigningKey.generate()
TRUSTED = TrustedKeys([SIGNER.verify_key])
HEX = "0123456789abcdef"


def release(release_id: str = "r-1") -> ReleaseDescription:
    fields: dict[str, Any] = {
        "protocol_version": "1.0",
        "release_id": release_id,
        "created": "2025-01-02T03:04:05Z",
        "model_fingerprint": "sha256:" + "ab" * 32,
        "task": "vqa",
        "plan": {"note": "test"},
        "epsilon": 1.0,
        "delta": 1e-6,
        "accountant": "rdp",
        "accountant_parameters": {},
        "num_chunks": 4,
        "shots": 2,
        "clip_norm": 1.0,
        "noise_std": 0.5,
    }
    return ReleaseDescription(**fields)


def write(directory: Path, release_id: str = "r-1", **kwargs: Any) -> Path:
    values = np.ones((2, 3), dtype=np.float32)
    heads = HeadSet.of([(0, 0), (1, 2)])
    return write_artifact(
        directory,
        heads=heads,
        values=values,
        release=release(release_id),
        signing_key=SIGNER,
        **kwargs,
    )


def age(path: Path, seconds: float = STALE_AFTER_S + 60) -> None:
    """Make ``path`` look untouched for ``seconds``, as if its writer died that long ago."""
    past = time.time() - seconds
    os.utime(path, (past, past))


def complete_staging(parent: Path, name: str) -> Path:
    """A staging folder holding a whole signed artifact, as a publish killed before its rename."""
    done = write(parent / "source")
    staging = parent / name
    os.rename(done, staging)
    return staging


def test_next_write_deletes_an_incomplete_stale_staging_folder(tmp_path):
    # Arrange: a publish killed while writing its second file
    staging = tmp_path / f".a.tmp-{HEX}"
    staging.mkdir()
    (staging / TENSORS_FILE).write_bytes(b"partial")
    age(staging)

    # Act
    write(tmp_path / "b")

    # Assert
    assert not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_next_write_moves_a_complete_stale_artifact_to_a_visible_folder_and_warns(tmp_path, caplog):
    # Arrange: the only copy of a (possibly paid-for) release, hidden by a killed rename
    staging = complete_staging(tmp_path, f".a.tmp-{HEX}")
    age(staging)

    # Act
    with caplog.at_level(logging.WARNING, logger="dpmtv_common.artifact.store"):
        write(tmp_path / "b", release_id="r-2")

    # Assert: never deleted, no longer hidden, still a valid signed artifact
    recovered = tmp_path / f"a.tmp-{HEX}.recovered"
    assert not staging.exists()
    assert load_artifact(recovered, trusted_keys=TRUSTED, expected_model_fingerprint=None)
    assert str(recovered) in caplog.text


def test_a_site_incoming_folder_is_tidied_by_its_inner_artifact(tmp_path):
    # Arrange: client/release/site.py stages a broadcast artifact in .incoming-XXXX/artifact
    incomplete, complete = tmp_path / ".incoming-k2j4_9", tmp_path / ".incoming-zz81"
    (incomplete / "artifact").mkdir(parents=True)
    (incomplete / "artifact" / MANIFEST_FILE).write_text("{}")
    complete.mkdir()
    os.rename(write(tmp_path / "source"), complete / "artifact")
    for path in (incomplete, complete):
        age(path)

    # Act
    cleanup = clean_stale_staging(tmp_path)

    # Assert
    assert cleanup.removed == (incomplete,)
    assert cleanup.recovered == (tmp_path / "incoming-zz81.recovered",)
    assert load_artifact(
        cleanup.recovered[0], trusted_keys=TRUSTED, expected_model_fingerprint=None
    )
    assert not complete.exists()


def test_a_recent_staging_folder_may_be_a_live_write_and_is_left_alone(tmp_path):
    # Arrange
    staging = tmp_path / f".a.tmp-{HEX}"
    staging.mkdir()
    (staging / SIGNATURE_FILE).write_bytes(b"x")

    # Act
    cleanup = clean_stale_staging(tmp_path)

    # Assert
    assert cleanup.removed == cleanup.recovered == cleanup.kept == ()
    assert staging.is_dir()


@pytest.mark.parametrize(
    "name", [f".a.tmp-{HEX}", ".incoming-abc"], ids=["publish", "site-incoming"]
)
def test_a_stale_staging_folder_with_foreign_files_is_kept(tmp_path, name):
    # Arrange: something dpmtv did not write must never be deleted
    staging = tmp_path / name
    staging.mkdir()
    (staging / "notes.txt").write_text("mine")
    age(staging)

    # Act
    cleanup = clean_stale_staging(tmp_path)

    # Assert
    assert cleanup.kept == (staging,)
    assert (staging / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["a.tmp-0123456789abcdef", ".a.tmp-xyz", ".hidden", "plain"])
def test_folders_not_named_like_staging_are_never_touched(tmp_path, name):
    # Arrange
    folder = tmp_path / name
    folder.mkdir()
    (folder / TENSORS_FILE).write_bytes(b"partial")
    age(folder)

    # Act
    cleanup = clean_stale_staging(tmp_path)

    # Assert
    assert cleanup.removed == cleanup.recovered == cleanup.kept == ()
    assert (folder / TENSORS_FILE).is_file()

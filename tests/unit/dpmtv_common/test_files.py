"""Atomic writes: the new content or the old, with its mode from the start, nothing left over."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dpmtv_common.files import write_atomic


def test_text_and_bytes_replace_the_file_with_the_mode_asked_for(tmp_path: Path) -> None:
    # Arrange
    target = tmp_path / "state.json"
    target.write_text("old")
    # Act
    write_atomic(target, "nouveau ✓")
    text = target.read_text(encoding="utf-8")
    write_atomic(target, b"\x00\x01", mode=0o640)
    # Assert
    assert text == "nouveau ✓"
    assert target.read_bytes() == b"\x00\x01"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [path.name for path in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_write_leaves_the_old_content_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: the rename fails, as on a full or read-only disk
    target = tmp_path / "record.json"
    target.write_text("old")

    def refuse(source: object, destination: object) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    # Act
    with pytest.raises(OSError, match="no space"):
        write_atomic(target, "new")
    # Assert
    assert target.read_text() == "old"
    assert [path.name for path in tmp_path.iterdir()] == ["record.json"]


def test_a_private_file_is_never_readable_by_others_even_under_a_loose_umask(
    tmp_path: Path,
) -> None:
    # Arrange
    previous = os.umask(0)
    try:
        # Act
        write_atomic(tmp_path / "key", b"secret")
    finally:
        os.umask(previous)
    # Assert
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600

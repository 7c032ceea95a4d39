"""Publish a directory of files all at once, or not at all.

Readers must never see half an artifact, so the files are written and fsynced in a hidden
sibling directory that is then renamed into place (a rename within one file system is
atomic). Replacing an existing artifact moves it aside first and puts it back if the new one
cannot be moved in; at no moment does the target path hold a partial artifact.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path

from dpmtv_common.errors import ConfigError

__all__ = [
    "publish_directory",
]


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{secrets.token_hex(8)}")


def _write_staging(staging: Path, files: Mapping[str, bytes]) -> None:
    staging.mkdir()
    for name, data in files.items():
        with (staging / name).open("xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    _fsync_directory(staging)


def _check_replaceable(target: Path, names: frozenset[str], *, overwrite: bool) -> bool:
    """Return whether ``target`` exists; refuse to clobber it unless it is safe and allowed."""
    if not target.exists() and not target.is_symlink():
        return False
    if not overwrite:
        raise ConfigError(
            f"artifact directory must not exist yet, got {str(target)!r}. "
            "Pass overwrite=True to replace it."
        )
    # overwrite=True must never delete a directory that is not an artifact, e.g. a typo'd $HOME.
    if target.is_symlink() or not target.is_dir():
        raise ConfigError(f"artifact path must be a directory to overwrite, got {str(target)!r}.")
    foreign = sorted(entry.name for entry in target.iterdir() if entry.name not in names)
    if foreign:
        raise ConfigError(
            f"a directory to overwrite must hold only artifact files {sorted(names)}, "
            f"got extra entries {foreign!r} in {str(target)!r}."
        )
    return True


def _swap_in(staging: Path, target: Path) -> None:
    """Move ``target`` aside, move ``staging`` in, then delete the old copy."""
    retired = _sibling(target, "old")
    os.rename(target, retired)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(retired, target)
        raise
    shutil.rmtree(retired)


def publish_directory(target: Path, files: Mapping[str, bytes], *, overwrite: bool) -> None:
    """Create directory ``target`` holding exactly ``files`` (name -> content), atomically.

    Raises:
        ConfigError: ``target`` exists and ``overwrite`` is false, or it exists and is not a
            directory holding only files named in ``files``.
    """
    target = target.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    exists = _check_replaceable(target, frozenset(files), overwrite=overwrite)
    staging = _sibling(target, "tmp")
    try:
        _write_staging(staging, files)
        if exists:
            _swap_in(staging, target)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_directory(target.parent)

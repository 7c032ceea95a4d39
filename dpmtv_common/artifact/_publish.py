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
from dpmtv_common.files import fsync_folder

__all__ = [
    "check_replaceable",
    "publish_directory",
]


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{secrets.token_hex(8)}")


def _write_staging(staging: Path, files: Mapping[str, bytes]) -> None:
    staging.mkdir()
    for name, data in files.items():
        with (staging / name).open("xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    fsync_folder(staging)


def check_replaceable(
    target: Path,
    names: frozenset[str],
    *,
    overwrite: bool,
    name: str = "artifact directory",
    remedy: str = "pass overwrite=True to replace it",
) -> bool:
    """Return whether ``target`` exists; refuse to clobber it unless it is safe and allowed.

    ``name`` and ``remedy`` word the errors for the caller (an API argument, a CLI flag).
    """
    if not target.exists() and not target.is_symlink():
        return False
    if not overwrite:
        raise ConfigError(f"{name} must not exist yet, got {str(target)!r} which exists; {remedy}.")
    # overwrite=True must never delete a directory that is not an artifact, e.g. a typo'd $HOME.
    if target.is_symlink() or not target.is_dir():
        raise ConfigError(
            f"{name} must be an artifact folder to replace, got {str(target)!r} which is not a "
            "folder."
        )
    foreign = sorted(entry.name for entry in target.iterdir() if entry.name not in names)
    if foreign:
        raise ConfigError(
            f"{name} must hold only artifact files {sorted(names)} to be replaced, got "
            f"{str(target)!r} holding other entries {foreign!r}: overwriting never deletes "
            "anything else."
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
    exists = check_replaceable(target, frozenset(files), overwrite=overwrite)
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
    fsync_folder(target.parent)

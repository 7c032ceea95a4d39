"""Write a file so that a crash leaves the old content or the new, never a mix.

Every state a site or coordinator keeps on disk (release records, graph-draw logs, status
files, keys, datasets it writes, caches) is written here: into a temporary file beside the
target (same folder, so the rename cannot cross file systems), created with its final mode
from the start (a private key is never readable by others, not even for a moment), flushed
and fsynced, renamed over the target, and the folder fsynced so the rename itself survives a
power cut. The temporary file is removed if anything fails.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["fsync_folder", "write_atomic"]


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o600, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (UTF-8 when text) in one step.

    Args:
        path: The target; its folder must exist.
        data: The whole new content.
        mode: The file's permission bits (applied before any byte is written).
        durable: fsync the file and its folder (False for caches, which only cost time).

    Raises:
        OSError: The folder is not writable or the disk is full; ``path`` is then unchanged.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            os.fchmod(handle.fileno(), mode)  # the umask may have dropped bits asked for
            handle.write(payload)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it, a new file) survive a power cut."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

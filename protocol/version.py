"""The protocol version both sides stamp on every message.

``MAJOR.MINOR``: peers with the same MAJOR interoperate. Message bodies forbid unknown
fields, so any change to a body's fields is a MAJOR bump; a MINOR bump may only add
message kinds (an older peer refuses those with a decode error) or behaviour that does
not change what is on the wire.
"""

from __future__ import annotations

import re
from importlib import metadata

from protocol.errors import VersionMismatchError

__all__ = ["DPMTV_VERSION", "PROTOCOL_VERSION", "check_compatible"]

PROTOCOL_VERSION = "7.0"


def _installed_version() -> str:
    try:
        return metadata.version("dpmtv")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
        return "unknown"


DPMTV_VERSION = _installed_version()
"""The installed dpmtv package version, reported by sites and recorded in manifests.

Informational: two versions may interoperate when their protocol MAJOR agrees; what a
version changes in a prompt is caught by the prompt template digest, not by this string."""

_VERSION_PATTERN = re.compile(r"(\d+)\.(\d+)")


def _major(version: str, *, name: str) -> int:
    match = _VERSION_PATTERN.fullmatch(version)
    if match is None:
        raise VersionMismatchError(f"{name} must be 'MAJOR.MINOR', got {version!r}.")
    return int(match.group(1))


def check_compatible(peer_version: str) -> None:
    """Refuse a peer whose protocol MAJOR version differs from ours.

    Raises:
        VersionMismatchError: ``peer_version`` is malformed or has another MAJOR number.
    """
    if _major(peer_version, name="peer protocol version") != _major(
        PROTOCOL_VERSION, name="local protocol version"
    ):
        raise VersionMismatchError(
            f"peer protocol version must have MAJOR {PROTOCOL_VERSION.split('.')[0]}, "
            f"got {peer_version!r} (local version {PROTOCOL_VERSION!r}); "
            "upgrade the older side."
        )

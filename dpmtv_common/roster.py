"""The consortium roster: the named members whose sites may share a secure sum.

Privacy in both noise modes counts on the other parties of a secure sum being real, distinct
sites: a coordinator that fills a sum with sites it made up (contributing zeros) would learn
the one real site's contribution. A site therefore takes part only in sums whose every
participant proves, with a signature, that it holds the identity key of a distinct member
of the roster the site admin installed.

File (TOML, written by ``dpmtv-site roster make``)::

    consortium = "dermatology-2026"

    [[member]]
    name = "hospital-a"
    identity_key = "<base64 of the raw 32-byte Ed25519 public key>"

The roster is installed by an act of the site admin, never by a message. Its
:attr:`Roster.fingerprint` (SHA-256 of a canonical encoding, member order ignored) is what
the members compare out of band (a call, a signed letter) before each installs the file;
every key advertisement in a release carries it, so sites holding different rosters fail
at once with both fingerprints named. Rotation and leaving are a new roster with a new
fingerprint, installed by every member (docs/deployment.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from types import MappingProxyType

from dpmtv_common.crypto import VerifyKey
from dpmtv_common.errors import BadSignatureError, ConfigError, PolicyError

__all__ = ["MEMBER_NAME_PATTERN", "Roster"]

MEMBER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""A member name: what the site's ``--name`` must be (letters, digits, ``._-``)."""

_NAME = re.compile(MEMBER_NAME_PATTERN)
_FINGERPRINT_DOMAIN = b"dpmtv/roster/v1\n"
_MIN_MEMBERS = 2


@dataclass(frozen=True)
class Roster:
    """A consortium's members: name -> Ed25519 identity key, names and keys distinct.

    Attributes:
        consortium: The consortium's name (part of the fingerprint).
        members: Member name -> identity public key.
    """

    consortium: str
    members: Mapping[str, VerifyKey]

    def __post_init__(self) -> None:
        if not isinstance(self.consortium, str) or not _NAME.fullmatch(self.consortium):
            raise ConfigError(
                f"a roster's consortium must match {MEMBER_NAME_PATTERN}, got {self.consortium!r}."
            )
        bad = [name for name in self.members if not _NAME.fullmatch(name)]
        if bad:
            raise ConfigError(f"roster member names must match {MEMBER_NAME_PATTERN}, got {bad}.")
        if len(self.members) < _MIN_MEMBERS:
            raise ConfigError(
                f"a roster must name at least {_MIN_MEMBERS} members (a sum of one site is "
                f"public), got {len(self.members)}."
            )
        owners: dict[bytes, str] = {}
        for name, key in self.members.items():
            other = owners.setdefault(key.raw_bytes, name)
            if other != name:  # one key for two names would let one site count twice
                raise ConfigError(
                    f"roster members must hold distinct identity keys, got one key for "
                    f"{other!r} and {name!r}."
                )
        object.__setattr__(self, "members", MappingProxyType(dict(self.members)))

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 (hex) of the consortium and its sorted members: compare it out of band.

        Computed once per roster (it is frozen): every advertisement of every sum is compared
        with it, so recomputing it made a sum's checks grow with the cube of the sites.
        """
        lines = [f"{self.consortium}\n".encode()]
        for name in sorted(self.members):
            lines.append(f"{name} {_b64(self.members[name].raw_bytes)}\n".encode())
        return hashlib.sha256(_FINGERPRINT_DOMAIN + b"".join(lines)).hexdigest()

    def identity(self, name: str) -> VerifyKey:
        """The identity key of member ``name``.

        Raises:
            PolicyError: ``name`` is not a member.
        """
        key = self.members.get(name)
        if key is None:
            raise PolicyError(
                f"a secure-sum participant must be a member of roster {self.fingerprint[:16]} "
                f"({len(self.members)} members), got {name!r}."
            )
        return key

    def verify(self, name: str, data: bytes, signature: bytes) -> None:
        """Check that member ``name`` signed ``data``.

        Raises:
            PolicyError: ``name`` is not a member, or the signature does not verify.
        """
        if not _signature_holds(self.identity(name).raw_bytes, data, signature):
            raise PolicyError(
                f"member {name!r} must sign with its roster identity key, got a signature "
                "that does not verify."
            )

    def to_toml(self) -> str:
        """The roster file's text (members sorted by name)."""
        lines = [
            "# dpmtv consortium roster. Compare the fingerprint out of band before installing:",
            f"# {self.fingerprint}",
            f'consortium = "{self.consortium}"',
        ]
        for name in sorted(self.members):
            key = _b64(self.members[name].raw_bytes)
            lines += ["", "[[member]]", f'name = "{name}"', f'identity_key = "{key}"']
        return "\n".join(lines) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> Roster:
        """Read a roster file.

        Raises:
            ConfigError: The file is missing, not TOML, or not a valid roster.
        """
        path = Path(path)
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"the roster file {str(path)!r} must be readable: {exc}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"the roster file {str(path)!r} must be TOML: {exc}") from exc
        return cls.from_document(document, source=str(path))

    @classmethod
    def from_document(cls, document: Mapping[str, object], *, source: str = "roster") -> Roster:
        """Build a roster from parsed TOML (see the module for the layout)."""
        unknown = sorted(set(document) - {"consortium", "member"})
        if unknown:
            raise ConfigError(f"{source} must hold only consortium and member, got {unknown}.")
        entries = document.get("member")
        if not isinstance(entries, list):
            raise ConfigError(
                f"{source} must list [[member]] tables, got {type(entries).__name__}."
            )
        members: dict[str, VerifyKey] = {}
        for index, entry in enumerate(entries):
            name, key = _member(entry, f"{source} member {index}")
            if name in members:
                raise ConfigError(f"{source} must name each member once, got {name!r} twice.")
            members[name] = key
        return cls(str(document.get("consortium", "")), members)


@lru_cache(maxsize=65_536)
def _signature_holds(raw_key: bytes, data: bytes, signature: bytes) -> bool:
    """Ed25519 verification, remembered: a simulated consortium checks each signature once.

    The result is a pure function of its arguments (Ed25519 verification is deterministic),
    so the cache can only save time, never accept what a fresh check would refuse.
    """
    try:
        VerifyKey.from_raw(raw_key).verify(data, signature)
    except BadSignatureError:
        return False
    return True


def _member(entry: object, where: str) -> tuple[str, VerifyKey]:
    if not isinstance(entry, dict) or set(entry) != {"name", "identity_key"}:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ConfigError(f"{where} must hold exactly name and identity_key, got {keys}.")
    name, encoded = entry["name"], entry["identity_key"]
    if not isinstance(name, str) or not isinstance(encoded, str):
        raise ConfigError(f"{where}: name and identity_key must be strings.")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"{where}: identity_key must be base64, got {encoded!r}.") from exc
    try:
        return name, VerifyKey.from_raw(raw)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{where}: identity_key must be an Ed25519 key: {exc}") from exc


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")

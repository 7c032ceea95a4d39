"""One privacy ledger per site, shared by every command and the service, and the others found.

The unit is the site: one ledger composes every release of every data set the site holds,
single-holder and federated alike. Two data sets of one site may describe the same people
(a hospital's scans and its reports), and releases in two ledgers are never composed with each
other, so a ledger per data set could under-count what one person's records have spent; a
ledger per site never does. A site whose data sets are disjoint populations may still keep one
ledger per data set by naming it (``--ledger``); every command then names the others.

The default is ``$XDG_DATA_HOME/dpmtv/site/ledger.sqlite`` (``client.settings``). The site
remembers each ledger it has written in a list under its state folder, so a ledger used once
(``release --ledger FILE``) is found again: a command that would reserve in the default ledger
while another ledger of the site holds counted releases the default lacks is refused, with what
to do (merge it, or name it). A command that names its ledger explicitly is told, not refused.
The old default, ``dpmtv-site-ledger.sqlite`` in the working directory, is looked for too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from client.settings import SiteSettings
from dpmtv_common.errors import LedgerError
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.ledger_files import COUNTED_STATES, read_ledger_file

__all__ = [
    "OLD_DEFAULT_LEDGER",
    "OtherLedger",
    "check_one_ledger",
    "known_ledgers",
    "other_ledgers",
    "remember_ledger",
    "uses_default_ledger",
]

_log = logging.getLogger(__name__)
_REGISTRY_FILE = "ledgers.txt"
OLD_DEFAULT_LEDGER = "dpmtv-site-ledger.sqlite"
"""Where sites kept their ledger before the per-user state folder: the working directory."""


@dataclass(frozen=True)
class OtherLedger:
    """Another ledger of this site, with counted releases the site's ledger does not hold.

    Attributes:
        path: The other ledger.
        missing: Its counted releases that the site's ledger lacks.
        epsilon: Their composition at the other ledger's releases' largest δ (for display).
    """

    path: Path
    missing: tuple[str, ...]
    epsilon: float

    def line(self) -> str:
        """One line for the admin."""
        return (
            f"{self.path}: {len(self.missing)} counted release(s) not in this ledger "
            f"({', '.join(self.missing[:5])}{', ...' if len(self.missing) > 5 else ''}; "
            f"epsilon={self.epsilon:.4g} composed)"
        )


def _registry(settings: SiteSettings) -> Path:
    return settings.state_dir / _REGISTRY_FILE


def known_ledgers(settings: SiteSettings) -> list[Path]:
    """Every ledger this site has written, the old default if it exists, and its own ledger."""
    paths: list[Path] = []
    registry = _registry(settings)
    if registry.is_file():
        lines = registry.read_text(encoding="utf-8").splitlines()
        paths += [Path(line) for line in lines if line.strip()]
    old = Path(OLD_DEFAULT_LEDGER).absolute()
    if old.is_file():
        paths.append(old)
    unique = dict.fromkeys([settings.ledger_file, *paths])
    return list(unique)


def remember_ledger(settings: SiteSettings) -> None:
    """Add the settings' ledger to the site's list of ledgers (once)."""
    registry = _registry(settings)
    ledger = str(settings.ledger_file)
    if registry.is_file() and ledger in registry.read_text(encoding="utf-8").splitlines():
        return
    registry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with registry.open("a", encoding="utf-8") as handle:
        handle.write(ledger + "\n")


def other_ledgers(settings: SiteSettings) -> list[OtherLedger]:
    """The site's other ledgers that hold counted releases its ledger lacks."""
    own = settings.ledger_file
    held = _all_ids(own) if own.is_file() else frozenset()
    found = []
    for path in known_ledgers(settings):
        if path == own or not path.is_file():
            continue
        try:
            other = read_ledger_file(path)
        except LedgerError as exc:  # reported, never silently skipped
            _log.warning("ledger %s could not be read: %s", path, exc)
            found.append(OtherLedger(path, ("unreadable",), float("nan")))
            continue
        counted = [e for e in other.entries if e.state in COUNTED_STATES]
        missing = [e for e in counted if e.release_id not in held]
        if missing:
            delta = max(e.delta for e in missing)
            bound = epsilon_bound([e.event for e in missing], delta=max(delta, 1e-12))
            found.append(OtherLedger(path, tuple(e.release_id for e in missing), bound.epsilon))
    return found


def _all_ids(path: Path) -> frozenset[str]:
    return frozenset(entry.release_id for entry in read_ledger_file(path).entries)


def uses_default_ledger(settings: SiteSettings) -> bool:
    """Whether the settings' ledger is the site's default one (not named explicitly)."""
    return settings.ledger_file == settings.default_ledger_file


def check_one_ledger(settings: SiteSettings, *, remember: bool = True) -> list[str]:
    """Before a reservation: refuse to split the site's budget; the lines to warn with.

    ``remember`` adds the settings' ledger to the site's list (what the commands a site admin
    runs do; an in-process site, in a simulation or a test, only looks).

    Raises:
        LedgerError: The settings use the default ledger while another ledger of the site
            holds counted releases the default lacks (the message says what to do).
    """
    if remember:
        remember_ledger(settings)
    others = other_ledgers(settings)
    if not others:
        return []
    lines = [other.line() for other in others]
    if uses_default_ledger(settings):
        first = others[0].path
        raise LedgerError(
            f"the site's ledger must hold all of its releases, got other ledger(s) with "
            f"releases it lacks: {'; '.join(lines)}. Releases in two ledgers are never composed"
            f" with each other: merge with 'dpmtv-site ledger --merge {first}', or keep using "
            f"that ledger with --ledger {first}."
        )
    return [
        f"this site's other ledger(s) hold releases not composed with {settings.ledger_file}: "
        + "; ".join(lines)
    ]

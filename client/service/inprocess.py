"""An in-process consortium's sites: each a real site service behind a real relay.

The simulation (``scripts/demo``), the benchmarks and the tests run every site in one
process. Each site still goes the deployed way — relay → serialised ``Message`` → service →
serialised reply — only the socket is replaced by a function call, so the service's state
machine and policy are exactly what a deployed site runs.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context

from client.service.relay import RelayApp
from client.service.server import SiteService
from client.settings import SiteSettings
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import ConfigError
from dpmtv_common.roster import Roster

__all__ = [
    "InProcessSites",
    "in_process_sites",
    "names_own_roster",
    "open_in_process_sites",
    "site_settings_for_partition",
    "with_consortium_roster",
]


class _KeysFolder:
    """A private temporary folder, removed by :meth:`remove`, when unreferenced, or at exit."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="dpmtv-roster-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)

    def remove(self) -> None:
        self._finalizer()


@dataclass(frozen=True)
class InProcessSites:
    """The relays (give them to the grid, in node order) and the services behind them.

    ``keys``: the temporary folder of the identity keys and roster made for sites that named
    none (None if every site named its own); it is removed by :meth:`close`, or once neither
    this object nor any of its relays is referenced, or when the interpreter exits.
    """

    relays: list[RelayApp]
    services: list[SiteService]
    keys: _KeysFolder | None = field(default=None, repr=False)

    def close(self) -> None:
        """Stop every service, then remove the keys made for them."""
        for service in self.services:
            service.close()
        if self.keys is not None:
            self.keys.remove()


def site_settings_for_partition(
    partition: int, extra: Mapping[str, Any] | None = None
) -> SiteSettings:
    """Site ``partition``'s settings from ``DPMTV_CLIENT_*`` (``{partition-id}`` filled)."""
    return SiteSettings.from_node_config({"partition-id": partition, **(extra or {})})


def names_own_roster(settings: Sequence[SiteSettings]) -> bool:
    """Whether every site names its roster and identity key (none may name them alone).

    Raises:
        ConfigError: Some sites name a roster and others do not.
    """
    named = [s.roster is not None and s.identity_key is not None for s in settings]
    if any(named) and not all(named):
        raise ConfigError("in-process sites must all name a roster and identity key, or none.")
    return all(named)


def with_consortium_roster(settings: Sequence[SiteSettings], folder: Path) -> list[SiteSettings]:
    """The sites' settings with one roster naming them all and an identity key each.

    For in-process consortia, whose operator holds every site anyway: sites that already
    name a roster and identity key are kept as they are; otherwise every site gets a fresh
    key under ``folder`` (private: the keys are signing keys) and the one roster.

    Raises:
        ConfigError: Some sites name a roster and others do not, or two share a name.
    """
    if names_own_roster(settings):
        return list(settings)
    names = [site.name for site in settings]
    if len(set(names)) != len(names):
        raise ConfigError(f"in-process sites must have distinct names for a roster, got {names}.")
    keys = {name: SigningKey.generate() for name in names}
    roster_file = folder / "roster.toml"
    roster_file.write_text(
        Roster("in-process", {name: key.verify_key for name, key in keys.items()}).to_toml()
    )
    updated = []
    for site in settings:
        identity = keys[site.name].save(folder / f"{site.name}.identity.key")
        updated.append(site.model_copy(update={"roster": roster_file, "identity_key": identity}))
    return updated


def open_in_process_sites(settings: Sequence[SiteSettings]) -> InProcessSites:
    """One service per site (opened, left-open releases resolved) and its relay.

    Sites without a roster get one naming them all (:func:`with_consortium_roster`), in a
    temporary folder that lives as long as the returned sites or their relays
    (:class:`InProcessSites`).
    """
    keys = None
    if not names_own_roster(settings):
        keys = _KeysFolder()
        settings = with_consortium_roster(settings, keys.path)
    services = []
    for site_settings in settings:
        service = SiteService(site_settings)
        service.acquire(exclusive=False)
        services.append(service)
    return InProcessSites([_relay_to(service, keys) for service in services], services, keys)


@contextmanager
def in_process_sites(settings: Sequence[SiteSettings]) -> Iterator[InProcessSites]:
    """:func:`open_in_process_sites`, then a clean stop of every service."""
    sites = open_in_process_sites(settings)
    try:
        yield sites
    finally:
        sites.close()


def _relay_to(service: SiteService, keys: _KeysFolder | None) -> RelayApp:
    def transport(context: Context, payload: bytes) -> bytes:
        _ = keys  # the relay keeps the site's keys folder for as long as it may be called
        return service.handle_bytes(payload)

    return RelayApp(transport)

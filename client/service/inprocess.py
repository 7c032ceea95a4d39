"""An in-process consortium's sites: each a real site service behind a real relay.

The simulation (``scripts/demo``), the benchmarks and the tests run every site in one
process. Each site still goes the deployed way — relay → serialised ``Message`` → service →
serialised reply — only the socket is replaced by a function call, so the service's state
machine and policy are exactly what a deployed site runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flwr.app import Context

from client.relay import RelayApp
from client.service.server import SiteService
from client.settings import SiteSettings

__all__ = [
    "InProcessSites",
    "in_process_sites",
    "open_in_process_sites",
    "site_settings_for_partition",
]


@dataclass(frozen=True)
class InProcessSites:
    """The relays (give them to the grid, in node order) and the services behind them."""

    relays: list[RelayApp]
    services: list[SiteService]


def site_settings_for_partition(
    partition: int, extra: Mapping[str, Any] | None = None
) -> SiteSettings:
    """Site ``partition``'s settings from ``DPMTV_CLIENT_*`` (``{partition-id}`` filled)."""
    return SiteSettings.from_node_config({"partition-id": partition, **(extra or {})})


def open_in_process_sites(settings: Sequence[SiteSettings]) -> InProcessSites:
    """One service per site (opened, left-open releases resolved) and its relay."""
    services = []
    for site_settings in settings:
        service = SiteService(site_settings)
        service.acquire(exclusive=False)
        services.append(service)
    return InProcessSites([_relay_to(service) for service in services], services)


@contextmanager
def in_process_sites(settings: Sequence[SiteSettings]) -> Iterator[InProcessSites]:
    """:func:`open_in_process_sites`, then a clean stop of every service."""
    sites = open_in_process_sites(settings)
    try:
        yield sites
    finally:
        for service in sites.services:
            service.close()


def _relay_to(service: SiteService) -> RelayApp:
    def transport(context: Context, payload: bytes) -> bytes:
        return service.handle_bytes(payload)

    return RelayApp(transport)

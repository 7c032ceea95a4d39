"""The ``ClientApp`` Flower starts at a site: the relay to the site service, nothing else.

Everything that decides about the site's data runs in the site service (``dpmtv-site
serve``), started by the site admin from the installed package; see :mod:`client.service.relay`.
"""

from __future__ import annotations

from client.service.relay import RelayApp

__all__ = ["app"]

app = RelayApp()

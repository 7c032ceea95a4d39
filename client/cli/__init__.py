"""``dpmtv-site``: the commands a site admin runs (release, infer, evaluate, select-heads...)."""

from __future__ import annotations

from client.cli.main import main

__all__ = ["main"]

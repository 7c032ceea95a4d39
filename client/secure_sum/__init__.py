"""A site's side of the secure sums: :class:`SiteSumSession` (see its module)."""

from __future__ import annotations

from client.secure_sum.session import SiteSumSession

__all__ = ["SiteSumSession"]

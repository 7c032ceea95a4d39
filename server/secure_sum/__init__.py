"""The coordinator's side of the secure sums: :class:`SecureSumSession` (see its module)."""

from __future__ import annotations

from server.secure_sum.session import SecureSumSession, SumResult

__all__ = ["SecureSumSession", "SumResult"]

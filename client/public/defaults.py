"""Defaults of the public choices that the command line names before any model loads.

Light on purpose (no torch): ``dpmtv-site select-heads --help`` quotes them.
"""

from __future__ import annotations

__all__ = ["MAX_PUBLIC_QUERIES"]

MAX_PUBLIC_QUERIES = 40
"""Queries a public task keeps by default (:func:`client.public.tasks.public_task`), to score
heads on: what the documented benchmarks measured."""

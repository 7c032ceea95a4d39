"""The one search both accountants calibrate with: a geometric bisection towards more noise.

A noise level that meets a privacy target stays one when the noise grows (a larger z, a
smaller ρ): the met levels form one side of a boundary. Bisecting on the geometric mean
(the levels span orders of magnitude) and always keeping the side that meets the target
means any rounding of the boundary errs towards more noise, never less.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["last_met_level"]


def last_met_level(meets: Callable[[float], bool], met: float, unmet: float, steps: int) -> float:
    """A level next to the boundary between ``met`` (meets the target) and ``unmet``.

    Args:
        meets: Whether a level meets the target; monotone between the two ends.
        met: A positive level that meets it.
        unmet: A positive level that does not.
        steps: Bisection steps; the ratio of the ends shrinks to its 2^-steps-th power.

    Returns:
        A level that meets the target (the ``met`` side of the final bracket).
    """
    for _ in range(steps):
        mid = math.sqrt(met * unmet)
        if meets(mid):
            met = mid
        else:
            unmet = mid
    return met

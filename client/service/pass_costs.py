"""What the model's forward passes cost lately, as the batcher's worker measured them.

How this connects: :class:`~client.service.decoding.BatchStats` records every forward pass
here (:meth:`PassCosts.record`); the batcher reads the estimates to decide whether waiting rows
join the running batch now or wait for it to end (:func:`join_horizon`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["PassCosts", "join_horizon"]

_WEIGHT = 0.2  # of the newest pass in each moving average: a few passes follow a change of load


@dataclass
class PassCosts:
    """Moving averages of a decoding step's seconds, and of a prefill's by its rows.

    Used by one thread (the batcher's worker), so it takes no lock.
    """

    step: float | None = None
    prefills: dict[int, float] = field(default_factory=dict)

    def record(self, rows: int, seconds: float, *, prefill: bool) -> None:
        """Fold one forward pass of ``rows`` rows into the averages."""
        if prefill:
            self.prefills[rows] = _moved(self.prefills.get(rows), seconds)
        else:
            self.step = _moved(self.step, seconds)

    def prefill(self, rows: int) -> float | None:
        """A prefill of ``rows`` rows: measured at that size, else at the nearest one measured."""
        if rows in self.prefills:
            return self.prefills[rows]
        if not self.prefills:
            return None
        nearest = min(self.prefills, key=lambda measured: (abs(measured - rows), measured))
        return self.prefills[nearest]


def _moved(average: float | None, seconds: float) -> float:
    return seconds if average is None else (1 - _WEIGHT) * average + _WEIGHT * seconds


def join_horizon(costs: PassCosts, *, joining: int, running: int, floor: int) -> int:
    """Most steps the running rows may have left for ``joining`` rows to wait for them.

    Joining now costs one prefill pass of the joining rows, during which every row (running
    and joining) waits: ``prefill x (running + joining)`` row-seconds. Waiting instead costs
    each joining row the running rows' remaining steps: ``joining x steps x step``. Waiting is
    cheaper while ``steps <= prefill x (running + joining) / (joining x step)``. It also keeps
    the batch in step: rows that join mid-batch end mid-batch, and when the batch is full the
    next rows join them there, so with a horizon shorter than the split a batch split once
    stays split and pays a prefill per group every cycle after, while waiting brings its groups
    back into one.

    Args:
        costs: The measured pass costs.
        joining: Rows that would join.
        running: Rows running now.
        floor: The horizon when nothing is measured yet, and the least one.
    """
    step, prefill = costs.step, costs.prefill(joining)
    if joining < 1 or running < 1 or not step or prefill is None:
        return floor
    worth = prefill * (running + joining) / (joining * step)
    return max(floor, math.floor(worth))

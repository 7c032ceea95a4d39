"""The stages of one release and the order they may run in (used by both sides).

One run is one release::

    start -> plan -> select  -> extract -> release      (select-first, private selection)
                  -> extract -> select  -> release      (release-first, private selection)
                  -> extract -> release                 (public heads, or all heads)
    any non-terminal stage -> abort

Beyond the transition table, a :class:`StageTracker` refuses a stage that already ran
(a second ``extract`` would be a second noisy output the plan never accounted for) and
``release`` before ``extract`` (there is nothing to release yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from protocol.errors import StageOrderError

__all__ = ["ALLOWED_TRANSITIONS", "Stage", "StageTracker"]


class Stage(StrEnum):
    """One message exchange of a release."""

    PLAN = "plan"
    SELECT = "select"
    EXTRACT = "extract"
    RELEASE = "release"
    ABORT = "abort"


ALLOWED_TRANSITIONS: Mapping[Stage | None, frozenset[Stage]] = {
    None: frozenset({Stage.PLAN}),
    Stage.PLAN: frozenset({Stage.SELECT, Stage.EXTRACT, Stage.ABORT}),
    Stage.SELECT: frozenset({Stage.EXTRACT, Stage.RELEASE, Stage.ABORT}),
    Stage.EXTRACT: frozenset({Stage.SELECT, Stage.RELEASE, Stage.ABORT}),
    Stage.RELEASE: frozenset(),
    Stage.ABORT: frozenset(),
}
"""Successors of each stage; ``None`` is the start. ``release`` and ``abort`` are terminal."""


@dataclass
class StageTracker:
    """The stages one release has run so far; refuses any stage out of order.

    Attributes:
        history: The stages already run, oldest first.
    """

    history: list[Stage] = field(default_factory=list)

    @property
    def current(self) -> Stage | None:
        """The last stage run, or ``None`` before the first."""
        return self.history[-1] if self.history else None

    @property
    def finished(self) -> bool:
        """Whether the release reached ``release`` or ``abort``."""
        return self.current in (Stage.RELEASE, Stage.ABORT)

    def allowed(self) -> frozenset[Stage]:
        """The stages that may run next."""
        candidates = ALLOWED_TRANSITIONS[self.current] - set(self.history)
        if Stage.EXTRACT not in self.history:
            candidates -= {Stage.RELEASE}
        return candidates

    def advance(self, stage: Stage) -> None:
        """Record that ``stage`` runs now.

        Raises:
            StageOrderError: ``stage`` may not follow the current stage.
        """
        allowed = self.allowed()
        if stage not in allowed:
            previous = "start" if self.current is None else self.current.value
            names = ", ".join(sorted(allowed)) or "none (the release is finished)"
            raise StageOrderError(
                f"stage {stage.value} cannot follow {previous}; allowed: {names}."
            )
        self.history.append(stage)

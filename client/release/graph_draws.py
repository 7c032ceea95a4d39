"""How many secure-sum graphs this site helped draw: the bound on a coordinator's re-draws.

A sparse secure-sum graph is drawn from every participant's nonce (``protocol.sum_graph``),
so no one chooses it; but a coordinator that dislikes a draw can abort and start a new
release, which draws again, and every draw is one more chance at the graph's failure
probability (2^-40 a draw). So the site counts the draws it takes part in: one a release (a
site reveals its nonce once a release), and at most ``secagg_max_graph_draws`` in any window
of ``secagg_graph_draw_window_seconds`` (:class:`client.settings.SiteSettings`). Past that,
a nonce is refused until the window moves on; the release aborts and, nothing of the site's
data having left, is refunded.

The log is one JSON file beside the ledger, written atomically and durably *before* the
nonce leaves: a crash between the two counts a draw that may not have happened, never the
reverse.
"""

from __future__ import annotations

import json
from pathlib import Path

from dpmtv_common.errors import LedgerError, PolicyError
from dpmtv_common.files import write_atomic

__all__ = ["GraphDrawLog"]


class GraphDrawLog:
    """The (release id, time) of every graph draw within the window, in one JSON file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def draws_since(self, moment: float) -> list[tuple[str, float]]:
        """The draws recorded after ``moment`` (seconds since the epoch), oldest first."""
        return [(release, when) for release, when in self._read() if when > moment]

    def record(self, release_id: str, *, now: float, limit: int, window_seconds: float) -> None:
        """Count a draw for ``release_id`` now, or refuse it.

        Raises:
            PolicyError: The release drew a graph already, or ``limit`` draws fall within the
                last ``window_seconds``; the message names the setting.
        """
        entries = self._read()
        if any(release == release_id for release, _ in entries):
            raise PolicyError(
                f"a release draws one secure-sum graph at this site, got a second draw for "
                f"{release_id!r}."
            )
        recent = [(release, when) for release, when in entries if when > now - window_seconds]
        if len(recent) >= limit:
            raise PolicyError(
                f"secure-sum graph draws must number at most secagg_max_graph_draws={limit} in "
                f"any {window_seconds:g} s at this site (secagg_graph_draw_window_seconds), got "
                f"{len(recent)} already: a coordinator that aborts to re-draw the graph spends "
                "them. Wait, or raise the setting after checking why releases were aborted."
            )
        self._write([*recent, (release_id, now)])

    def _read(self) -> list[tuple[str, float]]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        try:
            entries = json.loads(text)
            return [(str(release), float(when)) for release, when in entries]
        except (ValueError, TypeError) as exc:
            raise LedgerError(f"graph draw log {self.path} must be valid, got: {exc}") from exc

    def _write(self, entries: list[tuple[str, float]]) -> None:
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self.path, json.dumps([[release, when] for release, when in entries]))

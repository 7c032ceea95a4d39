"""A ``Grid`` that collects replies within ~0.1 s and stops waiting for a dead site in seconds.

How this connects
-----------------
``server.app`` wraps the grid Flower hands the ServerApp in :class:`PromptGrid` and passes
the wrapper to everything: the coordinator's exchanges (``server.messaging``), through which
the secure sums' round trips go too (``server.secure_sum``), all reach
:meth:`PromptGrid.send_and_receive`. Flower 1.42's deployed grid (``HttpGrid``) sleeps 3 s
between pulls in ``send_and_receive`` (``flwr/superlink/grid/http_grid.py``), so every round
trip cost up to 3 s of waiting after the last reply had arrived; this wrapper pulls with
``push_messages``/``pull_messages`` every ``pull_interval`` seconds instead, with the same
timeout semantics (``None``: wait for every reply; otherwise stop after ``timeout`` s and
return what came).

A SIGKILLed SuperNode is reported by the SuperLink only when its heartbeat lapses: Flower
1.42 sends node heartbeats every 17-22 s and marks a node offline 60 s after the last one
(``HEARTBEAT_DEFAULT_INTERVAL`` 30 s, ``HEARTBEAT_PATIENCE`` 2; not configurable), after which
the SuperLink answers its messages with a ``NODE_UNAVAILABLE`` error reply. To lose seconds
rather than that minute, :class:`StragglerPolicy` stops waiting for the missing sites once
at least one site has answered and the silence since the last reply exceeds
``max(min_grace, factor x time the answering sites took)``. A live site dropped this way is
only left out of the release (the secure sum cancels its masks; it resolves its own reservation by
its state machine), never counted twice; the factor leaves slow sites with proportionally
more time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flwr.app import Message
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid

from dpmtv_common.errors import ConfigError
from server._delegating_grid import DelegatingGrid

__all__ = ["PromptGrid", "StragglerPolicy", "site_label"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StragglerPolicy:
    """When to stop waiting for sites that have not answered while the others have.

    Attributes:
        min_grace: Seconds of silence, after the last reply, always granted to the missing.
        factor: The missing also get ``factor`` times the seconds the answering sites took
            (a collect stage that took 60 s at the fast sites waits 60·factor s more).
    """

    min_grace: float = 5.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        for name in ("min_grace", "factor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}.")

    def gives_up(self, *, answered_after: float, silent_for: float) -> bool:
        """Whether sites still silent ``silent_for`` s after the last reply are given up."""
        return silent_for > max(self.min_grace, self.factor * answered_after)


class PromptGrid(DelegatingGrid):
    """Delegates to Flower's grid; ``send_and_receive`` pulls often and skips dead sites.

    Args:
        inner: The grid Flower gave the ServerApp.
        pull_interval: Seconds between pulls while replies are missing.
        stragglers: When to give up on sites that stay silent while the others answered;
            None waits for every site until the timeout (Flower's behaviour).
        clock: Monotonic seconds (injected in tests).
        sleep: How to wait (injected in tests).
    """

    def __init__(
        self,
        inner: Grid,
        *,
        pull_interval: float = 0.1,
        stragglers: StragglerPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(pull_interval, int | float) or not 0 < pull_interval <= 3:
            raise ConfigError(f"pull_interval must be in (0, 3] seconds, got {pull_interval!r}.")
        super().__init__(inner)
        self.pull_interval = float(pull_interval)
        self.stragglers = stragglers
        self._clock = clock
        self._sleep = sleep
        self._names: dict[int, str] = {}

    # -- ours -----------------------------------------------------------------------------

    def get_nodes(self) -> Iterable[NodeInfo]:
        """Node records, including the name each site registered with (delegated)."""
        nodes = list(self.inner.get_nodes())
        self._names.update({node.node_id: node.name for node in nodes if node.name})
        return nodes

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages``; pull replies every ``pull_interval`` s until all came or time ran out.

        Same contract as Flower's: ``timeout=None`` waits for every reply; otherwise the
        replies received within ``timeout`` seconds are returned. With a straggler policy,
        the wait also ends when the sites still missing are given up (see the module).
        """
        sent = list(messages)
        try:
            message_ids = list(self.push_messages(sent))
        except NotImplementedError:  # a synchronous in-process grid: nothing to poll
            return self.inner.send_and_receive(sent, timeout=timeout)
        destinations = {}
        pending: set[str] = set()
        for message, message_id in zip(sent, message_ids, strict=True):
            if message_id:  # None: Flower refused that message (already logged by Flower)
                pending.add(message_id)
                destinations[message_id] = message.metadata.dst_node_id
        started = self._clock()
        end = None if timeout is None else started + timeout
        replies: list[Message] = []
        last_reply = started
        while pending and (end is None or self._clock() < end):
            pulled = list(self.pull_messages(pending))
            now = self._clock()
            if pulled:
                replies.extend(pulled)
                pending.difference_update(m.metadata.reply_to_message_id for m in pulled)
                last_reply = now
            if pending and replies and self._give_up(started, last_reply, now):
                missing = sorted(site_label(self, destinations[m]) for m in pending)
                _log.warning(
                    "gave up on %s: silent %.1f s after the other sites answered (in %.1f s)",
                    ", ".join(missing),
                    now - last_reply,
                    last_reply - started,
                )
                break
            if pending:
                self._sleep(self.pull_interval)
        return replies

    def _give_up(self, started: float, last_reply: float, now: float) -> bool:
        if self.stragglers is None:
            return False
        return self.stragglers.gives_up(
            answered_after=last_reply - started, silent_for=now - last_reply
        )

    def site_name(self, node_id: int) -> str | None:
        """The name ``node_id`` registered with (``flwr supernode register --name``), if any."""
        if node_id not in self._names:
            try:
                self.get_nodes()
            except Exception:  # naming is cosmetic: a failed lookup must not stop a release
                _log.debug("node names could not be read", exc_info=True)
        return self._names.get(node_id)


def site_label(grid: Grid, node_id: int) -> str:
    """``name (node id)`` when ``grid`` knows the site's registered name, else the node id."""
    name = grid.site_name(node_id) if isinstance(grid, PromptGrid) else None
    return f"{name} ({node_id})" if name else str(node_id)

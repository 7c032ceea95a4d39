"""A stock Flower app with a no-op ClientApp: Flower's own cost of one message at a site.

The ServerApp sends ``rounds`` round trips of an empty ``query`` message to every connected
SuperNode and pulls the replies every 0.1 s (as the release's coordinator does, so the two are
compared at the same pull interval); the ClientApp answers at once. What a message costs here
is the SuperNode's idle poll, the SuperExec starting a ``flwr-clientapp`` process, and the
SuperLink's bookkeeping: the floor no app on Flower 1.42 goes below. It imports nothing of
dpmtv, so it measures Flower alone.
"""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

_log = logging.getLogger("flwr")
_PULL_INTERVAL = 0.1
_NODE_WAIT = 120.0

server = ServerApp()
client = ClientApp()


@client.query()
def answer(message: Message, context: Context) -> Message:
    """Reply at once, with an empty record."""
    return Message(RecordDict(), reply_to=message)


@server.main()
def round_trips(grid: Grid, context: Context) -> None:
    """``rounds`` round trips to every site; log the seconds they took."""
    rounds = int(context.run_config["rounds"])
    expected = int(context.run_config["expected-sites"])
    nodes = _wait_for_nodes(grid, expected)
    started = time.monotonic()
    for index in range(rounds):
        content = RecordDict({"round": ConfigRecord({"index": index})})
        sent = [Message(content, node, "query") for node in nodes]
        _collect(grid, list(grid.push_messages(sent)))
    seconds = time.monotonic() - started
    _log.info(
        "floor seconds: %.1f for %d round trips to %d sites (%.2f s a round trip)",
        seconds,
        rounds,
        len(nodes),
        seconds / max(rounds, 1),
    )


def _wait_for_nodes(grid: Grid, expected: int) -> list[int]:
    deadline = time.monotonic() + _NODE_WAIT
    nodes = list(grid.get_node_ids())
    while len(nodes) < expected and time.monotonic() < deadline:
        time.sleep(_PULL_INTERVAL)
        nodes = list(grid.get_node_ids())
    if len(nodes) < expected:
        raise RuntimeError(
            f"{expected} SuperNodes must connect within {_NODE_WAIT:g} s, got {len(nodes)}."
        )
    return nodes


def _collect(grid: Grid, message_ids: list[str]) -> None:
    pending = set(message_ids)
    while pending:
        for reply in grid.pull_messages(list(pending)):
            pending.discard(reply.metadata.reply_to_message_id)
        if pending:
            time.sleep(_PULL_INTERVAL)

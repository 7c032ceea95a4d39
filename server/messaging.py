"""Plain (non-secure) exchanges with the sites: one message per site, replies by site.

Sites are logged by the name they registered with (``flwr supernode register --name``) when
the grid is a :class:`server.prompt_grid.PromptGrid`, which reads it from the SuperLink.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import DpmtvError
from protocol import WireMessage, expect, message_to_record, with_array
from server.prompt_grid import site_label

__all__ = ["Exchange", "Replies"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replies:
    """What came back: decoded answers (and their records), and why the others gave none."""

    answers: dict[int, WireMessage]
    failures: dict[int, str]
    records: dict[int, RecordDict] = field(default_factory=dict)


@dataclass
class Exchange:
    """Sends ``query.<action>`` messages through the grid and decodes the replies."""

    grid: Grid
    timeout: float

    def send(
        self,
        action: str,
        contents: Mapping[int, RecordDict],
        expected: type[WireMessage],
        group_id: str,
    ) -> Replies:
        """Send one record to each site and decode every reply as ``expected``."""
        messages = [
            self.grid.create_message(content, f"query.{action}", node_id, group_id)
            for node_id, content in contents.items()
        ]
        replies = self.grid.send_and_receive(messages, timeout=self.timeout)
        # An error the SuperLink makes for a lost site (node unavailable) comes from the
        # SuperLink's own node id: name the site by the message it answers instead.
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
        answers: dict[int, WireMessage] = {}
        records: dict[int, RecordDict] = {}
        failures = {node_id: "no reply before the timeout" for node_id in contents}
        for reply in replies:
            node_id = reply.metadata.src_node_id
            if node_id not in contents:
                node_id = sent_to.get(reply.metadata.reply_to_message_id, node_id)
            failures.pop(node_id, None)
            outcome = _decode(reply, expected)
            if isinstance(outcome, str):
                failures[node_id] = outcome
                _log.warning(
                    "site %s: %s failed: %s", site_label(self.grid, node_id), action, outcome
                )
            else:
                answers[node_id] = outcome
                records[node_id] = reply.content
        return Replies(answers, failures, records)

    def broadcast(
        self,
        action: str,
        message: WireMessage,
        node_ids: Iterable[int],
        expected: type[WireMessage],
        group_id: str,
        arrays: Mapping[str, Float64Array] | None = None,
    ) -> Replies:
        """Send the same message to every site, with ``arrays`` (key: flat float64) beside it."""

        def record() -> RecordDict:
            content = message_to_record(message)
            for key, values in (arrays or {}).items():
                with_array(content, key, values)
            return content

        return self.send(action, {n: record() for n in node_ids}, expected, group_id)


def _decode(reply: Message, expected: type[WireMessage]) -> WireMessage | str:
    if reply.has_error():
        return f"site error: {reply.error.reason}"
    try:
        return expect(reply.content, expected)
    except DpmtvError as exc:
        return str(exc)

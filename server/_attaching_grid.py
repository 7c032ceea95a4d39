"""A grid that adds one record to every message it sends and keeps that record of the replies.

``server.secagg.SecureSumRound.setup`` runs Flower's SecAgg+ setup stage through it, so the
stage's one message a site also carries the release plan, and each site's reply also carries
its answer (``PlanAccept`` or nothing): the plan costs no round trip of its own. Flower reads
only its own record (``secaggplus``) of those messages and replies; ours travels beside it.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from server._delegating_grid import DelegatingGrid

__all__ = ["AttachingGrid"]


class AttachingGrid(DelegatingGrid):
    """Delegates to ``inner``; ``send_and_receive`` adds ``record`` under ``key`` to each message.

    Attributes:
        replies: Per site that answered without an error, its reply's record under ``key``
            (None when the reply carried none).
        errors: Per site that answered with an error (a refusal), the error's reason.
    """

    def __init__(self, inner: Grid, key: str, record: ConfigRecord) -> None:
        super().__init__(inner)
        self.key = key
        self.record = record
        self.replies: dict[int, ConfigRecord | None] = {}
        self.errors: dict[int, str] = {}

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send ``messages`` with the record attached; keep the replies' records."""
        attached = [_with_record(message, self.key, self.record) for message in messages]
        replies = list(self.inner.send_and_receive(attached, timeout=timeout))
        # An error the SuperLink makes for a lost site comes from the SuperLink's own node
        # id: name the site by the message it answers.
        destinations = {m.metadata.dst_node_id for m in attached}
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in attached}
        sent_to.pop("", None)  # a grid that sets ids on its own copies leaves ours empty
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in destinations:
                node = sent_to.get(reply.metadata.reply_to_message_id, node)
            if reply.has_error():
                self.errors[node] = f"site error: {reply.error.reason}"
            else:
                self.replies[node] = reply.content.config_records.get(self.key)
        return replies


def _with_record(message: Message, key: str, record: ConfigRecord) -> Message:
    # A new content per message: Flower hands every site the same RecordDict object.
    content = RecordDict({name: value for name, value in message.content.items()})
    content[key] = record
    return Message(
        content,
        message.metadata.dst_node_id,
        message.metadata.message_type,
        ttl=message.metadata.ttl,
        group_id=message.metadata.group_id,
    )

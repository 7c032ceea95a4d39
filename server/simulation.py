"""An in-process consortium: the real ServerApp logic meets real ``ClientApp`` sites.

``InProcessGrid`` hands every message to a ``ClientApp`` object in this process, with no Ray,
sockets or SuperLink (notes/flower.md §2.7): the simulated consortium of the demo, the
benchmarks and the integration tests. Each node may have its own ``ClientApp`` (a site's relay
bound to that site's service). It behaves like the wire where it matters:

* every message and reply is copied record by record (the coordinator sends one
  ``RecordDict`` object to many nodes): each side gets its own records and lists, while
  the immutable values (bytes, numbers, ``Array`` payloads) are shared rather than
  deep-copied, which cost more than the protocol's own work once consortia reached a
  hundred sites;
* each node has its own ``Context``, committed only when its ``ClientApp`` returns (as a
  SuperNode keeps its state when a ClientApp raises), copied the same way;
* an exception in the ``ClientApp`` becomes an error reply with Flower's reason format;
* ``drops`` silences a node at chosen message types (``query.sum_shares``...): the message
  gets no reply, as when a site times out.

Every reply is kept in ``replies`` as ``(node_id, stage, reply)`` for inspection.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

RUN_ID = 1
SERVER_NODE_ID = 0
FIRST_NODE_ID = 1000


def set_task_identity() -> None:
    """Set the process identity ``Message(...)`` needs outside a Flower process."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SERVER_NODE_ID, 1


def make_server_context(
    run_config: Mapping[str, bool | float | int | str] | None = None,
) -> Context:
    """Return a ServerApp ``Context`` for ``RUN_ID``."""
    return Context(
        run_id=RUN_ID,
        node_id=SERVER_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=dict(run_config or {}),
    )


class InProcessGrid(Grid):
    """A ``Grid`` whose nodes are one in-process ``ClientApp`` with per-node contexts."""

    def __init__(
        self,
        client_app: ClientApp | Sequence[Callable[[Message, Context], Message]],
        *,
        num_nodes: int,
        run_config: Mapping[str, bool | float | int | str] | None = None,
        drops: Mapping[int, Collection[str]] | None = None,
        node_configs: Sequence[Mapping[str, bool | float | int | str]] | None = None,
    ) -> None:
        """Create ``num_nodes`` sites; ``node_configs[i]`` adds to site i's node config.

        ``client_app`` is one app for every node, or one app per node (in node order).
        """
        set_task_identity()
        self._run = Run.create_empty(run_id=RUN_ID)
        self.node_ids = [FIRST_NODE_ID + index for index in range(num_nodes)]
        apps = [client_app] * num_nodes if isinstance(client_app, ClientApp) else client_app
        if len(apps) != num_nodes:
            raise ValueError(f"client_app must hold {num_nodes} apps, got {len(apps)}.")
        self.apps = dict(zip(self.node_ids, apps, strict=True))
        self.contexts = {
            node_id: Context(
                run_id=RUN_ID,
                node_id=node_id,
                node_config={
                    "partition-id": index,
                    "num-partitions": num_nodes,
                    **(node_configs[index] if node_configs else {}),
                },
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for index, node_id in enumerate(self.node_ids)
        }
        self.drops: dict[int, set[str]] = {k: set(v) for k, v in (drops or {}).items()}
        self.replies: list[tuple[int, str, Message]] = []

    def set_run(self, run: Run) -> None:
        """Replace the run this grid reports."""
        self._run = run

    @property
    def run(self) -> Run:
        """The (empty) run all messages belong to."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create an instruction message from the server node."""
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl
        )

    def get_node_ids(self) -> list[int]:
        """Return every node id, dropped or not."""
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Not supported: use ``send_and_receive``."""
        raise NotImplementedError("LoopbackGrid only implements send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Not supported: use ``send_and_receive``."""
        raise NotImplementedError("LoopbackGrid only implements send_and_receive")

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        """Deliver each message in turn; return the replies of the nodes that did not drop."""
        replies = []
        for message in messages:
            reply = self._deliver(message)
            if reply is not None:
                replies.append(reply)
        return replies

    def _deliver(self, message: Message) -> Message | None:
        sent = _copy_message(message)
        sent.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # the SuperLink's job
        node_id = sent.metadata.dst_node_id
        stage = _stage_of(sent)
        if stage in self.drops.get(node_id, set()):
            return None
        context = _copy_context(self.contexts[node_id])
        try:
            reply = self.apps[node_id](sent, context)
        except Exception as exc:  # what a SuperNode does with any ClientApp error
            reason = f"{type(exc)}:<'{exc}'>"
            reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=sent)
        else:
            self.contexts[node_id] = context
        received = _copy_message(reply)
        self.replies.append((node_id, stage, received))
        return _copy_message(received)


def _copy_message(message: Message) -> Message:
    """A copy of ``message`` that shares no mutable container with it.

    Metadata, the record dict, each record and each list value are new objects; values
    that cannot change in place (bytes, str, numbers, ``Array`` payloads, the error) are
    shared, as a wire would hand over equal values.
    """
    copied = copy.copy(message)
    copied.__dict__["_metadata"] = copy.copy(message.metadata)
    if message.has_content():
        copied.__dict__["_content"] = _copy_records(message.content)
    return copied


def _copy_records(records: RecordDict) -> RecordDict:
    """A copy of ``records`` sharing no record, dict or list with it (see ``_copy_message``)."""
    return RecordDict({key: _copy_record(record) for key, record in records.items()})


def _copy_record(record: ArrayRecord | ConfigRecord | MetricRecord) -> Any:
    if isinstance(record, ArrayRecord):
        return ArrayRecord({key: copy.copy(array) for key, array in record.items()})
    values: dict[str, Any] = {
        key: list(value) if isinstance(value, list) else value for key, value in record.items()
    }
    return type(record)(values)


def _copy_context(context: Context) -> Context:
    return Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=dict(context.node_config),
        state=_copy_records(context.state),
        run_config=dict(context.run_config),
    )


def _stage_of(message: Message) -> str:
    return message.metadata.message_type


__all__ = [
    "FIRST_NODE_ID",
    "InProcessGrid",
    "make_server_context",
    "set_task_identity",
]

"""A ``Grid`` that hands every call to the grid it wraps; the wrappers override what they change.

``server.prompt_grid.PromptGrid`` (prompt pulls, stragglers) wraps the grid Flower gives the
ServerApp and changes only ``send_and_receive`` (and, for names, ``get_nodes``); everything
else goes through here unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run

__all__ = ["DelegatingGrid"]


class DelegatingGrid(Grid):
    """Every call goes to ``inner`` (``create_message`` builds the message itself)."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner

    def set_run(self, run: Run) -> None:
        """Set the run (delegated)."""
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        """The run (delegated)."""
        return self.inner.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create a message without Flower's deprecation warning for ``Grid.create_message``."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Node ids of the connected sites (delegated)."""
        return self.inner.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        """Node records, with the name each site registered with (delegated)."""
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push messages (delegated)."""
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull replies (delegated)."""
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send and wait for the replies (delegated)."""
        return self.inner.send_and_receive(messages, timeout=timeout)

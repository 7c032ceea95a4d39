"""The coordinator's side of a release's secure sums, stage by stage (``protocol.secure_sum``).

:class:`SecureSumSession` starts from the key advertisements that came back with the sites'
plan acceptances and runs each sum in three round trips (the first sum's carries the share
boxes as well), after one more before the first sum when the graph is sparse::

    graph       SumKeysRequest                               -> NonceReveal (sparse only)
    collect     SumSharesRequest (sum 0) / SumCollectRequest -> MaskedInput
    survivors   SurvivorsRequest                             -> SurvivorsSigned
    unmask      UnmaskRequest                                -> UnmaskReply

The graph round costs one message a site (about 4 s deployed, docs/design.md decision 17):
the nonces must be revealed after every advertisement is fixed, so that no one chooses the
graph (``protocol.sum_graph``). A site lost in it aborts the sum: drawing without its nonce
would let colluders choose between graphs by withholding theirs.

It learns the total over the survivors and who they are, never a site's input; it checks
nothing a site does not check again (sites trust no coordinator), but it stops early when a
sum cannot succeed (too few survivors, a survivor that did not sign).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import RecordDict

from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.errors import InsufficientSharesError
from protocol import WireMessage, message_to_record
from protocol.codec import array_from_record, with_array
from protocol.secure_sum import (
    MASKED_ARRAY_KEY,
    REFERENCE_ARRAY_KEY,
    AddressedBox,
    MaskedInput,
    NodeBytes,
    NonceReveal,
    SumCollectRequest,
    SumInstructions,
    SumKeysRequest,
    SumSharesRequest,
    SurvivorsRequest,
    SurvivorsSigned,
    UnmaskReply,
    UnmaskRequest,
    dequantise,
    key_transcript,
)
from protocol.sum_graph import GraphShape, SumGraph, build_graph, graph_seed, graph_shape
from protocol.sum_keys import KeyAdvert, nonce_commitment
from server.messaging import Exchange, Replies
from server.secure_sum.unmask import unmask_total

__all__ = ["SecureSumSession", "SumResult"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SumResult:
    """One secure sum's total (real units, dequantised) and the sites in it."""

    total: Float64Array
    survivors: tuple[int, ...]
    failures: dict[int, str]


@dataclass
class SecureSumSession:
    """The coordinator's state of one release's secure sums.

    Attributes:
        exchange: Sends messages to the sites and decodes their replies.
        release_id: The release.
        adverts: Node id -> the signed key advertisement it sent with its acceptance.
        min_sites: Fewest survivors a sum may have, and the plan's minimum of honest sites
            the graph is sized for; below it nothing is unmasked.
    """

    exchange: Exchange
    release_id: str
    adverts: dict[int, KeyAdvert]
    min_sites: int
    participants: tuple[int, ...] = ()
    shape: GraphShape | None = None
    graph: SumGraph | None = None
    nonces: dict[int, bytes] = field(default_factory=dict)
    boxes: dict[int, list[AddressedBox]] = field(default_factory=dict)
    next_sum: int = 0

    def __post_init__(self) -> None:
        nodes = sorted(self.adverts)
        if len(nodes) < self.min_sites:
            raise InsufficientSharesError(
                f"sites with keys must number at least min-sites={self.min_sites}, "
                f"got {len(nodes)}."
            )
        self.shape = graph_shape(len(nodes), minimum=self.min_sites)
        if self.shape.required_neighbours() > self.shape.degree:  # every site would refuse
            raise InsufficientSharesError(
                f"a secure sum of {len(nodes)} sites cannot hold min-sites={self.min_sites} "
                f"honest sites with {self.shape.colluding_neighbours} of them assumed colluding "
                f"(a tenth of the sites): it needs min-sites + {self.shape.colluding_neighbours}"
                " sites, or a lower min-sites."
            )
        self.participants = tuple(nodes)

    @property
    def threshold(self) -> int:
        """t: shares that rebuild a self-mask seed."""
        return self._shape().threshold

    def run_sum(
        self,
        instructions: SumInstructions,
        reference: Float64Array | None = None,
        *,
        length: int | None = None,
    ) -> SumResult:
        """Collect, have the survivors sign, unmask; return the total over the survivors.

        ``length``: the values each site's input must hold (its vector and its count);
        inputs of another length leave the sum before anything is revealed.

        Raises:
            InsufficientSharesError: Fewer survivors than ``min_sites``, a survivor did not
                sign, or too few shares came back to unmask.
        """
        if instructions.sum_index != self.next_sum:
            raise ValueError(f"sum {self.next_sum} comes next, got {instructions.sum_index}.")
        if self.graph is None:
            self._draw_graph()
        masked, failures = self._collect(instructions, reference)
        masked = _of_one_length(masked, failures, length)
        survivors = tuple(sorted(masked))
        self._require(len(survivors), "sites whose masked input arrived", failures)
        signatures = self._signatures(instructions.sum_index, survivors)
        replies = self._unmask(instructions.sum_index, survivors, signatures)
        total = unmask_total(
            masked=masked,
            replies=replies,
            participants=self.participants,
            neighbours=self._graph().neighbours,
            threshold=self.threshold,
            modulus=instructions.ranges.modulus_range,
        )
        self.participants, self.next_sum = survivors, self.next_sum + 1
        real = dequantise(total, instructions.ranges, len(survivors))
        return SumResult(real, survivors, failures)

    # ------------------------------------------------------------------ stages

    def _draw_graph(self) -> None:
        """Fix the graph: at once if complete, else from every site's revealed nonce.

        Raises:
            InsufficientSharesError: A site did not reveal the nonce it committed to.
        """
        shape = self._shape()
        nodes = list(self.participants)
        if shape.complete:
            self.graph = build_graph(nodes, shape, None)
            return
        request = SumKeysRequest(
            release_id=self.release_id, adverts=[self.adverts[node] for node in nodes]
        )
        record = message_to_record(request)
        replies = self._send("sum_keys", {node: record for node in nodes}, NonceReveal)
        for node in nodes:
            answer = replies.answers.get(node)
            if isinstance(answer, NonceReveal) and self._opens(node, answer.nonce):
                self.nonces[node] = answer.nonce
        missing = sorted(set(nodes) - set(self.nonces))
        if missing:  # drawing without them would let a colluder choose by withholding
            raise InsufficientSharesError(
                f"every participant must reveal its graph nonce, got none or a wrong one from "
                f"{len(missing)} of {len(nodes)}: {_reasons(replies, missing)}"
            )
        transcript = key_transcript(list(self.adverts.values()))
        self.graph = build_graph(nodes, shape, graph_seed(transcript, self.nonces))

    def _opens(self, node: int, nonce: bytes) -> bool:
        advert = self.adverts[node]
        found = nonce_commitment(
            release_id=self.release_id, member=advert.member, node_id=node, nonce=nonce
        )
        return found == advert.nonce_commitment

    def _collect(
        self, instructions: SumInstructions, reference: Float64Array | None
    ) -> tuple[dict[int, Int64Array], dict[int, str]]:
        first = instructions.sum_index == 0
        request: SumSharesRequest | SumCollectRequest
        if first:
            request = SumSharesRequest(
                release_id=self.release_id,
                adverts=[self.adverts[node] for node in self.participants],
                nonces=[
                    NodeBytes(node_id=node, value=v) for node, v in sorted(self.nonces.items())
                ],
                instructions=instructions,
            )
        else:
            request = SumCollectRequest(release_id=self.release_id, instructions=instructions)
        record = message_to_record(request)
        if reference is not None:
            with_array(record, REFERENCE_ARRAY_KEY, reference)
        action = "sum_shares" if first else "sum_collect"
        replies = self._send(action, {node: record for node in self.participants}, MaskedInput)
        masked: dict[int, Int64Array] = {}
        for node, answer in replies.answers.items():
            if not isinstance(answer, MaskedInput) or answer.sum_index != instructions.sum_index:
                replies.failures[node] = "answered another sum"
                continue
            try:
                vector = np.asarray(
                    array_from_record(replies.records[node], MASKED_ARRAY_KEY, dtype="int64"),
                    dtype=np.int64,
                )
            except Exception as exc:  # a malformed reply drops the site, nothing else
                replies.failures[node] = str(exc)
                continue
            masked[node] = vector
            if first:
                for box in answer.boxes:  # re-addressed: the receiver learns the sender
                    self.boxes.setdefault(box.node_id, []).append(
                        AddressedBox(node_id=node, box=box.box)
                    )
        return masked, dict(replies.failures)

    def _signatures(self, sum_index: int, survivors: tuple[int, ...]) -> list[NodeBytes]:
        contents = {}
        for node in survivors:
            boxes = [b for b in self.boxes.get(node, []) if b.node_id in survivors]
            request = SurvivorsRequest(
                release_id=self.release_id,
                sum_index=sum_index,
                survivors=list(survivors),
                boxes=boxes if sum_index == 0 else [],
            )
            contents[node] = message_to_record(request)
        replies = self._send("sum_survivors", contents, SurvivorsSigned)
        signed = {
            node: answer.signature
            for node, answer in replies.answers.items()
            if isinstance(answer, SurvivorsSigned) and answer.sum_index == sum_index
        }
        missing = sorted(set(survivors) - set(signed))
        if missing:  # every survivor must sign U; an honest site signs one U a sum
            raise InsufficientSharesError(
                f"every survivor must sign the survivor set, got no signature from "
                f"{len(missing)} of {len(survivors)}: {_reasons(replies, missing)}"
            )
        return [NodeBytes(node_id=node, value=signed[node]) for node in survivors]

    def _unmask(
        self, sum_index: int, survivors: tuple[int, ...], signatures: list[NodeBytes]
    ) -> dict[int, UnmaskReply]:
        request = UnmaskRequest(
            release_id=self.release_id,
            sum_index=sum_index,
            survivors=list(survivors),
            signatures=signatures,
        )
        record = message_to_record(request)
        replies = self._send("sum_unmask", {node: record for node in survivors}, UnmaskReply)
        return {
            node: answer
            for node, answer in replies.answers.items()
            if isinstance(answer, UnmaskReply) and answer.sum_index == sum_index
        }

    def _send(
        self,
        action: str,
        contents: Mapping[int, RecordDict],
        expected: type[WireMessage],
    ) -> Replies:
        group = f"{self.release_id}-sum{self.next_sum}-{action}"
        return self.exchange.send(action, contents, expected, group)

    def _shape(self) -> GraphShape:
        if self.shape is None:  # set in __post_init__
            raise InsufficientSharesError("the secure sum has no graph shape.")
        return self.shape

    def _graph(self) -> SumGraph:
        if self.graph is None:
            raise InsufficientSharesError("the secure sum's graph must be drawn before a sum.")
        return self.graph

    def _require(self, count: int, what: str, failures: Mapping[int, str]) -> None:
        if count < self.min_sites:
            raise InsufficientSharesError(
                f"{what} must number at least min-sites={self.min_sites}, got {count}; "
                f"nothing was unmasked. Failures: {dict(failures)}"
            )


def _of_one_length(
    masked: dict[int, Int64Array], failures: dict[int, str], length: int | None
) -> dict[int, Int64Array]:
    """Drop, before anything is revealed, inputs whose length is not the sum's.

    ``length`` when the caller knows it, else the length most sites sent: a site that sends
    a vector of another length leaves the sum instead of failing it after the unmask.
    """
    if not masked:
        return masked
    if length is None:
        sizes = [int(vector.size) for vector in masked.values()]
        length = max(set(sizes), key=sizes.count)
    kept = {node: vector for node, vector in masked.items() if vector.size == length}
    for node in set(masked) - set(kept):
        failures[node] = f"sent a masked input of {masked[node].size} values, not {length}"
    return kept


def _reasons(replies: Replies, nodes: list[int]) -> str:
    return "; ".join(f"{node}: {replies.failures.get(node, 'no reply')}" for node in nodes[:5])

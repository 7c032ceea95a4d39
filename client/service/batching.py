"""Batched generation across requests: a bounded queue, fixed shapes, a patch per row.

How this connects: the HTTP endpoint (:mod:`client.service.http_api`) turns each chat request
into one :class:`Row` (its prompt's tensors, the release's patch or none, its sampling
settings) and hands it to :class:`Batcher` with a :class:`RowSink` that receives the row's
tokens. One worker thread takes rows from the queue, runs them together through the model's
``generate()`` under the service's model lock (the lock every other use of the model takes,
so no release's hooks ever see a served row), and feeds each row's tokens to its sink as
they are generated.

**A row's answer never depends on its batch-mates**, the guarantee extraction gives its
chunks (:mod:`client.fixed_shape`) and for the same reasons, measured on CPU: a batch padded
to its longest prompt, or of another number of rows, changes a row's logits in the last bits
(about 1e-7 in float32), which can flip a near-tie. So every pass has a shape fixed by the
row alone and public settings: each prompt is left-padded to the next multiple of
:data:`~client.fixed_shape.PAD_MULTIPLE` tokens; rows share a pass only with rows of the same
padded length and image-tensor shapes; and every pass holds exactly ``rows`` rows, the empty
ones filled with copies of a member (their output discarded). No kernel reduces across rows,
so a row's tokens are bit-identical alone or batched, in whichever row it sits (tested).
Batching is dynamic, not continuous: rows join a pass when it starts; a row cannot join a
pass under way, since its prompt would change the pass's shape mid-generation.

The rows themselves, and the per-row controls of a pass (patch, sampling, stop), are in
:mod:`client.service.rows`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from client.hooks import prompt_length_guard
from client.models import LoadedModel
from client.service.rows import (
    Row,
    RowLimit,
    RowSampler,
    RowSink,
    eos_ids,
    row_patches,
    stack_rows,
)
from dpmtv_common.errors import ConfigError, ServiceError

__all__ = ["BatchStats", "Batcher", "OverloadedError"]

_log = logging.getLogger(__name__)


class OverloadedError(ServiceError):
    """The queue of waiting rows is full: the caller should retry later."""


@dataclass
class _Ticket:
    row: Row
    sink: RowSink


@dataclass
class BatchStats:
    """What the worker did, for the metrics endpoint (read without a lock: approximate)."""

    passes: int = 0
    rows_served: int = 0
    rows_filled: int = 0
    tokens_generated: int = 0
    failures: int = 0
    busy_seconds: float = 0.0


class Batcher:
    """A bounded queue of rows and the one worker thread that generates them in passes.

    Args:
        loaded: The site's model (shared: every use of it takes ``model_lock``).
        model_lock: The lock that serialises every use of the model in this process.
        rows: Rows of every pass (fixed: see the module docstring).
        max_queue: Rows that may wait; one more is refused with :class:`OverloadedError`.
        gather_s: How long the oldest row may wait for announced rows (:meth:`expect`) to
            fill its pass (a pass of one row costs as much as a full one).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        model_lock: threading.Lock,
        *,
        rows: int,
        max_queue: int,
        gather_s: float = 0.05,
    ) -> None:
        if not 0 <= gather_s <= 1:
            raise ConfigError(f"gather_s must be within [0, 1] seconds, got {gather_s}.")
        if rows < 1:
            raise ConfigError(f"rows must be >= 1, got {rows}.")
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}.")
        self.loaded = loaded
        self.rows = rows
        self.max_queue = max_queue
        self.gather_s = gather_s
        self.stats = BatchStats()
        self._model_lock = model_lock
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._ready = threading.Condition()
        self._stopped = False
        self._expected = 0  # rows announced by expect() and not yet submitted
        self._thread = threading.Thread(target=self._run, name="dpmtv-batcher", daemon=True)

    @property
    def depth(self) -> int:
        """Rows waiting now."""
        return len(self._queue)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the pass under way, fail the rows still waiting, and stop the worker."""
        with self._ready:
            self._stopped = True
            waiting = list(self._queue)
            self._queue.clear()
            self._ready.notify_all()
        for ticket in waiting:
            ticket.sink.fail(ServiceError("the service is stopping; the row was not run."))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def expect(self) -> None:
        """Announce a row being prepared: a pass about to start waits for it (``gather_s``)."""
        with self._ready:
            self._expected += 1

    def cancel_expected(self) -> None:
        """Withdraw an announced row that will not come (its request failed)."""
        with self._ready:
            self._expected = max(0, self._expected - 1)
            self._ready.notify_all()

    def submit(self, row: Row, sink: RowSink, *, expected: bool = False) -> None:
        """Queue ``row``; its tokens go to ``sink`` from the worker thread.

        Args:
            row: The prepared row.
            sink: Receives its tokens.
            expected: The row was announced with :meth:`expect` (counted off either way).

        Raises:
            OverloadedError: ``max_queue`` rows already wait, or the batcher is stopped.
        """
        with self._ready:
            if expected:
                self._expected = max(0, self._expected - 1)
                self._ready.notify_all()
            if self._stopped:
                raise OverloadedError("the service is stopping: it takes no new rows.")
            if len(self._queue) >= self.max_queue:
                raise OverloadedError(
                    f"queued rows must stay below {self.max_queue}, got a full queue; retry later."
                )
            self._queue.append(_Ticket(row, sink))
            self._ready.notify()

    def _next_pass(self) -> list[_Ticket] | None:
        """The oldest row and up to ``rows - 1`` later rows that can share its pass."""
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            # A pass costs the same with one row as with ``rows``: while rows are announced
            # (being prepared), wait a moment for them; with none announced, start at once.
            deadline = time.monotonic() + self.gather_s
            while not self._stopped and self._expected and len(self._mates()) < self.rows:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._ready.wait(remaining)
            if self._stopped:
                return None
            taken = self._mates()[: self.rows]
            for ticket in taken:
                self._queue.remove(ticket)
            return taken

    def _mates(self) -> list[_Ticket]:
        """The oldest row and every queued row that can share its pass, oldest first."""
        first = self._queue[0]
        key = (first.row.signature, first.row.image_crops)
        return [t for t in self._queue if (t.row.signature, t.row.image_crops) == key]

    def _run(self) -> None:
        while (tickets := self._next_pass()) is not None:
            try:
                self._generate(tickets)
            except Exception as exc:  # one pass's failure fails its rows, not the service
                _log.warning("generation failed for %d rows: %s", len(tickets), exc)
                self.stats.failures += 1
                for ticket in tickets:
                    ticket.sink.fail(exc)

    def _generate(self, tickets: list[_Ticket]) -> None:
        rows = [t.row for t in tickets]
        filled = rows + [rows[0]] * (self.rows - len(rows))  # copies: outputs discarded
        loaded = self.loaded
        tokenizer = loaded.processor.tokenizer
        pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        device = loaded.model.device
        inputs = {k: v.to(device) for k, v in stack_rows(filled, pad_id).items()}
        prompt_length = int(inputs["input_ids"].shape[1])
        streamer = _RowStreamer(tickets, eos_ids(loaded), self.stats)
        started = time.monotonic()
        with self._model_lock, row_patches(loaded, filled), prompt_length_guard(loaded.model):
            loaded.model.generate(  # type: ignore[operator]
                **inputs,
                max_new_tokens=max(row.max_new_tokens for row in rows),
                do_sample=False,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([RowSampler(filled)]),
                stopping_criteria=StoppingCriteriaList([RowLimit(filled, prompt_length)]),
                streamer=streamer,
            )
        self.stats.busy_seconds += time.monotonic() - started
        self.stats.passes += 1
        self.stats.rows_served += len(rows)
        self.stats.rows_filled += self.rows - len(rows)
        streamer.finish_all()


@dataclass
class _RowStreamer(BaseStreamer):
    """Sends each real row's new tokens to its sink as ``generate()`` makes them."""

    tickets: list[_Ticket]
    eos: frozenset[int]
    stats: BatchStats
    counts: list[int] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    prompt_seen: bool = False

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.tickets)
        self.reasons = [None] * len(self.tickets)

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt itself
            self.prompt_seen = True
            return
        tokens = value.reshape(-1).tolist()
        for index, ticket in enumerate(self.tickets):
            if self.reasons[index] is not None:
                continue
            token = int(tokens[index])
            if token in self.eos:
                self.reasons[index] = "stop"
                continue
            ticket.sink.token(token)
            self.counts[index] += 1
            self.stats.tokens_generated += 1
            if self.counts[index] >= ticket.row.max_new_tokens:
                self.reasons[index] = "length"

    def end(self) -> None:
        """Called by ``generate()`` at its end; rows are finished by :meth:`finish_all`."""

    def finish_all(self) -> None:
        for ticket, reason in zip(self.tickets, self.reasons, strict=True):
            ticket.sink.finish(reason or "length")

"""Rows answered in passes through ``generate()``: batch-invariant mode, and other families.

Passes serve a site that asks for batch-invariant answers, and every family the continuous
batch (:mod:`client.service.decoding`) cannot step.

How this connects: the batcher (:mod:`client.service.batching`) hands :func:`run_pass` the
rows of one pass: rows whose image tensors stack, padded to the longest prompt, generated
together by the model's own ``generate()`` with this service's per-row controls
(:mod:`client.service.rows`). A row cannot join a pass under way.

**Batch-invariant mode** runs passes of one row: each row alone, unpadded, through the same
``generate()`` call a plain user would make, so its tokens are bit-identical to plain
``generate()`` on its prompt whatever else is asked at the time (tested). The price is every
batching gain: one row a forward pass (measured in ``docs/benchmarks/serving.md``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from threading import Lock

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from client.activations.hooks import prompt_length_guard
from client.models import LoadedModel
from client.service.decoding import BatchStats
from client.service.rows import RowLimit, RowSampler, Ticket, eos_ids, row_patches, stack_rows

__all__ = ["run_pass"]


def run_pass(
    loaded: LoadedModel, model_lock: Lock, tickets: Sequence[Ticket], stats: BatchStats
) -> None:
    """Generate ``tickets``' rows together (they share a stack key); stream each row's tokens.

    Raises:
        Exception: ``generate()`` failed (the caller fails the rows).
    """
    rows = [t.row for t in tickets]
    tokenizer = loaded.processor.tokenizer
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    device = loaded.model.device
    inputs = {k: v.to(device) for k, v in stack_rows(rows, pad_id).items()}
    prompt_length = int(inputs["input_ids"].shape[1])
    streamer = _RowStreamer(list(tickets), eos_ids(loaded), stats)
    stats.running = len(rows)
    started = time.monotonic()
    try:
        with model_lock, row_patches(loaded, rows), prompt_length_guard(loaded.model):
            loaded.model.generate(  # type: ignore[operator]
                **inputs,
                max_new_tokens=max(row.max_new_tokens for row in rows),
                do_sample=False,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([RowSampler(rows)]),
                stopping_criteria=StoppingCriteriaList([RowLimit(rows, prompt_length)]),
                streamer=streamer,
            )
    finally:
        stats.running = 0
        stats.busy_seconds += time.monotonic() - started  # generate(): all of it passes
    stats.rows_served += len(rows)
    streamer.finish_all()


@dataclass
class _RowStreamer(BaseStreamer):
    """Sends each row's new tokens to its sink as ``generate()`` makes them."""

    tickets: list[Ticket]
    eos: frozenset[int]
    stats: BatchStats
    counts: list[int] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    prompt_seen: bool = False
    first_pass: int = 0

    def __post_init__(self) -> None:
        self.first_pass = self.stats.passes + 1
        self.counts = [0] * len(self.tickets)
        self.reasons = [None] * len(self.tickets)

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt itself
            self.prompt_seen = True
            return
        # then one put a forward pass: the prefill's, then each step's (of every row)
        self.stats.passes += 1
        if self.stats.passes == self.first_pass:
            self.stats.prefills += 1
        else:
            self.stats.steps += 1
            self.stats.step_rows += len(self.tickets)
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

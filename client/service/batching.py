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

**The patch is per row.** Each row carries its own release's heads and values (or none: the
plain model), so one pass may mix releases. A forward pre-hook on every patched layer's
``o_proj`` overwrites, in each patched row, that row's heads at the last position, with
``torch.where`` (elementwise: a row's patch cannot touch another row). Under the
``prompt-last-token`` policy (the default, what was measured) a row is patched in the
prefill only, at its prompt's last token: the generated tokens then attend to the patched
position through the KV cache, and each decoding step itself runs unpatched. Under
``every-call`` (MTV's code) the row is patched at every step's position as well.

**Sampling is per row.** A row with ``temperature > 0`` draws its tokens from its own
``torch.Generator``, seeded by the request (or at random): its draws never depend on its
batch-mates either. ``temperature == 0`` is greedy.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from client.fixed_shape import PAD_MULTIPLE
from client.hooks import PatchPolicy, prompt_length_guard, registered_pre_hooks
from client.models import LoadedModel, Prompt, check_prompt_length
from dpmtv_common.errors import ConfigError, ServiceError
from dpmtv_common.heads import HeadSet

__all__ = [
    "BatchStats",
    "Batcher",
    "OverloadedError",
    "Row",
    "RowPatch",
    "RowSink",
    "prepare_row",
]

_log = logging.getLogger(__name__)
_Inputs = dict[str, torch.Tensor]
_Signature = tuple[int, tuple[tuple[str, tuple[int, ...]], ...]]


class OverloadedError(ServiceError):
    """The queue of waiting rows is full: the caller should retry later."""


@dataclass(frozen=True)
class RowPatch:
    """One release's patch for one row.

    Attributes:
        release_id: The release whose verified artifact gave the values.
        heads: The released heads; row ``i`` of ``values`` belongs to ``heads.heads[i]``.
        values: float32 ``(len(heads), D)``, the released mean activations.
        policy: When the row is patched (see the module docstring).
    """

    release_id: str
    heads: HeadSet
    values: torch.Tensor
    policy: PatchPolicy = PatchPolicy.PROMPT_LAST_TOKEN


@dataclass(frozen=True)
class Row:
    """One prepared query: its unpadded tensors and how to answer it.

    Attributes:
        inputs: The processor's tensors for this prompt alone (a batch of one).
        prompt_tokens: Tokens of the unpadded prompt.
        signature: Padded length and image-tensor shapes: rows share a pass only if equal.
        patch: The release's patch, or None for the plain model.
        max_new_tokens: Most tokens to generate.
        temperature: 0 for greedy, else the sampling temperature.
        seed: Seed of this row's own sampling generator.
        image_crops: The crop cap its prompt was built under (rows share it in a pass).
    """

    inputs: _Inputs
    prompt_tokens: int
    signature: _Signature
    patch: RowPatch | None
    max_new_tokens: int
    temperature: float
    seed: int
    image_crops: int | None = None


class RowSink(Protocol):
    """Receives one row's generation, from the worker thread (so: thread-safe)."""

    def token(self, token_id: int) -> None:
        """One generated token (an end-of-sequence token is never sent)."""

    def finish(self, reason: str) -> None:
        """The row is done: ``stop`` (end of sequence) or ``length`` (``max_new_tokens``)."""

    def fail(self, error: Exception) -> None:
        """The row's pass failed; no more calls follow."""


def prepare_row(
    loaded: LoadedModel,
    prompt: Prompt,
    *,
    instruction: str | None,
    patch: RowPatch | None,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> Row:
    """Tokenise one prompt and check it fits the model, padded, before it is queued.

    Raises:
        ConfigError: The prompt (padded, plus ``max_new_tokens``) exceeds the model's context,
            or the processor returns something other than tensors.
    """
    built = loaded.adapter.build_batch_inputs(loaded.processor, [prompt], instruction=instruction)
    inputs = {key: value for key, value in built.items() if isinstance(value, torch.Tensor)}
    if len(inputs) != len(built):
        raise ConfigError("processor outputs must all be tensors to be batched.")
    signature = _signature(inputs)
    check_prompt_length(loaded.model, signature[0] + max_new_tokens)
    return Row(
        inputs=inputs,
        prompt_tokens=int(inputs["input_ids"].shape[1]),
        signature=signature,
        patch=patch,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        image_crops=loaded.max_image_crops,
    )


def _token_keys(inputs: _Inputs) -> list[str]:
    length = inputs["input_ids"].shape[1]
    return [k for k, v in inputs.items() if v.ndim == 2 and v.shape == (1, length)]


def _signature(inputs: _Inputs) -> _Signature:
    """Padded length (its own prompt's, rounded up) and the other tensors' shapes.

    A prompt whose other tensors have a dimension as long as the prompt (a per-token tensor
    we would not know how to pad) keeps its exact length: still a function of itself only.
    """
    length = int(inputs["input_ids"].shape[1])
    tokens = set(_token_keys(inputs))
    others = tuple(sorted((k, tuple(v.shape)) for k, v in inputs.items() if k not in tokens))
    if any(length in shape[1:] for _, shape in others):
        return length, others
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE, others


def _stacked(rows: Sequence[Row], pad_id: int) -> _Inputs:
    length = rows[0].signature[0]
    tokens = set(_token_keys(rows[0].inputs))
    out: _Inputs = {}
    for key in rows[0].inputs:
        values = [row.inputs[key] for row in rows]
        if key in tokens:  # masked positions get exactly zero attention weight
            fill = pad_id if key == "input_ids" else 0
            values = [
                torch.cat([torch.full((1, length - v.shape[1]), fill, dtype=v.dtype), v], dim=1)
                for v in values
            ]
        out[key] = torch.cat(values, dim=0)
    return out


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
        inputs = {k: v.to(device) for k, v in _stacked(filled, pad_id).items()}
        prompt_length = int(inputs["input_ids"].shape[1])
        streamer = _RowStreamer(tickets, _eos_ids(loaded), self.stats)
        started = time.monotonic()
        with self._model_lock, _row_patches(loaded, filled), prompt_length_guard(loaded.model):
            loaded.model.generate(  # type: ignore[operator]
                **inputs,
                max_new_tokens=max(row.max_new_tokens for row in rows),
                do_sample=False,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([_RowSampler(filled)]),
                stopping_criteria=StoppingCriteriaList([_RowLimit(filled, prompt_length)]),
                streamer=streamer,
            )
        self.stats.busy_seconds += time.monotonic() - started
        self.stats.passes += 1
        self.stats.rows_served += len(rows)
        self.stats.rows_filled += self.rows - len(rows)
        streamer.finish_all()


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(loaded.processor.tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


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


class _RowLimit(StoppingCriteria):
    """Each row stops at its own ``max_new_tokens`` (end of sequence is generate()'s own)."""

    def __init__(self, rows: Sequence[Row], prompt_length: int) -> None:
        self._limits = torch.tensor([row.max_new_tokens for row in rows])
        self._prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        made = input_ids.shape[1] - self._prompt_length
        return (made >= self._limits).to(input_ids.device)


class _RowSampler(LogitsProcessor):
    """Sampling rows draw from their own generator; greedy rows are left as they are.

    ``generate()`` runs greedy (argmax); a sampling row's scores become one-hot on its draw,
    so the argmax picks the drawn token.
    """

    def __init__(self, rows: Sequence[Row]) -> None:
        self._rows = list(rows)
        self._generators: dict[int, torch.Generator] = {}
        for index, row in enumerate(rows):
            if row.temperature > 0:
                self._generators[index] = torch.Generator().manual_seed(row.seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self._generators:
            return scores
        out = scores.clone()
        for index, generator in self._generators.items():
            logits = scores[index].detach().to(device="cpu", dtype=torch.float32)
            probs = torch.softmax(logits / self._rows[index].temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            out[index] = float("-inf")
            out[index, token] = 0.0
        return out


@contextmanager
def _row_patches(loaded: LoadedModel, rows: Sequence[Row]) -> Iterator[None]:
    """Each patched row's heads overwritten at the last position, per its own policy."""
    shape = loaded.adapter.head_shape(loaded.model)
    batch = len(rows)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    every_call = torch.tensor(
        [row.patch is not None and row.patch.policy is PatchPolicy.EVERY_CALL for row in rows]
    )
    for index, row in enumerate(rows):
        if row.patch is None:
            continue
        for (layer, head), value in zip(row.patch.heads.heads, row.patch.values, strict=True):
            if layer not in tables:
                mask = torch.zeros(batch, shape.num_heads, dtype=torch.bool)
                values = torch.zeros(batch, shape.num_heads, shape.head_dim)
                tables[layer] = (mask, values)
            tables[layer][0][index, head] = True
            tables[layer][1][index, head] = value

    def make_hook(mask: torch.Tensor, values: torch.Tensor) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            hidden = args[0]
            prefill = hidden.shape[1] > 1
            active = mask & (every_call | prefill)[:, None]
            if not bool(active.any()):
                return None
            patched = hidden.clone(memory_format=torch.contiguous_format)
            per_head = patched.view(*hidden.shape[:2], shape.num_heads, shape.head_dim)
            where = active.to(hidden.device)[..., None]
            per_head[:, -1] = torch.where(where, values.to(hidden), per_head[:, -1])
            return (patched, *args[1:])

        return hook

    projections = loaded.adapter.projections_by_layer(loaded.model)
    hooks = [(projections[layer], make_hook(*tables[layer])) for layer in sorted(tables)]
    with registered_pre_hooks(hooks):
        yield

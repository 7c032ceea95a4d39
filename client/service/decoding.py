"""The continuous batch: rows join at the next decoding step and leave when they finish.

How this connects: the batcher's worker thread (:mod:`client.service.batching`) owns one
:class:`ContinuousBatch`. Between steps it hands it the rows that arrived (:meth:`join`: one
prefill forward per group of rows whose image tensors stack, the patched rows patched at their
prompt's last token), then runs one decoding step for every running row (:meth:`step`: a row
with a public answer's end takes it at its own first step). Each
row's tokens go to its sink as they are made; a row leaves at its end of sequence or its
``max_new_tokens``, and the next waiting row takes its place at the next step. This is how vLLM
and text-generation-inference schedule, on plain forward passes of the ``transformers`` model.

**One cache, each row at its own positions.** The running rows share one key/value cache,
``(rows, kv_heads, columns, head_dim)`` a layer, each row's tokens right-aligned: a row that
joins with a shorter history than the others is left-padded with empty columns, masked out of
attention (weight exactly zero), and fed its own positions (its real token count, as
``generate()`` computes them from the attention mask). When rows leave, their cache rows are
dropped, and columns that every remaining row has empty are cut.

**What a row's answer depends on.** Only the row's own tensors enter its attention, but the
matrix products of a batch are blocked by the batch's size, so a row's logits move in the last
bits with its batch-mates (about 1e-7 relative in float32), enough to flip a near-tie between
two tokens: greedy answers equal those of plain ``generate()`` on the same prompt up to such
ties (tested on every family that runs here). A site that needs answers bit-identical
whatever the load runs the batcher in its batch-invariant mode (each row alone) instead.

**Which models.** Families whose adapter sets ``continuous_batching``: decoders whose cache
is plain full-attention layers and whose positions are one number a token. A family with
multimodal rotary positions (Qwen2-VL's), sliding-window or linear-attention layers, or
cross-attention caches is served in passes through ``generate()``
(:mod:`client.service.passes`), as is a model whose generation config changes greedy scores
(a repetition penalty, say): ``generate()`` applies those, this loop does not.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from threading import Lock
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from client.activations.hooks import prompt_length_guard
from client.models import LoadedModel
from client.service.pass_costs import PassCosts
from client.service.rows import (
    Row,
    Step,
    Ticket,
    draw_token,
    eos_ids,
    needs_patch,
    row_generators,
    row_patches,
    stack_rows,
)
from dpmtv_common.errors import ModelError

__all__ = ["BatchStats", "ContinuousBatch", "steps_continuously"]

_log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    """What the worker did, for the metrics endpoint (read without a lock: approximate).

    Attributes:
        passes: Forward passes: ``prefills`` plus ``steps``.
        prefills: Prefill passes (a group of arriving rows each).
        steps: Decoding steps (one token for every row in the pass).
        step_rows: Rows summed over decoding steps (``step_rows / steps``: rows a step).
        rows_served: Rows started.
        tokens_generated: Tokens sent to the rows' sinks.
        failures: Failed passes.
        busy_seconds: Time in forward passes.
        worker_seconds: Time the worker spent working: preparing requests, forward passes
            and the scheduling around them (cache joins and cuts, masks, choosing tokens,
            sending them).
        prepared: Requests the worker prepared (tokenised, images processed).
        prepare_calls: Preparation rounds (every request waiting then, prepared together).
        prepare_seconds: Time the worker spent preparing requests.
        running: Rows running now.
    """

    passes: int = 0
    prefills: int = 0
    steps: int = 0
    step_rows: int = 0
    rows_served: int = 0
    tokens_generated: int = 0
    failures: int = 0
    busy_seconds: float = 0.0
    worker_seconds: float = 0.0
    prepared: int = 0
    prepare_calls: int = 0
    prepare_seconds: float = 0.0
    running: int = 0
    costs: PassCosts = field(default_factory=PassCosts)

    def count_pass(self, rows: int, seconds: float, *, prefill: bool) -> None:
        """Count one forward pass of ``rows`` rows (and fold its time into ``costs``)."""
        self.passes += 1
        self.busy_seconds += seconds
        self.costs.record(rows, seconds, prefill=prefill)
        if prefill:
            self.prefills += 1
        else:
            self.steps += 1
            self.step_rows += rows


def steps_continuously(loaded: LoadedModel) -> bool:
    """Whether :class:`ContinuousBatch` can serve ``loaded`` (see the module docstring).

    True for a family whose adapter declares it, with a decoder of full-attention layers only
    and a generation config that adds no logits processor to greedy decoding (so plain
    ``generate()`` takes the argmax of the logits, from a dynamic cache).
    """
    if not loaded.adapter.continuous_batching:
        return False
    text = loaded.model.config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or ()
    if getattr(text, "sliding_window", None) is not None or any(
        kind != "full_attention" for kind in layer_types
    ):
        return False
    config = GenerationConfig.from_dict(loaded.model.generation_config.to_dict())
    if config.cache_implementation not in (None, "dynamic"):
        return False
    config.do_sample = False
    # transformers' own choice of processors, so every setting that would change a greedy
    # token is seen (private, but stable across the versions this project supports).
    processors = loaded.model._get_logits_processor(  # type: ignore[operator]
        generation_config=config, input_ids_seq_length=1, device="cpu"
    )
    return len(processors) == 0


@dataclass
class _Live:
    """A running row: its ticket, its place in the cache, its next input."""

    ticket: Ticket
    eos: frozenset[int]
    generator: torch.Generator | None
    length: int = 0  # its real tokens in the cache
    pad: int = 0  # the empty columns left of them
    made: int = 0
    last: int = 0  # the token to feed at the next step
    done: bool = False


class ContinuousBatch:
    """The running rows and their shared cache (used by one thread: the batcher's worker).

    Args:
        loaded: The site's model.
        model_lock: Taken around every forward pass (every use of the model takes it).
        stats: Where passes, rows and tokens are counted.
    """

    def __init__(self, loaded: LoadedModel, model_lock: Lock, stats: BatchStats) -> None:
        self.loaded = loaded
        self.model_lock = model_lock
        self.stats = stats
        self._live: list[_Live] = []
        self._cache: DynamicCache | None = None
        forward = inspect.signature(loaded.model.forward).parameters
        # transformers renamed past_key_values to cache (5.x); pass the name this one takes.
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in forward

    @property
    def size(self) -> int:
        """Rows running now."""
        return len(self._live)

    @property
    def steps_left(self) -> int:
        """Steps the longest-running row may still take (its ``max_new_tokens`` left)."""
        return max((item.ticket.row.max_new_tokens - item.made for item in self._live), default=0)

    def join(self, tickets: Sequence[Ticket]) -> None:
        """Prefill the arriving rows and add them to the running batch.

        A group whose prefill fails has its rows failed; the running rows are untouched.
        """
        groups: dict[Any, list[Ticket]] = {}
        for ticket in tickets:
            groups.setdefault(ticket.row.stack_key, []).append(ticket)
        for group in groups.values():
            try:
                joined, cache = self._prefill(group)
                self._merge(joined, cache)
            except Exception as exc:  # this group's failure fails its rows, not the batch
                _log.warning("a prefill failed for %d rows: %s", len(group), exc)
                self.stats.failures += 1
                for ticket in group:
                    ticket.sink.fail(exc)
                continue
            self._emit_and_leave(joined)

    def step(self) -> None:
        """One decoding step of every running row; rows that finish leave.

        Raises:
            Exception: The forward pass failed; the caller fails the rows (:meth:`fail_all`).
        """
        live, cache = self._live, self._cache
        if not live or cache is None:
            return
        inputs: dict[str, Any] = {
            "input_ids": torch.tensor([[item.last] for item in live]),
            "position_ids": torch.tensor([[item.length] for item in live]),
        }
        pads = torch.tensor([item.pad for item in live])
        if bool(pads.any()):  # as generate(): no mask when nothing is padded
            columns = torch.arange(cache.get_seq_length() + 1)
            inputs["attention_mask"] = (columns[None, :] >= pads[:, None]).long()
        rows = [item.ticket.row for item in live]
        # A row's first step takes in its first generated token (made == 1 by then).
        steps = [Step.FIRST_DECODING if item.made == 1 else Step.LATER_DECODING for item in live]
        logits = self._forward(inputs, cache, rows, steps, prefill=False)
        for item, token in zip(live, _choose(live, logits), strict=True):
            item.length += 1
            item.last = token
        self._emit_and_leave(live)

    def fail_all(self, error: Exception) -> None:
        """Fail every running row and empty the batch (after a failed step)."""
        live, self._live, self._cache = self._live, [], None
        self.stats.running = 0
        for item in live:
            if not item.done:  # a finished row's sink has had its answer
                item.ticket.sink.fail(error)

    def _prefill(self, group: list[Ticket]) -> tuple[list[_Live], DynamicCache]:
        rows = [ticket.row for ticket in group]
        loaded = self.loaded
        pad_id = getattr(loaded.processor.tokenizer, "pad_token_id", None) or 0
        inputs: dict[str, Any] = dict(stack_rows(rows, pad_id))
        mask = inputs.pop("attention_mask", torch.ones_like(inputs["input_ids"]))
        positions = mask.long().cumsum(-1) - 1  # as generate() numbers a padded prompt
        inputs["position_ids"] = positions.masked_fill(mask == 0, 0)
        if not bool(mask.all()):  # as generate(): no mask when nothing is padded
            inputs["attention_mask"] = mask
        cache = DynamicCache(config=loaded.model.config.get_text_config(decoder=True))
        steps = [Step.PROMPT] * len(rows)
        logits = self._forward(inputs, cache, rows, steps, prefill=True)
        width = int(mask.shape[1])
        _plain_layers(cache)  # refuses a cache of another kind
        if cache.get_seq_length() != width:
            raise ModelError(
                "a continuously batched model must cache one column a prompt token, got "
                f"{cache.get_seq_length()} columns for {width} tokens; set its adapter's "
                "continuous_batching to False."
            )
        generators, eos = row_generators(rows), eos_ids(loaded)
        joined = []
        for index, ticket in enumerate(group):
            length = int(mask[index].sum())
            joined.append(_Live(ticket, eos, generators.get(index), length, width - length))
        for item, token in zip(joined, _choose(joined, logits), strict=True):
            item.last = token
        self.stats.rows_served += len(group)
        return joined, cache

    def _forward(
        self,
        inputs: dict[str, Any],
        cache: DynamicCache,
        rows: Sequence[Row],
        steps: Sequence[Step],
        *,
        prefill: bool,
    ) -> torch.Tensor:
        """One forward pass under the model lock; the last position's logits, ``(rows, V)``.

        ``rows`` are the batch's, each at its ``steps``: each is patched as its policy says.
        """
        model = self.loaded.model
        device = model.device
        kwargs = {key: value.to(device) for key, value in inputs.items()}
        kwargs[self._cache_kwarg] = cache
        kwargs["use_cache"] = True
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        started = time.monotonic()
        with self.model_lock, torch.no_grad(), ExitStack() as stack:
            if needs_patch(rows, steps):
                stack.enter_context(row_patches(self.loaded, rows, steps=steps))
            if prefill:
                stack.enter_context(prompt_length_guard(model))
            logits: torch.Tensor = model(**kwargs).logits[:, -1, :]
        self.stats.count_pass(len(rows), time.monotonic() - started, prefill=prefill)
        return logits

    def _merge(self, joined: list[_Live], cache: DynamicCache) -> None:
        """Add the joined rows' cache to the running one, right-aligned (see the docstring)."""
        if self._cache is None or not self._live:
            self._live, self._cache = list(joined), cache
            self.stats.running = len(self._live)
            return
        ours, theirs = self._cache.get_seq_length(), cache.get_seq_length()
        width = max(ours, theirs)
        layers = _plain_layers(self._cache)
        merged = [  # all built before any is kept: a failure leaves the batch as it was
            tuple(
                torch.cat([_left_pad(mine, width), _left_pad(new, width)])
                for mine, new in zip(_kv(old), _kv(joining), strict=True)
            )
            for old, joining in zip(layers, _plain_layers(cache), strict=True)
        ]
        for layer, (keys, values) in zip(layers, merged, strict=True):
            layer.keys, layer.values = keys, values
        for item in self._live:
            item.pad += width - ours
        for item in joined:
            item.pad += width - theirs
        self._live += joined
        self.stats.running = len(self._live)

    def _emit_and_leave(self, items: list[_Live]) -> None:
        """Send each row's new token (or its end); drop the rows that finished."""
        for item in items:
            if item.last in item.eos:
                item.done = True
                item.ticket.sink.finish("stop")
                continue
            item.ticket.sink.token(item.last)
            item.made += 1
            self.stats.tokens_generated += 1
            if item.made >= item.ticket.row.max_new_tokens:
                item.done = True
                item.ticket.sink.finish("length")
        if any(item.done for item in self._live):
            self._drop_finished()

    def _drop_finished(self) -> None:
        keep = [index for index, item in enumerate(self._live) if not item.done]
        self._live = [self._live[index] for index in keep]
        self.stats.running = len(self._live)
        if not self._live or self._cache is None:
            self._cache = None
            return
        cut = min(item.pad for item in self._live)  # columns every remaining row has empty
        rows = torch.tensor(keep)
        for layer in _plain_layers(self._cache):
            keys, values = _kv(layer)
            layer.keys, layer.values = keys[rows, :, cut:], values[rows, :, cut:]
        for item in self._live:
            item.pad -= cut


def _choose(items: Sequence[_Live], logits: torch.Tensor) -> list[int]:
    """Each row's next token: the argmax, or its own draw when it samples."""
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    for index, item in enumerate(items):
        if item.generator is not None:
            tokens[index] = draw_token(logits[index], item.ticket.row.temperature, item.generator)
    return tokens


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``(rows, heads, columns, dim)`` with empty (zero) columns added on the left to ``width``."""
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    zeros = tensor.new_zeros(tensor.shape[0], tensor.shape[1], missing, tensor.shape[3])
    return torch.cat([zeros, tensor], dim=2)


def _plain_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, each a plain full-attention :class:`DynamicLayer`.

    Raises:
        ModelError: A layer of another kind (sliding window, linear attention, quantised).
    """
    layers = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or type(layer) is not DynamicLayer:
            raise ModelError(
                "a continuously batched model's cache layers must be full-attention "
                f"DynamicLayer, got {type(layer).__name__}; set its adapter's "
                "continuous_batching to False."
            )
        layers.append(layer)
    return layers


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values."""
    keys, values = layer.keys, layer.values
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise ModelError("a cache layer must hold keys and values after the prefill, got none.")
    return keys, values

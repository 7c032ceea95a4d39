"""Read and overwrite per-head attention outputs at the last prompt token.

How this connects:

- **Where.** Every decoder layer ends its attention in ``o_proj``, a linear map whose
  *input* ``(batch, seq, H * D)`` is the concatenation of the ``H`` heads' outputs (head ``h``
  in columns ``h * D:(h + 1) * D``). ``client.models.adapters`` says where those projections
  are in each architecture and what ``H`` and ``D`` are; this module never branches on names.
- **How.** Plain torch ``forward_pre_hook``s on those projections, as MTV's official code
  intervenes on the same input. Every hook goes through :func:`registered_pre_hooks`, which
  removes all handles in ``finally``: no hook outlives its ``with`` block, also on error.
- **What for.** :func:`capture_last_token_heads` reads the activations that sites average,
  clip and release (design.md §1, step 2). :func:`patch_heads` writes a released task vector
  back at inference (step 8), under one of two :class:`PatchPolicy` values;
  :func:`patch_first_decoding_step` writes a public answer's end after the first token.
- **Position.** Both act at position ``-1``. Prompts are left-padded
  (``ModelAdapter.build_batch_inputs``), so ``-1`` is every row's last prompt token.
- **Layers.** Indices are decoder-layer indices. A hybrid model's layers without heads
  (linear attention, convolution) read as zeros in a capture and cannot be patched.
- **Length.** Both refuse a prompt longer than the model's context before the forward runs
  (``client.models.check_prompt_length``), rather than let positions run past the rotary
  range or memory run out mid-release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

from client.models.adapters import HeadShape, ModelAdapter, check_prompt_length
from dpmtv_common.errors import ConfigError, ModelError
from dpmtv_common.heads import HeadSet

__all__ = [
    "HeadCapture",
    "PatchPolicy",
    "PatchRecord",
    "capture_last_token_heads",
    "patch_first_decoding_step",
    "patch_heads",
    "prompt_length_guard",
    "registered_pre_hooks",
]

PreHook = Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...] | None]


class PatchPolicy(StrEnum):
    """Which forward calls :func:`patch_heads` overwrites (always at the last position)."""

    PROMPT_LAST_TOKEN = "prompt-last-token"  # noqa: S105 (a policy name, not a secret)
    """Only calls with ``seq_len > 1``: in KV-cache ``generate()``, the prefill's last token.
    A one-token prompt, or speculative decoding, would break this rule of thumb."""
    EVERY_CALL = "every-call"
    """Every call, so also each generated token (what MTV's official code does)."""


@contextmanager
def registered_pre_hooks(
    hooks: Iterable[tuple[nn.Module, PreHook]],
) -> Iterator[list[RemovableHandle]]:
    """Register forward pre-hooks for the ``with`` block and remove them all on exit.

    Args:
        hooks: ``(module, hook)`` pairs; each hook may return replacement positional args.

    Yields:
        The handles, in registration order (``remove()`` is idempotent).
    """
    handles: list[RemovableHandle] = []
    try:
        for module, hook in hooks:
            handles.append(module.register_forward_pre_hook(hook))
        yield handles
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def prompt_length_guard(model: PreTrainedModel) -> Iterator[None]:
    """Refuse, before the forward runs, any call whose prompt exceeds the model's context.

    A forward pre-hook on the model itself sees ``input_ids`` before any layer does.

    Raises:
        PromptTooLongError: on such a call (from ``check_prompt_length``).
    """

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2:
            check_prompt_length(model, int(input_ids.shape[1]))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _head_input(args: tuple[Any, ...], shape: HeadShape) -> torch.Tensor:
    """Return ``o_proj``'s input from hook args, checked to be ``(batch, seq, H * D)``."""
    hidden = args[0]
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
        raise ModelError(f"o_proj input must be a (batch, seq, H*D) tensor, got {type(hidden)}.")
    return hidden


@dataclass
class HeadCapture:
    """Last-position head activations recorded by :func:`capture_last_token_heads`.

    ``calls[l]`` holds one float32 CPU tensor ``(batch, H, D)`` per forward call of decoder
    layer ``l``; a layer that carries no heads (``l`` not in ``shape.head_layers``) records
    nothing and reads as zeros.
    """

    shape: HeadShape
    calls: list[list[torch.Tensor]] = field(default_factory=list)

    def activations(self) -> torch.Tensor:
        """Stack the recorded calls into one float32 tensor ``(batch_total, L, H, D)``.

        Calls are concatenated along the batch axis, in call order.

        Raises:
            ModelError: Nothing was recorded, or layers saw different numbers of calls.
        """
        hooked = [self.calls[layer] for layer in self.shape.head_layers]
        counts = {len(layer_calls) for layer_calls in hooked}
        if counts == {0}:
            raise ModelError("capture must see at least one forward pass, got none.")
        if len(counts) != 1:
            raise ModelError(f"every layer must see the same calls, got counts {sorted(counts)}.")
        per_layer = [torch.cat(layer_calls, dim=0) for layer_calls in hooked]
        batch, heads, dim = per_layer[0].shape
        dense = torch.zeros(batch, self.shape.num_layers, heads, dim, dtype=torch.float32)
        dense[:, list(self.shape.head_layers)] = torch.stack(per_layer, dim=1)
        return dense


@contextmanager
def capture_last_token_heads(
    model: PreTrainedModel, adapter: ModelAdapter
) -> Iterator[HeadCapture]:
    """Record every layer's per-head ``o_proj`` input at the last position of each forward.

    Use it around plain forward passes (in ``generate()`` each decoding step is a call too).

    Yields:
        A :class:`HeadCapture`; call ``activations()`` after the forward passes.
    """
    shape = adapter.head_shape(model)
    capture = HeadCapture(shape, [[] for _ in range(shape.num_layers)])

    def make_hook(layer: int) -> PreHook:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            hidden = _head_input(args, shape)
            last = hidden[:, -1].detach().reshape(hidden.shape[0], shape.num_heads, shape.head_dim)
            capture.calls[layer].append(last.to(device="cpu", dtype=torch.float32))

        return hook

    projections = adapter.projections_by_layer(model)
    with (
        prompt_length_guard(model),
        registered_pre_hooks((p, make_hook(i)) for i, p in projections.items()),
    ):
        yield capture


@dataclass
class PatchRecord:
    """How often :func:`patch_heads` overwrote each patched layer (``layer -> calls``)."""

    calls_by_layer: dict[int, int]

    @property
    def total_calls(self) -> int:
        """Patched forward calls summed over layers."""
        return sum(self.calls_by_layer.values())


def _validated_values(
    heads: HeadSet, values: torch.Tensor | npt.NDArray[np.floating[Any]], shape: HeadShape
) -> torch.Tensor:
    """Check ``heads`` against the model and ``values`` against ``heads``; return float32."""
    if len(heads) == 0:
        raise ConfigError("heads must hold at least one head, got an empty HeadSet.")
    for layer, head in heads.heads:
        if layer >= shape.num_layers or head >= shape.num_heads:
            raise ConfigError(
                f"heads must lie within {shape.num_layers} layers x {shape.num_heads} heads, "
                f"got {(layer, head)!r}."
            )
        if layer not in shape.head_layers:
            raise ConfigError(
                f"heads must lie in layers that carry heads {list(shape.head_layers)}, got "
                f"{(layer, head)!r}: decoder layer {layer} has no attention heads (a hybrid "
                "model's linear-attention or convolution layer)."
            )
    # A copy: released artifacts are read-only arrays, which torch cannot wrap safely.
    tensor = torch.tensor(np.asarray(values), dtype=torch.float32)
    expected = (len(heads), shape.head_dim)
    if tuple(tensor.shape) != expected:
        raise ConfigError(
            f"values must have shape (len(heads), head_dim) = {expected}, "
            f"got {tuple(tensor.shape)}."
        )
    if not torch.isfinite(tensor).all():
        raise ConfigError("values must be finite, got NaN or infinity.")
    return tensor


@contextmanager
def patch_heads(
    model: PreTrainedModel,
    adapter: ModelAdapter,
    heads: HeadSet,
    values: torch.Tensor | npt.NDArray[np.floating[Any]],
    *,
    policy: PatchPolicy,
) -> Iterator[PatchRecord]:
    """Overwrite the given heads' ``o_proj`` input at the last position with ``values``.

    Args:
        model: The model to patch (its weights are never modified).
        adapter: The model's adapter.
        heads: The heads to overwrite; row ``i`` of ``values`` goes to ``heads.heads[i]``.
        values: Activations, shape ``(len(heads), D)``; cast to the model's dtype per call.
        policy: Which forward calls to patch (see :class:`PatchPolicy`).

    Yields:
        A :class:`PatchRecord` counting the patched calls per layer.

    Raises:
        ConfigError: A head is out of range, or ``values`` has the wrong shape.
    """
    policy = PatchPolicy(policy)

    def patches(layer: int, seq_len: int) -> bool:
        return policy is PatchPolicy.EVERY_CALL or seq_len > 1

    with _patched_calls(model, adapter, heads, values, patches) as record:
        yield record


@contextmanager
def patch_first_decoding_step(
    model: PreTrainedModel,
    adapter: ModelAdapter,
    heads: HeadSet,
    values: torch.Tensor | npt.NDArray[np.floating[Any]],
) -> Iterator[PatchRecord]:
    """Overwrite the heads at the first decoding step after each prompt, and only there.

    In KV-cache ``generate()`` the prompt is one call (``seq_len > 1``) and every generated
    token one more (``seq_len == 1``); this patches the call that reads the first generated
    token. It is how an answer's end, learnt from public data
    (``client.inference.answer_end``), is put where a one-token answer ends. Arguments,
    result and errors as :func:`patch_heads`.
    """
    steps_since_prompt = {layer: 0 for layer in heads.layers}

    def patches(layer: int, seq_len: int) -> bool:
        if seq_len > 1:  # a new prompt: count its decoding steps afresh
            steps_since_prompt[layer] = 0
            return False
        steps_since_prompt[layer] += 1
        return steps_since_prompt[layer] == 1

    with _patched_calls(model, adapter, heads, values, patches) as record:
        yield record


@contextmanager
def _patched_calls(
    model: PreTrainedModel,
    adapter: ModelAdapter,
    heads: HeadSet,
    values: torch.Tensor | npt.NDArray[np.floating[Any]],
    patches: Callable[[int, int], bool],
) -> Iterator[PatchRecord]:
    """Overwrite ``heads`` at the last position of the calls ``patches(layer, seq_len)`` picks."""
    shape = adapter.head_shape(model)
    table = _validated_values(heads, values, shape)
    rows = heads.row_layers()
    head_index = torch.as_tensor(heads.to_array()[:, 1])
    record = PatchRecord({layer: 0 for layer in heads.layers})

    def make_hook(layer: int) -> PreHook:
        mask = torch.as_tensor(rows == layer)
        index, layer_values = head_index[mask], table[mask]  # (k,), (k, D)

        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            hidden = _head_input(args, shape)
            if not patches(layer, hidden.shape[1]):
                return None
            patched = hidden.clone(memory_format=torch.contiguous_format)
            per_head = patched.view(*hidden.shape[:2], shape.num_heads, shape.head_dim)
            per_head[:, -1, index.to(hidden.device)] = layer_values.to(hidden)
            record.calls_by_layer[layer] += 1
            return (patched, *args[1:])

        return hook

    projections = adapter.projections_by_layer(model)
    hooks = ((projections[layer], make_hook(layer)) for layer in heads.layers)
    with prompt_length_guard(model), registered_pre_hooks(hooks):
        yield record

"""Head selection on public data (no privacy cost): the ``select-heads`` command's engine.

Two methods, both starting from the mean last-token activation μ of K-shot prompts built
from the public set's chunks:

* ``attribution`` (cheap): average, over public zero-shot queries, the first-order gain in
  log p(first answer token) from overwriting head h with μ_h (attribution patching); keep the
  k best heads. One forward and backward pass a query.
* ``reinforce`` (MTV, Huang et al. 2024, §3.2 and its official code): independent Bernoulli
  gates over all heads the model carries, θ initialised to −1; each step draws one zero-shot
  query and ``samples`` gate masks, patches the masked heads with μ, scores each mask by the
  cross-entropy of the first answer token, standardises the losses and takes an Adam step
  on Σ log p(mask)·loss. Finally ``final_draws`` masks are scored on the first queries and
  the best is kept (its size is whatever the policy learned, as in MTV).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch
from tqdm import tqdm

from client.activations.chunking import Chunk
from client.activations.extraction import (
    batched,
    chunk_prompt,
    forward_last_token_heads,
    zero_shot_prompt,
)
from client.activations.hooks import PatchPolicy, patch_heads
from client.activations.scoring import answer_token_ids, last_token_attribution
from client.data.records import Record
from client.models import LoadedModel
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

__all__ = [
    "ReinforceSettings",
    "SelectionMethod",
    "AttributionTerms",
    "QueryTerms",
    "attribution_gains",
    "attribution_terms",
    "public_activations",
    "query_terms",
    "select_heads_attribution",
    "select_heads_reinforce",
    "suggested_clip_norm",
    "top_heads",
]


class SelectionMethod(StrEnum):
    """How ``select-heads`` ranks heads on public data."""

    ATTRIBUTION = "attribution"
    REINFORCE = "reinforce"


@dataclass(frozen=True)
class ReinforceSettings:
    """MTV's REINFORCE defaults: 600 steps, 32 samples, Adam lr 0.1."""

    steps: int = 600
    samples: int = 32
    learning_rate: float = 0.1
    final_draws: int = 10
    final_queries: int = 50
    seed: int = 0


def public_activations(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    *,
    batch_size: int = 4,
    instruction: str | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """Last-token activations of the public chunks' K-shot prompts, ``(m, L, H, D)``."""
    if not chunks:
        raise ConfigError("chunks must hold at least one chunk, got none.")
    parts = []
    with tqdm(total=len(chunks), desc="public", unit="chunk", disable=not progress) as bar:
        for batch in batched(chunks, batch_size):
            prompts = [chunk_prompt(c) for c in batch]
            parts.append(forward_last_token_heads(loaded, prompts, instruction=instruction))
            bar.update(len(batch))
    return torch.cat(parts)


def suggested_clip_norm(activations: torch.Tensor, heads: HeadSet) -> float:
    """Median, over public chunks and layers in scope, of a layer's in-scope head norm.

    Clipping at the median keeps half the chunks unclipped; it is computed on public data
    only, so it costs no privacy.
    """
    index = heads.to_array()
    rows = activations[:, index[:, 0], index[:, 1]]  # (m, n, D)
    layers = heads.row_layers()
    norms = [
        rows[:, torch.as_tensor(layers == layer)].flatten(1).norm(dim=1) for layer in heads.layers
    ]
    return float(torch.cat(norms).median())


def attribution_gains(
    loaded: LoadedModel,
    mean: torch.Tensor,
    queries: Sequence[Record],
    *,
    batch_size: int = 4,
    instruction: str | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Per head ``(L, H)``: the first-order gain in log p(answer) from overwriting it with μ.

    Summed over ``queries`` (zero-shot prompts, first answer token); one forward and backward
    pass a query. ``progress`` shows a bar of the queries scored.
    """
    terms = attribution_terms(
        loaded, queries, batch_size=batch_size, instruction=instruction, progress=progress
    )
    return terms.gains(mean)


@dataclass(frozen=True)
class AttributionTerms:
    """What the summed attribution gain of any reference needs: it is linear in the reference.

    Σ_q (μ − z_q)·g_q = μ·G − c with G = Σ_q g_q ``(L, H, D)`` and c = Σ_q z_q·g_q ``(L, H)``,
    for the queries' zero-shot activations z_q and gradients g_q of log p(answer).
    """

    gradient_sum: torch.Tensor
    offset: torch.Tensor

    def gains(self, reference: torch.Tensor) -> torch.Tensor:
        """The summed gain ``(L, H)`` of overwriting each head with ``reference`` ``(L, H, D)``."""
        return (reference.float() * self.gradient_sum).sum(dim=-1) - self.offset


def _attribution_passes(
    loaded: LoadedModel,
    queries: Sequence[Record],
    *,
    batch_size: int,
    instruction: str | None,
    progress: bool,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each batch's zero-shot activations and gradients ``(B, L, H, D)``, in query order."""
    with tqdm(total=len(queries), desc="attribution", unit="query", disable=not progress) as bar:
        for start in range(0, len(queries), batch_size):
            batch = queries[start : start + batch_size]
            prompts = [zero_shot_prompt(r) for r in batch]
            yield last_token_attribution(
                loaded, prompts, [r.answer for r in batch], instruction=instruction
            )
            bar.update(len(batch))


def attribution_terms(
    loaded: LoadedModel,
    queries: Sequence[Record],
    *,
    batch_size: int = 4,
    instruction: str | None = None,
    progress: bool = False,
) -> AttributionTerms:
    """The queries' :class:`AttributionTerms`: one forward and backward pass a query."""
    shape = loaded.adapter.head_shape(loaded.model)
    gradient_sum = torch.zeros(shape.num_layers, shape.num_heads, shape.head_dim)
    offset = torch.zeros(shape.num_layers, shape.num_heads)
    passes = _attribution_passes(
        loaded, queries, batch_size=batch_size, instruction=instruction, progress=progress
    )
    for acts, grads in passes:
        gradient_sum += grads.sum(dim=0)
        offset += (acts * grads).sum(dim=(0, -1))
    return AttributionTerms(gradient_sum, offset)


@dataclass(frozen=True)
class QueryTerms:
    """Each query's own attribution terms: what a simulated vote of each chunk needs.

    ``activations`` z_q and ``gradients`` g_q ``(Q, L, H, D)``: the zero-shot last-token
    head outputs of each query and the gradients of log p(its first answer token) there.
    """

    activations: torch.Tensor
    gradients: torch.Tensor

    def __len__(self) -> int:
        return len(self.activations)

    def gains(self, reference: torch.Tensor) -> torch.Tensor:
        """Each query's gain ``(Q, L, H)`` of overwriting each head with ``reference``."""
        return ((reference.float()[None] - self.activations) * self.gradients).sum(dim=-1)

    def summed(self) -> AttributionTerms:
        """The queries' summed :class:`AttributionTerms`."""
        offset = (self.activations * self.gradients).sum(dim=(0, -1))
        return AttributionTerms(self.gradients.sum(dim=0), offset)


def query_terms(
    loaded: LoadedModel,
    queries: Sequence[Record],
    *,
    batch_size: int = 4,
    instruction: str | None = None,
) -> QueryTerms:
    """Every query's :class:`QueryTerms` (one forward and backward pass a query, kept apart)."""
    passes = list(
        _attribution_passes(
            loaded, queries, batch_size=batch_size, instruction=instruction, progress=False
        )
    )
    if not passes:
        raise ConfigError("query_terms needs at least one query, got none.")
    acts, grads = zip(*passes, strict=True)
    return QueryTerms(torch.cat(acts).float(), torch.cat(grads).float())


def top_heads(loaded: LoadedModel, gain: torch.Tensor, *, k: int) -> HeadSet:
    """The k carried heads of highest ``gain`` ``(L, H)`` (ties: the lower index first).

    Only heads the model carries are ranked (none of a hybrid's headless layers).

    Raises:
        ConfigError: k outside [1, the heads the model carries].
    """
    _check_k(loaded, k)
    layout = loaded.adapter.head_shape(loaded.model).layout()
    candidates = layout.candidates()
    ranked = torch.argsort(gain.flatten()[candidates], descending=True, stable=True)[:k]
    return layout.heads_at(candidates[int(i)] for i in ranked)


def _check_k(loaded: LoadedModel, k: int) -> None:
    carried = len(loaded.adapter.head_shape(loaded.model).layout().candidates())
    if not 1 <= k <= carried:
        raise ConfigError(f"k must lie in [1, {carried}] (the heads the model carries), got {k!r}.")


def select_heads_attribution(
    loaded: LoadedModel,
    mean: torch.Tensor,
    queries: Sequence[Record],
    *,
    k: int,
    batch_size: int = 4,
    instruction: str | None = None,
    progress: bool = False,
) -> HeadSet:
    """The k heads whose overwrite with μ most raises log p(answer), to first order.

    Only heads the model carries are ranked (none of a hybrid's headless layers).
    ``progress`` shows a bar of the queries scored, with an estimate of the time left.
    """
    _check_k(loaded, k)  # before any forward pass
    gain = attribution_gains(
        loaded, mean, queries, batch_size=batch_size, instruction=instruction, progress=progress
    )
    return top_heads(loaded, gain, k=k)


def _first_token_loss(
    loaded: LoadedModel,
    record: Record,
    mean: torch.Tensor,
    mask: torch.Tensor,
    instruction: str | None,
) -> float:
    chosen = mask.nonzero().tolist()
    inputs = loaded.adapter.build_batch_inputs(
        loaded.processor, [zero_shot_prompt(record)], instruction=instruction
    ).to(loaded.model.device)
    target = answer_token_ids(loaded, [record.answer]).to(loaded.model.device)
    with torch.no_grad():
        if chosen:
            heads = HeadSet.of((int(layer), int(head)) for layer, head in chosen)
            values = mean[heads.to_array()[:, 0], heads.to_array()[:, 1]]
            with patch_heads(
                loaded.model, loaded.adapter, heads, values, policy=PatchPolicy.EVERY_CALL
            ):
                logits = loaded.model(**inputs).logits[:, -1].float()
        else:
            logits = loaded.model(**inputs).logits[:, -1].float()
    return float(torch.nn.functional.cross_entropy(logits, target))


def select_heads_reinforce(
    loaded: LoadedModel,
    mean: torch.Tensor,
    queries: Sequence[Record],
    *,
    settings: ReinforceSettings = ReinforceSettings(),
    instruction: str | None = None,
    progress: bool = True,
) -> HeadSet:
    """MTV's REINFORCE head selection; see the module docstring."""
    if not queries:
        raise ConfigError("queries must hold at least one public query, got none.")
    generator = torch.Generator().manual_seed(settings.seed)
    carried = _carried_mask(loaded)
    logits = torch.full(mean.shape[:2], -1.0, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=settings.learning_rate)
    for step in tqdm(range(settings.steps), desc="reinforce", disable=not progress):
        record = queries[step % len(queries)]
        probs = torch.sigmoid(logits).clamp(1e-3, 1 - 1e-3)
        masks = carried * torch.bernoulli(
            probs.detach().expand(settings.samples, -1, -1), generator=generator
        )
        losses = torch.tensor(
            [_first_token_loss(loaded, record, mean, m, instruction) for m in masks]
        )
        normalised = (losses - losses.mean()) / (losses.std() + 1e-3)
        log_probs = (carried * (masks * probs.log() + (1 - masks) * (1 - probs).log())).sum(
            dim=(1, 2)
        )
        optimizer.zero_grad()
        (log_probs * normalised).sum().backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return _best_final_mask(
        loaded, mean, queries, logits.detach(), settings, generator, instruction, carried
    )


def _carried_mask(loaded: LoadedModel) -> torch.Tensor:
    """1.0 for each (layer, head) the model carries, 0.0 in a hybrid's headless layers."""
    layout = loaded.adapter.head_shape(loaded.model).layout()
    mask = torch.zeros(layout.dense_size)
    mask[layout.candidates()] = 1.0
    return mask.reshape(layout.num_layers, layout.num_heads)


def _best_final_mask(
    loaded: LoadedModel,
    mean: torch.Tensor,
    queries: Sequence[Record],
    logits: torch.Tensor,
    settings: ReinforceSettings,
    generator: torch.Generator,
    instruction: str | None,
    carried: torch.Tensor,
) -> HeadSet:
    probs = torch.sigmoid(logits).clamp(1e-3, 1 - 1e-3)
    scored = queries[: settings.final_queries]
    best_loss, best_mask = np.inf, None
    for _ in range(settings.final_draws):
        mask = carried * torch.bernoulli(probs, generator=generator)
        loss = float(
            np.mean([_first_token_loss(loaded, r, mean, mask, instruction) for r in scored])
        )
        if mask.any() and loss < best_loss:
            best_loss, best_mask = loss, mask
    if best_mask is None:
        raise ConfigError("REINFORCE selected no head in any final draw; run more steps.")
    return HeadSet.of((int(layer), int(head)) for layer, head in best_mask.nonzero().tolist())

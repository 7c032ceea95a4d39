"""Private head selection simulated on a held-out public task, as a release would run it.

Task-agnostic choices (:mod:`client.public.scope`) let each public task in turn play the
private one. For private selection they pick the held-out task's heads the way the release
picks the private task's, so that its held-out accuracy predicts what the order will do:

* **select-first** (shift votes, then the Gaussian on the picked heads): each chunk scores
  the plan's candidate heads by ‖z_h(K-shot prompt) − z_h(zero-shot query)‖ and votes for
  its top r among them (``client.activations.scoring``); the coordinator keeps the Gumbel
  top-k of the vote sums over the candidates.
* **release-first** (the Gaussian on the candidates, then attribution votes): each chunk
  scores the candidates by the attribution gain of overwriting each with the released noisy
  vector and votes for its top r among them; the Gumbel top-k over the candidates is kept.

The candidates are the plan's public candidate heads, or every carried head when it names
none (``protocol.vote_slots``).

The held-out task holds a few dozen chunks where the release pools m: the vote sums are the
held-out chunks' mean vote times m (their expectation at m chunks), given the planned
Gumbel noise (scale β = 2·Δ∞/ε₀ of the planned calibration). The chunks' zero-shot
activations and gradients come from the task's own queries (``PublicTask.chunk_terms``),
which are its first chunks' queries, as a site's chunk scores its own query; the caller
(``client.public.scope``) scores the picks of one half of them on the other half's queries.

Everything reads public data and public plan numbers only: no privacy budget is spent; the
simulated Gumbel noise comes from ``dpmtv_common.privacy.noise`` and never leaves the process.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from client.activations.scoring import votes_among
from client.public.selection import QueryTerms
from client.public.tasks import PublicTask
from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.noise import NoiseSource

__all__ = ["attribution_votes", "chunk_terms_of", "noisy_pick", "shift_votes"]


def chunk_terms_of(task: PublicTask) -> QueryTerms:
    """The task's per-query terms (``PublicTask.chunk_terms``); refused when it has none."""
    if task.chunk_terms is None or len(task.chunk_terms) == 0:
        raise ConfigError(
            f"public task {task.name!r} must carry its chunks' query terms to simulate private "
            "selection, got none (build it with public_task)."
        )
    return task.chunk_terms


def shift_votes(task: PublicTask, among: Sequence[int], *, top_r: int) -> Float64Array:
    """Each scored chunk's top-r shift votes ``(Q, L * H)`` among the dense slots ``among``."""
    terms = chunk_terms_of(task)
    shots = task.activations[: len(terms)].float()
    scores = (shots - terms.activations).norm(dim=-1).reshape(len(terms), -1)
    return votes_among(scores.double().numpy(), among, top_r)


def attribution_votes(
    task: PublicTask, reference: torch.Tensor, among: Sequence[int], *, top_r: int
) -> Float64Array:
    """Each scored chunk's top-r votes ``(Q, L * H)`` by attribution against ``reference``.

    Cast among the dense slots ``among``.
    """
    terms = chunk_terms_of(task)
    scores = terms.gains(reference).reshape(len(terms), -1)
    return votes_among(scores.double().numpy(), among, top_r)


def noisy_pick(
    votes: Float64Array,
    layout: HeadLayout,
    *,
    candidates: Sequence[int],
    k: int,
    num_chunks: int,
    gumbel_scale: float,
    noise: NoiseSource,
) -> HeadSet:
    """The Gumbel top-k of the expected vote sums at ``num_chunks`` over ``candidates``.

    ``candidates``: dense slots the plan picks among (its candidate heads, or every carried
    head). Raises ConfigError when k exceeds them.
    """
    if not 1 <= k <= len(candidates):
        raise ConfigError(f"k must lie in [1, {len(candidates)}] (the candidates), got {k!r}.")
    sums = np.asarray(votes, dtype=np.float64).mean(axis=0)[list(candidates)] * num_chunks
    picked = noise.gumbel_top_k(sums, k=k, scale=gumbel_scale)
    return layout.heads_at(candidates[index] for index in picked)

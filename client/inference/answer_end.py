"""Where a one-token answer ends, learnt from public data: a second, public patch.

A task vector patched at the prompt's last token makes a decoder *begin* with the task's
answer; it does not say where the answer ends. A decoder whose own habit is to go on (the
pretrained decoder captions its scenes: ``"yellow square4 right"``) then writes the answer and
more, where in-context examples would have shown it to stop. What examples teach about
stopping is not the private task's: every labelled task of the domain shows it. So it is
learnt here from PUBLIC labelled data alone:

* each public chunk (K answered demonstrations, then a query) is run through ``generate()``
  with the query's answer forced as the first generated token;
* the heads are read at the decoding step that takes that token in, the step that decides
  what follows the answer (in the examples: the end of the turn);
* their mean, each public task weighing the same, in the release's heads, is patched at the
  first decoding step of every query (:func:`client.activations.hooks.patch_first_decoding_step`).

It ends an answer after its first token, so it fits tasks whose answers are one token (class
labels of one word); public answers of more tokens are skipped and counted. An answer is
tokenised as the tokenizer encodes it alone.

Privacy: public data and the released heads only; no private record is read, no budget spent.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from client.activations.chunking import Chunk, make_chunks
from client.activations.extraction import batched, chunk_prompt
from client.activations.hooks import HeadCapture, capture_last_token_heads
from client.data.records import SiteDataset
from client.models import LoadedModel
from dpmtv_common.errors import DataError
from dpmtv_common.heads import HeadSet

__all__ = ["AnswerEnd", "learn_answer_end"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnswerEnd:
    """The public answer's end in the release's heads.

    Attributes:
        values: float32 ``(len(heads), D)``, patched at the first decoding step.
        chunks: Public chunks it was learnt from (one-token answers).
        skipped: Public chunks left out because their answer is more than one token.
    """

    values: torch.Tensor
    chunks: int
    skipped: int


class _ForcedTokens(LogitsProcessor):
    """Make greedy decoding emit row ``i``'s token ``ids[i]`` (at every step it runs)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, float("-inf"))
        rows = torch.arange(scores.shape[0], device=scores.device)
        forced[rows, self.ids.to(scores.device)] = 0.0
        return forced  # type: ignore[return-value]


def learn_answer_end(
    loaded: LoadedModel,
    datasets: Sequence[SiteDataset],
    heads: HeadSet,
    *,
    shots: int,
    instruction: str | None = None,
    max_chunks: int = 30,
    seed: int = 0,
    batch_size: int = 8,
) -> AnswerEnd:
    """The mean public activation at the step that reads a one-token answer, in ``heads``.

    Args:
        loaded: The site's model, prompted as the release's queries will be.
        datasets: Labelled PUBLIC datasets (never the site's private data).
        heads: The release's heads.
        shots: K, the release's demonstrations per chunk.
        instruction: The release's instruction, put before every prompt.
        max_chunks: Chunks taken from each public dataset.
        seed: The chunks' shuffle (public data: no secret needed).
        batch_size: Chunks per ``generate()`` call.

    Raises:
        DataError: No public chunk has a one-token answer.
    """
    tokenizer = loaded.processor.tokenizer
    task_means: list[torch.Tensor] = []
    used = skipped = 0
    for dataset in datasets:
        chunks = make_chunks(dataset, shots=shots, seed=seed, max_chunks=max_chunks).chunks
        one_token = [c for c in chunks if len(_answer_ids(tokenizer, c)) == 1]
        skipped += len(chunks) - len(one_token)
        if one_token:
            reads = [
                _answer_step(loaded, batch, instruction) for batch in batched(one_token, batch_size)
            ]
            task_means.append(torch.cat(reads).mean(0))
            used += len(one_token)
    if not task_means:
        raise DataError(
            "the answer's end is learnt from public answers of one token, got none among "
            f"{skipped} public chunks of {len(datasets)} dataset(s)."
        )
    mean = torch.stack(task_means).mean(0)  # (L, H, D): each public task weighs the same
    index = heads.to_array()
    logger.debug("answer's end learnt from %d public chunks (%d skipped)", used, skipped)
    return AnswerEnd(mean[index[:, 0], index[:, 1]].clone(), used, skipped)


def _answer_ids(tokenizer: object, chunk: Chunk) -> list[int]:
    ids: list[int] = tokenizer(chunk.query.answer, add_special_tokens=False).input_ids  # type: ignore[operator]
    return ids


@torch.no_grad()
def _answer_step(
    loaded: LoadedModel, chunks: Sequence[Chunk], instruction: str | None
) -> torch.Tensor:
    """Every head at the decoding step that reads each chunk's forced answer, ``(B, L, H, D)``."""
    tokenizer = loaded.processor.tokenizer
    answers = torch.tensor([_answer_ids(tokenizer, c)[0] for c in chunks])
    prompts = [chunk_prompt(c) for c in chunks]
    inputs = loaded.adapter.build_batch_inputs(loaded.processor, prompts, instruction=instruction)
    inputs = inputs.to(loaded.model.device)
    with capture_last_token_heads(loaded.model, loaded.adapter) as capture:
        loaded.model.generate(  # type: ignore[operator]
            **inputs,
            max_new_tokens=2,  # the prompt's call, then the one that reads the answer
            do_sample=False,
            logits_processor=LogitsProcessorList([_ForcedTokens(answers)]),
            pad_token_id=tokenizer.pad_token_id,
        )
    reading = [calls[1:2] for calls in capture.calls]  # the first decoding step's call
    return HeadCapture(capture.shape, reading).activations()

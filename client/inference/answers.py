"""Answer queries with a model, optionally patched with a released task vector.

Patching is free post-processing of the released vector: every query a site answers with it
costs no further privacy. Answers are generated greedily and cut at the first line or
sentence end, as MTV's evaluation does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from tqdm import tqdm

from client.activations.hooks import PatchPolicy, patch_first_decoding_step, patch_heads
from client.models import LoadedModel, Prompt, instruction_digest
from dpmtv_common.artifact import ArtifactManifest
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

__all__ = [
    "TaskVectorPatch",
    "check_instruction",
    "first_answer_span",
    "generate_answers",
    "rescale_heads",
]


def first_answer_span(text: str) -> str:
    """The generated answer up to its first line break or sentence-ending period.

    A period followed by a digit is a decimal point ("1.5", ".5"), not a sentence end; a
    period after a number still ends the sentence ("3. Yes" gives "3").
    """
    line = text.strip().split("\n", 1)[0]
    match = re.search(r"\.(?!\d)", line)
    return (line[: match.start()] if match else line).strip()


def rescale_heads(values: npt.ArrayLike, *, target_norm: float) -> npt.NDArray[np.float64]:
    """Scale every head's released vector to L2 norm ``target_norm`` (zero rows stay zero).

    Clipping below the typical norm shrinks the released mean, and noise changes its length;
    restoring each head to a typical norm measured on PUBLIC data is post-processing of the
    released vector, so it costs no privacy (design §1, "signal against noise").
    """
    if not (math.isfinite(target_norm) and target_norm > 0):
        raise ConfigError(f"target_norm must be finite and > 0, got {target_norm!r}.")
    rows = np.array(values, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return np.where(norms > 0, rows * (target_norm / np.where(norms > 0, norms, 1.0)), rows)


def check_instruction(manifest: ArtifactManifest, instruction: str | None, *, remedy: str) -> None:
    """Refuse queries whose instruction is not the one the artifact's prompts carried.

    The released heads were read at the last token of prompts that began with the release's
    instruction; a query prompted with another one is patched at another prompt. An artifact
    made before the field existed records none and is not checked.

    Args:
        manifest: The verified artifact's manifest.
        instruction: The instruction the queries will be prompted with (None: none).
        remedy: How the caller's user gives the right one (a flag, a field, a message).

    Raises:
        ConfigError: The digests differ; the message names both.
    """
    expected = manifest.instruction_sha256
    found = instruction_digest(instruction)
    if expected is not None and expected != found:
        raise ConfigError(
            f"the queries' instruction must be the one the artifact's prompts carried "
            f"(sha256 {expected}), got sha256 {found} "
            f"({'no instruction' if not instruction else f'{len(instruction)} characters'}); "
            f"{remedy}."
        )


@dataclass(frozen=True)
class TaskVectorPatch:
    """Which heads to overwrite, with what, and when.

    Attributes:
        heads: The released heads.
        values: float32 ``(len(heads), D)``, the released mean activations.
        policy: ``prompt-last-token`` or MTV's ``every-call``.
        answer_end: float32 ``(len(heads), D)`` patched at the first decoding step, where a
            one-token answer ends (``client.inference.answer_end``: public data, no privacy
            cost); ``prompt-last-token`` only.
    """

    heads: HeadSet
    values: torch.Tensor
    policy: PatchPolicy = PatchPolicy.PROMPT_LAST_TOKEN
    answer_end: torch.Tensor | None = None

    def __post_init__(self) -> None:
        policy = PatchPolicy(self.policy)
        if self.answer_end is not None and policy is not PatchPolicy.PROMPT_LAST_TOKEN:
            raise ConfigError(
                "an answer's end is patched at the first decoding step, which the policy must "
                f"leave alone: policy must be 'prompt-last-token' with it, got {policy.value!r}."
            )


@contextmanager
def _maybe_patched(loaded: LoadedModel, patch: TaskVectorPatch | None) -> Iterator[None]:
    with ExitStack() as stack:
        if patch is not None:
            model, adapter = loaded.model, loaded.adapter
            stack.enter_context(
                patch_heads(model, adapter, patch.heads, patch.values, policy=patch.policy)
            )
            if patch.answer_end is not None:
                stack.enter_context(
                    patch_first_decoding_step(model, adapter, patch.heads, patch.answer_end)
                )
        yield


@torch.no_grad()
def _generate_batch(
    loaded: LoadedModel, prompts: Sequence[Prompt], *, instruction: str | None, max_new_tokens: int
) -> list[str]:
    inputs = loaded.adapter.build_batch_inputs(loaded.processor, prompts, instruction=instruction)
    inputs = inputs.to(loaded.model.device)
    tokenizer = loaded.processor.tokenizer
    output = loaded.model.generate(  # type: ignore[operator]
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    new_tokens = output[:, inputs["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return [first_answer_span(text) for text in texts]


def generate_answers(
    loaded: LoadedModel,
    prompts: Sequence[Prompt],
    *,
    patch: TaskVectorPatch | None = None,
    instruction: str | None = None,
    max_new_tokens: int = 10,
    batch_size: int = 8,
    progress: bool = False,
) -> list[str]:
    """Greedy answers to ``prompts``, patched with ``patch`` when given."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}.")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}.")
    answers: list[str] = []
    with (
        _maybe_patched(loaded, patch),
        tqdm(total=len(prompts), desc="answer", unit="query", disable=not progress) as bar,
    ):
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            answers += _generate_batch(
                loaded, batch, instruction=instruction, max_new_tokens=max_new_tokens
            )
            bar.update(len(batch))
    return answers

"""Tests of ``client.inference.answer_end``: a public answer's end, read where decoding reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from client.activations.chunking import make_chunks
from client.activations.extraction import chunk_prompt
from client.activations.hooks import PatchPolicy, capture_last_token_heads
from client.data.records import Record, SiteDataset
from client.inference.answer_end import learn_answer_end
from client.inference.answers import TaskVectorPatch
from dpmtv_common.errors import ConfigError, DataError
from dpmtv_common.heads import HeadSet

HEADS = HeadSet.of([(0, 1), (1, 0), (1, 3)])
ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)


def public_set(root: Path, answers: list[str], task: str) -> SiteDataset:
    """A labelled public dataset of ``answers`` on drawn images (one record an answer)."""
    root.mkdir(parents=True, exist_ok=True)
    records = []
    for i, answer in enumerate(answers):
        path = root / f"{task}-{i}.png"
        Image.new("RGB", (48 + 8 * (i % 3), 48), (40 * i % 256, 90, 160)).save(path)
        records.append(Record(f"{task}-{i}", path, "Which one?", (answer,)))
    return SiteDataset(tuple(records), task)


def one_token_words(loaded, count: int) -> list[str]:
    """``count`` letters the tiny tokenizer encodes as one token each."""
    tokenizer = loaded.processor.tokenizer
    words = [
        c
        for c in "abcdefghijklmnopqrstuvwxyz"
        if len(tokenizer(c, add_special_tokens=False).input_ids) == 1
    ]
    assert len(words) >= count, f"the tiny tokenizer has too few one-token letters: {words}"
    return words[:count]


def read_after_answer(loaded, dataset: SiteDataset) -> torch.Tensor:
    """An independent reader: one full forward of prompt + answer token, heads at its end."""
    tokenizer = loaded.processor.tokenizer
    reads = []
    for chunk in make_chunks(dataset, shots=2, seed=0, max_chunks=30).chunks:
        inputs = loaded.adapter.build_batch_inputs(loaded.processor, [chunk_prompt(chunk)])
        answer = tokenizer(chunk.query.answer, add_special_tokens=False).input_ids
        length = inputs["input_ids"].shape[1]
        for key, value in list(inputs.items()):  # per-token tensors: one more, a text token
            if key != "input_ids" and value.ndim == 2 and value.shape[1] == length:
                fill = 1 if key == "attention_mask" else 0
                inputs[key] = torch.cat([value, torch.full((1, 1), fill, dtype=value.dtype)], 1)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([answer])], dim=1)
        with torch.no_grad(), capture_last_token_heads(loaded.model, loaded.adapter) as capture:
            loaded.model(**inputs)
        reads.append(capture.activations()[0])
    index = HEADS.to_array()
    return torch.stack(reads).mean(0)[index[:, 0], index[:, 1]]


def test_the_answer_end_is_the_heads_at_the_step_that_reads_the_answer(loaded, tmp_path):
    # Arrange: five records make one chunk of K = 2 (a demonstration pair and a query) twice
    dataset = public_set(tmp_path / "public", one_token_words(loaded, 6), "letters")

    # Act
    end = learn_answer_end(loaded, [dataset], HEADS, shots=2, batch_size=2)

    # Assert: generation's decoding step equals a full forward over prompt + answer
    assert end.values.shape == (len(HEADS), loaded.adapter.head_shape(loaded.model).head_dim)
    assert (end.chunks, end.skipped) == (2, 0)
    torch.testing.assert_close(end.values, read_after_answer(loaded, dataset), atol=1e-4, rtol=1e-4)


@ONE_ARCH
def test_each_public_task_weighs_the_same(loaded, tmp_path):
    words = one_token_words(loaded, 9)
    small = public_set(tmp_path / "small", words[:3], "small")  # one chunk
    large = public_set(tmp_path / "large", words, "large")  # three chunks

    both = learn_answer_end(loaded, [small, large], HEADS, shots=2).values
    alone = [learn_answer_end(loaded, [d], HEADS, shots=2).values for d in (small, large)]

    torch.testing.assert_close(both, (alone[0] + alone[1]) / 2)


@ONE_ARCH
def test_answers_of_more_than_one_token_are_skipped_and_counted(loaded, tmp_path):
    words = one_token_words(loaded, 3)
    dataset = public_set(tmp_path / "mixed", [*words, "zebra red", "top left", "giraffe"], "mixed")

    end = learn_answer_end(loaded, [dataset], HEADS, shots=2)

    assert end.chunks + end.skipped == 2
    assert end.skipped >= 1


@ONE_ARCH
def test_no_one_token_answer_is_a_data_error_that_says_so(loaded, tmp_path):
    dataset = public_set(tmp_path / "long", ["zebra red", "top left", "giraffe"], "long")

    with pytest.raises(DataError, match="one token, got none among 1 public chunks"):
        learn_answer_end(loaded, [dataset], HEADS, shots=2)


def test_an_answer_end_needs_the_prompt_last_token_policy():
    values = torch.zeros(len(HEADS), 16)

    with pytest.raises(
        ConfigError, match="policy must be 'prompt-last-token' with it, got 'every-call'"
    ):
        TaskVectorPatch(HEADS, values, PatchPolicy.EVERY_CALL, answer_end=values)

"""Tests of ``client.inference.answers`` and of ``client.evaluation.run``, which drives it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from client.activations.extraction import forward_last_token_heads, zero_shot_prompt
from client.activations.hooks import PatchPolicy
from client.data.records import Record
from client.evaluation.metrics import vqa_accuracy
from client.evaluation.run import EvaluationMode, evaluate, icl_prompts
from client.inference.answers import TaskVectorPatch, first_answer_span, generate_answers
from client.models import LoadedModel, PromptTooLongError
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange")
ALL_HEADS = HeadSet.all_heads(num_layers=2, num_heads=4)
# Checks that do not depend on the architecture run on one of them.
ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> tuple[Record, ...]:
    """Six records with drawn images; answer i is unique, so demonstrations can be told apart."""
    root = tmp_path_factory.mktemp("inference-records")
    made = []
    for i, colour in enumerate(COLOURS):
        image = Image.new("RGB", (56, 56 + 8 * (i % 2)), "white")
        ImageDraw.Draw(image).ellipse((6, 8, 44, 44), fill=colour)
        image.save(root / f"img{i}.png")
        question = "What colour is the shape?" if i % 2 else "Which colour?"
        made.append(Record(f"r{i}", root / f"img{i}.png", question, (f"{colour} {i}",)))
    return tuple(made)


def own_patch(loaded, prompt) -> TaskVectorPatch:
    """Every head set to the model's own activation at the prompt's last token."""
    acts = forward_last_token_heads(loaded, [prompt], instruction=None)
    return TaskVectorPatch(ALL_HEADS, acts[0].reshape(len(ALL_HEADS), -1))


# ---------------------------------------------------------------- first_answer_span


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("red", "red"),
        ("  red circle  ", "red circle"),
        ("red circle.\nQuestion: next", "red circle"),
        ("blue\nred. green", "blue"),
        ("\n\n  green square\nmore", "green square"),
        ("It is red. It is round.", "It is red"),
        ("3.5 apples. Then", "3.5 apples"),
        (".5 of it", ".5 of it"),
        ("There are 3. Then more", "There are 3"),
        ("3.", "3"),
        ("v1.2.3 works", "v1.2.3 works"),
        (". leading period", ""),
        ("", ""),
    ],
)
def test_first_answer_span_cuts_at_the_first_line_break_or_sentence_end(text, expected):
    # Act / Assert
    assert first_answer_span(text) == expected


# ---------------------------------------------------------------- generate_answers


def test_unpatched_answers_are_greedy_generate_cut_at_the_first_span(loaded, records):
    # Arrange: the same batch through model.generate by hand
    prompts = [zero_shot_prompt(r) for r in records[:3]]
    inputs = loaded.adapter.build_batch_inputs(loaded.processor, prompts, instruction=None)
    tokenizer = loaded.processor.tokenizer
    with torch.no_grad():
        output = loaded.model.generate(
            **inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    texts = tokenizer.batch_decode(
        output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )
    expected = [first_answer_span(t) for t in texts]

    # Act
    answers = generate_answers(loaded, prompts, max_new_tokens=6, batch_size=3)

    # Assert
    assert answers == expected


def test_patching_every_head_with_its_own_prompt_activation_keeps_the_answer(loaded, records):
    # Arrange
    prompt = zero_shot_prompt(records[0])
    plain = generate_answers(loaded, [prompt], max_new_tokens=6)

    # Act
    patched = generate_answers(loaded, [prompt], patch=own_patch(loaded, prompt), max_new_tokens=6)

    # Assert
    assert patched == plain


def test_patching_every_head_with_other_values_changes_the_answer(loaded, records):
    # Arrange: the same heads, far from the model's own values
    prompt = zero_shot_prompt(records[0])
    plain = generate_answers(loaded, [prompt], max_new_tokens=6)
    patch = own_patch(loaded, prompt)
    far = TaskVectorPatch(patch.heads, torch.full_like(patch.values, 30.0), patch.policy)

    # Act
    patched = generate_answers(loaded, [prompt], patch=far, max_new_tokens=6)

    # Assert: so the no-op test above does patch something
    assert patched != plain


@ONE_ARCH
@pytest.mark.parametrize(
    ("option", "value"), [("max_new_tokens", 0), ("batch_size", 0), ("batch_size", -1)]
)
def test_generation_settings_below_one_are_config_errors(loaded, records, option, value):
    # Act / Assert
    with pytest.raises(ConfigError, match=option):
        generate_answers(loaded, [zero_shot_prompt(records[0])], **{option: value})


# ---------------------------------------------------------------- evaluation.run


def demo_answers(prompt) -> list[str]:
    return [d.answer for d in prompt.demonstrations]


def test_icl_prompts_draw_distinct_support_demonstrations_for_each_query(records):
    # Arrange
    queries, support = records[:2], records[2:]

    # Act
    prompts = icl_prompts(queries, support, shots=3, seed=5)

    # Assert
    assert len(prompts) == len(queries)
    pool = {r.answer for r in support}
    for prompt, query in zip(prompts, queries, strict=True):
        answers = demo_answers(prompt)
        assert len(answers) == len(set(answers)) == 3
        assert set(answers) <= pool
        assert prompt.query.answer is None
        assert prompt.query.question == query.question


def test_icl_prompts_are_deterministic_for_a_seed_and_vary_across_seeds(records):
    # Arrange
    queries, support = records[:2], records[2:]

    def draws(seed: int) -> list[list[str]]:
        return [demo_answers(p) for p in icl_prompts(queries, support, shots=2, seed=seed)]

    # Act
    first, again = draws(11), draws(11)
    others = [draws(seed) for seed in range(5)]

    # Assert
    assert first == again
    assert any(other != first for other in others)


@pytest.mark.parametrize("shots", [0, 5])
def test_icl_shots_outside_one_to_the_support_size_are_config_errors(records, shots):
    # Act / Assert
    with pytest.raises(ConfigError, match="shots"):
        icl_prompts(records[:1], records[2:], shots=shots, seed=0)


@ONE_ARCH
def test_evaluate_accuracy_is_the_mean_vqa_accuracy_of_the_queries(loaded, records):
    # Arrange: references built from the model's own answers, so scores are 1, 2/3 and 0
    queries = records[:3]
    said = generate_answers(loaded, [zero_shot_prompt(r) for r in queries], max_new_tokens=4)
    references = [(said[0],), (said[1], said[1], "zebra", "okapi"), ("zebra okapi",)]
    labelled = [
        Record(r.id, r.image_path, r.question, answers)
        for r, answers in zip(queries, references, strict=True)
    ]

    # Act
    result = evaluate(loaded, labelled, mode=EvaluationMode.ZERO_SHOT, max_new_tokens=4)

    # Assert
    assert result.predictions == tuple(said)
    expected = [vqa_accuracy(p, r.answers) for p, r in zip(said, labelled, strict=True)]
    assert result.scores == pytest.approx(expected)
    assert result.accuracy == pytest.approx(np.mean(expected))
    assert result.scores[0] == 1.0


@ONE_ARCH
def test_evaluate_icl_answers_the_drawn_k_shot_prompts(loaded, records):
    # Arrange
    queries, support = records[:2], records[2:]
    prompts = icl_prompts(queries, support, shots=2, seed=3)

    # Act
    result = evaluate(
        loaded, queries, mode=EvaluationMode.ICL, support=support, shots=2, seed=3, max_new_tokens=4
    )

    # Assert
    assert list(result.predictions) == generate_answers(loaded, prompts, max_new_tokens=4)


@ONE_ARCH
def test_evaluate_artifact_mode_answers_with_the_patch(loaded, records):
    # Arrange
    query = records[0]
    patch = own_patch(loaded, zero_shot_prompt(query))
    far = TaskVectorPatch(patch.heads, torch.full_like(patch.values, 30.0), PatchPolicy.EVERY_CALL)

    # Act
    result = evaluate(loaded, [query], mode=EvaluationMode.ARTIFACT, patch=far, max_new_tokens=4)

    # Assert
    expected = generate_answers(loaded, [zero_shot_prompt(query)], patch=far, max_new_tokens=4)
    assert list(result.predictions) == expected


@ONE_ARCH
@pytest.mark.parametrize(
    ("mode", "with_patch"),
    [
        (EvaluationMode.ARTIFACT, False),
        (EvaluationMode.ZERO_SHOT, True),
        (EvaluationMode.ICL, True),
    ],
)
def test_a_patch_outside_artifact_mode_or_none_in_it_is_a_config_error(
    loaded, records, mode, with_patch
):
    # Arrange
    patch = own_patch(loaded, zero_shot_prompt(records[0])) if with_patch else None

    # Act / Assert
    with pytest.raises(ConfigError, match="patch"):
        evaluate(loaded, records[:1], mode=mode, support=records[2:], shots=2, patch=patch)


@ONE_ARCH
def test_evaluate_without_queries_is_a_config_error(loaded):
    # Act / Assert
    with pytest.raises(ConfigError, match="queries"):
        evaluate(loaded, [], mode=EvaluationMode.ZERO_SHOT)


def test_rescale_heads_sets_every_nonzero_head_to_the_target_norm():
    from client.inference.answers import rescale_heads

    values = np.array([[3.0, 4.0], [0.0, 0.0], [0.6, 0.8]])
    rescaled = rescale_heads(values, target_norm=2.0)
    np.testing.assert_allclose(np.linalg.norm(rescaled, axis=1), [2.0, 0.0, 2.0])
    np.testing.assert_allclose(rescaled[0], [1.2, 1.6])


@pytest.mark.parametrize("target", [0.0, -1.0, float("nan")])
def test_rescale_heads_refuses_a_bad_target(target):
    from client.inference.answers import rescale_heads

    with pytest.raises(ConfigError, match="target_norm"):
        rescale_heads(np.ones((1, 2)), target_norm=target)


@ONE_ARCH
def test_answering_a_prompt_beyond_the_context_fails_before_generating(
    loaded, records, monkeypatch
):
    # Arrange: pretend the context is 8 tokens; patched so the length guard is in place
    monkeypatch.setattr(loaded.model.config.get_text_config(), "max_position_embeddings", 8)
    prompt = zero_shot_prompt(records[0])
    patch = own_patch_zeros(loaded)

    # Act / Assert
    with pytest.raises(PromptTooLongError, match="context of 8 tokens"):
        generate_answers(loaded, [prompt], patch=patch)


@ONE_ARCH
def test_a_tokenizer_without_pad_token_answers_a_batch_of_two(loaded, records):
    # Arrange: a deep copy (a shallow one shares the special tokens) without a pad token
    processor = copy.deepcopy(loaded.processor)
    tokenizer = processor.tokenizer
    tokenizer.pad_token = None
    no_pad = LoadedModel(loaded.model, processor, loaded.adapter, loaded.fingerprint)
    prompts = [zero_shot_prompt(r) for r in records[:2]]

    # Act
    answers = generate_answers(no_pad, prompts, batch_size=2, max_new_tokens=3)

    # Assert: the same answers as one by one, with the pad token set in memory only
    alone = [generate_answers(no_pad, [p], max_new_tokens=3)[0] for p in prompts]
    assert answers == alone
    assert tokenizer.pad_token == tokenizer.eos_token
    assert loaded.processor.tokenizer.pad_token != tokenizer.eos_token


def own_patch_zeros(loaded) -> TaskVectorPatch:
    return TaskVectorPatch(ALL_HEADS, torch.zeros(len(ALL_HEADS), 16))

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.activations.hooks import (
    PatchPolicy,
    capture_last_token_heads,
    patch_first_decoding_step,
    patch_heads,
    prompt_length_guard,
    registered_pre_hooks,
)
from client.models import Prompt, PromptTooLongError
from dpmtv_common.errors import ConfigError, ModelError
from dpmtv_common.heads import HeadSet

TWO_HEADS = HeadSet.of([(0, 1), (1, 3)])


def hook_count(tiny) -> int:
    projections = tiny.adapter.output_projections(tiny.model)
    return sum(len(p._forward_pre_hooks) for p in projections)


def own_values(tiny, inputs) -> torch.Tensor:
    """The model's own last-token activations of every head, as rows ``(L * H, D)``."""
    with torch.no_grad(), capture_last_token_heads(tiny.model, tiny.adapter) as capture:
        tiny.model(**inputs)
    return capture.activations()[0].reshape(-1, 16)


def test_capture_gives_float32_batch_layers_heads_head_dim(tiny, prompt, query):
    inputs = tiny.inputs([prompt, Prompt((), query)])

    with torch.no_grad(), capture_last_token_heads(tiny.model, tiny.adapter) as capture:
        tiny.model(**inputs)
    activations = capture.activations()

    assert activations.shape == (2, 2, 4, 16)
    assert activations.dtype == torch.float32
    assert torch.isfinite(activations).all()


def test_capture_reads_the_o_proj_input_at_the_last_position(tiny, prompt):
    # Arrange: an independent reader of the same tensor
    inputs = tiny.inputs([prompt])
    projection = tiny.adapter.output_projections(tiny.model)[1]
    seen = []
    handle = projection.register_forward_pre_hook(lambda _, args: seen.append(args[0]))

    # Act
    try:
        activations = own_values(tiny, inputs)
    finally:
        handle.remove()

    # Assert
    assert torch.equal(activations[4:8].reshape(-1), seen[0][0, -1].float())


@pytest.mark.parametrize("policy", list(PatchPolicy))
def test_patching_every_head_with_its_own_activation_is_an_exact_no_op(tiny, prompt, policy):
    # Arrange
    inputs = tiny.inputs([prompt])
    clean = tiny.logits(inputs)
    heads = HeadSet.all_heads(num_layers=2, num_heads=4)
    values = own_values(tiny, inputs)

    # Act
    with patch_heads(tiny.model, tiny.adapter, heads, values, policy=policy) as record:
        patched = tiny.logits(inputs)

    # Assert
    assert torch.equal(patched, clean)
    assert record.calls_by_layer == {0: 1, 1: 1}


def test_patching_two_heads_changes_only_the_last_position(tiny, prompt):
    # Arrange
    inputs = tiny.inputs([prompt])
    clean = tiny.logits(inputs)
    values = np.full((2, 16), 3.0, dtype=np.float32)

    # Act
    with patch_heads(
        tiny.model, tiny.adapter, TWO_HEADS, values, policy=PatchPolicy.PROMPT_LAST_TOKEN
    ):
        patched = tiny.logits(inputs)

    # Assert
    assert torch.equal(patched[:, :-1], clean[:, :-1])
    assert (patched[:, -1] - clean[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("policy", "calls_per_layer"),
    [(PatchPolicy.PROMPT_LAST_TOKEN, 1), (PatchPolicy.EVERY_CALL, 3)],
)
def test_generate_with_kv_cache_patches_per_policy(tiny, prompt, policy, calls_per_layer):
    inputs = tiny.inputs([prompt])
    values = torch.full((2, 16), 3.0)

    with patch_heads(tiny.model, tiny.adapter, TWO_HEADS, values, policy=policy) as record:
        tiny.model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)

    assert record.calls_by_layer == {0: calls_per_layer, 1: calls_per_layer}
    assert record.total_calls == 2 * calls_per_layer


def test_first_decoding_step_patch_takes_one_call_per_prompt(tiny, prompt, query):
    values = torch.full((2, 16), 3.0)

    with patch_first_decoding_step(tiny.model, tiny.adapter, TWO_HEADS, values) as record:
        for each in (prompt, Prompt((), query)):  # counting starts afresh at each prompt
            tiny.model.generate(
                **tiny.inputs([each]), max_new_tokens=4, min_new_tokens=4, do_sample=False
            )

    assert record.calls_by_layer == {0: 2, 1: 2}


def test_first_decoding_step_patch_keeps_the_first_token_and_changes_the_next(tiny, prompt):
    inputs = tiny.inputs([prompt])
    settings = {"max_new_tokens": 2, "min_new_tokens": 2, "do_sample": False}
    settings |= {"output_logits": True, "return_dict_in_generate": True}
    clean = tiny.model.generate(**inputs, **settings)
    values = torch.full((2, 16), 30.0)

    with patch_first_decoding_step(tiny.model, tiny.adapter, TWO_HEADS, values):
        patched = tiny.model.generate(**inputs, **settings)

    assert torch.equal(patched.logits[0], clean.logits[0])
    assert (patched.logits[1] - clean.logits[1]).abs().max() > 1e-3


def test_first_generated_token_is_the_patched_forward_argmax(tiny, prompt):
    inputs = tiny.inputs([prompt])
    values = torch.full((2, 16), 3.0)
    policy = PatchPolicy.PROMPT_LAST_TOKEN

    with patch_heads(tiny.model, tiny.adapter, TWO_HEADS, values, policy=policy):
        expected = tiny.logits(inputs)[0, -1].argmax()
        generated = tiny.model.generate(**inputs, max_new_tokens=1, do_sample=False)

    assert generated[0, -1] == expected


def test_batched_left_padded_capture_equals_one_by_one(tiny, prompt, query):
    prompts = [prompt, Prompt((), query), Prompt(prompt.demonstrations[:1], query)]

    with torch.no_grad(), capture_last_token_heads(tiny.model, tiny.adapter) as capture:
        tiny.model(**tiny.inputs(prompts))
        for single in prompts:
            tiny.model(**tiny.inputs([single]))
    activations = capture.activations()

    # Padding changes the summation order inside attention, not the result beyond rounding.
    torch.testing.assert_close(activations[:3], activations[3:], rtol=0, atol=1e-5)


def test_hooks_are_removed_after_the_block_and_after_an_error(tiny, prompt):
    values = torch.zeros(2, 16)
    with patch_heads(tiny.model, tiny.adapter, TWO_HEADS, values, policy=PatchPolicy.EVERY_CALL):
        assert hook_count(tiny) == 2
    assert hook_count(tiny) == 0

    inside = []

    def fail_while_capturing():
        with capture_last_token_heads(tiny.model, tiny.adapter):
            inside.append(hook_count(tiny))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_while_capturing()
    assert inside == [2]
    assert hook_count(tiny) == 0


def test_registration_failure_removes_the_hooks_already_registered(tiny):
    projections = tiny.adapter.output_projections(tiny.model)

    def pairs():
        yield projections[0], lambda module, args: None
        raise RuntimeError("registration failed")

    with pytest.raises(RuntimeError, match="registration failed"), registered_pre_hooks(pairs()):
        pass

    assert hook_count(tiny) == 0


def test_capture_without_a_forward_pass_raises(tiny):
    with capture_last_token_heads(tiny.model, tiny.adapter) as capture:
        pass

    with pytest.raises(ModelError, match="at least one forward pass"):
        capture.activations()


@pytest.mark.parametrize(
    ("heads", "values", "message"),
    [
        (HeadSet.of([(2, 0)]), np.zeros((1, 16)), r"heads must lie within 2 layers x 4 heads"),
        (HeadSet.of([(0, 4)]), np.zeros((1, 16)), r"got \(0, 4\)"),
        (TWO_HEADS, np.zeros((2, 15)), r"values must have shape .* \(2, 16\), got \(2, 15\)"),
        (TWO_HEADS, np.zeros((3, 16)), r"got \(3, 16\)"),
        (TWO_HEADS, np.full((2, 16), np.nan), "values must be finite"),
        (HeadSet(()), np.zeros((0, 16)), "heads must hold at least one head"),
    ],
)
def test_patch_heads_validates_heads_and_values(tiny, heads, values, message):
    with (
        pytest.raises(ConfigError, match=message),
        patch_heads(tiny.model, tiny.adapter, heads, values, policy=PatchPolicy.EVERY_CALL),
    ):
        pass
    assert hook_count(tiny) == 0


def test_policy_accepts_its_wire_names():
    assert PatchPolicy("prompt-last-token") is PatchPolicy.PROMPT_LAST_TOKEN
    assert PatchPolicy("every-call") is PatchPolicy.EVERY_CALL


def test_patch_refuses_a_prompt_beyond_the_context_before_the_forward(tiny, prompt, monkeypatch):
    # Arrange: pretend the context is 8 tokens
    monkeypatch.setattr(tiny.model.config.get_text_config(), "max_position_embeddings", 8)
    inputs = tiny.inputs([prompt])
    values = torch.zeros(len(TWO_HEADS), 16)

    # Act / Assert
    with (
        pytest.raises(PromptTooLongError, match="context of 8 tokens"),
        patch_heads(
            tiny.model, tiny.adapter, TWO_HEADS, values, policy=PatchPolicy.EVERY_CALL
        ) as record,
    ):
        tiny.model(**inputs)
    assert record.total_calls == 0
    assert hook_count(tiny) == 0
    assert len(tiny.model._forward_pre_hooks) == 0


def test_the_length_guard_leaves_no_hook_behind(tiny, prompt):
    inputs = tiny.inputs([prompt])

    with torch.no_grad(), prompt_length_guard(tiny.model):
        tiny.model(**inputs)

    assert len(tiny.model._forward_pre_hooks) == 0

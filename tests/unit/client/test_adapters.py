from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from client.models import (
    TINY_ARCHITECTURES,
    Example,
    Prompt,
    adapter_for,
    build_tiny_model,
    get_adapter,
    prompt_to_messages,
    register_adapter,
    supported_model_types,
)
from dpmtv_common.errors import ConfigError, ModelError, UnsupportedArchitectureError

# Image placeholder tokens a 56-72 px image expands to in each tiny processor.
TOKENS_PER_IMAGE = {"idefics3": 4, "llava": 16, "qwen2_5_vl": 4, "qwen2_vl": 4, "smolvlm": 4}


def test_registry_serves_every_required_architecture():
    assert set(supported_model_types()) == set(TINY_ARCHITECTURES)
    assert supported_model_types() == tuple(sorted(supported_model_types()))


def test_unknown_architecture_raises_and_lists_supported_types():
    # Arrange
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    text_only = LlamaForCausalLM(config)

    # Act / Assert
    with pytest.raises(UnsupportedArchitectureError, match=r"got 'llama'") as info:
        adapter_for(text_only)
    assert all(model_type in str(info.value) for model_type in TINY_ARCHITECTURES)


def test_register_adapter_rejects_a_taken_model_type():
    adapter = dataclasses.replace(get_adapter("llava"), model_types=("brand_new", "llava"))

    with pytest.raises(ConfigError, match="taken"):
        register_adapter(adapter)

    assert "brand_new" not in supported_model_types()


def test_head_shape_reads_heads_and_head_dim_from_the_text_config(tiny):
    shape = tiny.adapter.head_shape(tiny.model)

    assert (shape.num_layers, shape.num_heads, shape.head_dim) == (2, 4, 16)
    assert len(tiny.adapter.output_projections(tiny.model)) == 2


def test_head_shape_rejects_an_o_proj_that_is_not_heads_times_head_dim():
    # Arrange: a private build, since the projection is replaced
    model, _ = build_tiny_model("llava", seed=0)
    adapter = adapter_for(model)
    attention = model.get_submodule(f"{adapter.layers_path}.1.self_attn")
    attention.o_proj = nn.Linear(48, 64, bias=False)

    # Act / Assert
    with pytest.raises(ModelError, match=r"layer 1 o_proj.in_features must equal .* got 48"):
        adapter.head_shape(model)


def test_wrong_layers_path_raises_model_error(tiny):
    adapter = dataclasses.replace(tiny.adapter, layers_path="model.no_such_layers")

    with pytest.raises(ModelError, match=r"model\.no_such_layers"):
        adapter.head_shape(tiny.model)


def test_prompt_rejects_a_demonstration_without_answer(query):
    with pytest.raises(ConfigError, match=r"demonstrations\[0\].answer must be a string"):
        Prompt((Example(query.image, "Q?"),), query)


def test_messages_interleave_user_and_assistant_turns_and_end_on_the_query(prompt):
    messages = prompt_to_messages(prompt, instruction="Be brief.")

    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"][0] == {"type": "text", "text": "Be brief."}
    assert messages[1]["content"] == [{"type": "text", "text": "zebra red"}]
    assert messages[-1]["content"][0]["image"] is prompt.query.image
    assert all("giraffe" not in str(m["content"]) for m in messages)


def test_build_inputs_interleaves_shots_and_withholds_the_query_answer(tiny, prompt):
    # Act
    inputs = tiny.adapter.build_inputs(
        tiny.processor, prompt.demonstrations, prompt.query, instruction="Be brief."
    )

    # Assert
    ids = inputs["input_ids"]
    text = tiny.processor.tokenizer.decode(ids[0])
    assert ids.shape[0] == 1
    assert text.index("zebra red") < text.index("zebra blue")
    assert "giraffe" not in text
    assert text.startswith(("Be brief.", "<s>", "USER: Be brief.", "<|im_start|>"))
    image_token = tiny.processor.tokenizer.image_token_id
    assert int((ids == image_token).sum()) == 3 * TOKENS_PER_IMAGE[tiny.arch]


def test_build_inputs_ends_with_the_generation_prompt(tiny, prompt):
    inputs = tiny.inputs([prompt])

    tail = tiny.processor.tokenizer.decode(inputs["input_ids"][0, -10:])
    expected = {
        "idefics3": "Assistant:",
        "llava": "ASSISTANT:",
        "qwen2_5_vl": "<|im_start|>assistant\n",
        "qwen2_vl": "<|im_start|>assistant\n",
        "smolvlm": "Assistant:",
    }
    assert tail.endswith(expected[tiny.arch])


def test_batch_inputs_are_left_padded(tiny, prompt, query):
    inputs = tiny.inputs([prompt, Prompt((), query)])

    mask = inputs["attention_mask"]
    assert torch.equal(mask[:, -1], torch.ones(2, dtype=mask.dtype))
    assert mask[1, 0] == 0
    assert int(mask[0].sum()) == mask.shape[1]


def test_processor_without_chat_template_falls_back_to_the_documented_format(tiny, prompt):
    # Arrange: the tiny processors carry the adapter's template, so removing it must not matter
    bare = copy.copy(tiny.processor)
    bare.chat_template = None

    # Act
    fallback = tiny.adapter.build_batch_inputs(bare, [prompt])
    own = tiny.adapter.build_batch_inputs(tiny.processor, [prompt])

    # Assert
    assert torch.equal(fallback["input_ids"], own["input_ids"])


def test_a_processor_template_wins_over_the_adapter_default(prompt):
    # Arrange
    _, processor = build_tiny_model("llava", seed=0)
    processor.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endfor %}"
    )

    # Act
    inputs = get_adapter("llava").build_batch_inputs(processor, [prompt])

    # Assert
    assert processor.tokenizer.decode(inputs["input_ids"][0]).startswith("[user]<image>")


def test_empty_batch_is_rejected(tiny):
    with pytest.raises(ConfigError, match="prompts must hold at least one prompt"):
        tiny.adapter.build_batch_inputs(tiny.processor, [])

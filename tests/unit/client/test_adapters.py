from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from client.activations.hooks import PatchPolicy, capture_last_token_heads, patch_heads
from client.models import (
    ADAPTER_ENTRY_POINT_GROUP,
    ALL_TINY_ARCHITECTURES,
    TINY_ARCHITECTURES,
    AdapterPluginError,
    Example,
    Prompt,
    PromptTooLongError,
    adapter_for,
    build_tiny_model,
    check_prompt_length,
    context_length,
    ensure_pad_token,
    get_adapter,
    prompt_to_messages,
    register_adapter,
    supported_model_types,
)
from dpmtv_common.errors import ConfigError, ModelError, UnsupportedArchitectureError
from dpmtv_common.heads import HeadSet

# Image placeholder tokens a 56-72 px image expands to in each tiny processor.
TOKENS_PER_IMAGE = {"idefics3": 4, "llava": 16, "qwen2_5_vl": 4, "qwen2_vl": 4, "smolvlm": 4}


# Registered, but built here without a processor: their image processors need torchvision.
MODEL_ONLY = {"lfm2_vl", "mistral3"}
MODEL_ONLY_IDS = ["mistral3", "lfm2_vl"]


def test_registry_serves_every_required_architecture():
    assert set(supported_model_types()) == set(ALL_TINY_ARCHITECTURES) | MODEL_ONLY
    assert set(TINY_ARCHITECTURES) <= set(ALL_TINY_ARCHITECTURES)
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


# --- Registry coverage: every family, one tiny build each for this module -------------------


@dataclasses.dataclass(frozen=True)
class Family:
    arch: str
    model: Any
    processor: Any
    adapter: Any

    def inputs(self, prompts):
        return self.adapter.build_batch_inputs(self.processor, prompts, instruction="Be brief.")

    def logits(self, inputs):
        with torch.no_grad():
            return self.model(**inputs).logits


@pytest.fixture(scope="module", params=ALL_TINY_ARCHITECTURES)
def family(request):
    model, processor = build_tiny_model(request.param, seed=5)
    return Family(request.param, model, processor, adapter_for(model))


@pytest.fixture(scope="module")
def shared_build():
    """``shared_build(arch)``: one tiny build per architecture for this module (read-only)."""
    builds = {}

    def build(arch):
        if arch not in builds:
            builds[arch] = build_tiny_model(arch, seed=5)
        return builds[arch]

    return build


def own_head_values(family, inputs, heads):
    with torch.no_grad(), capture_last_token_heads(family.model, family.adapter) as capture:
        family.model(**inputs)
    rows = heads.to_array()
    return capture.activations()[0, rows[:, 0], rows[:, 1]]


def test_registry_covers_at_least_twelve_families_with_cross_attention_and_hybrid():
    assert len(ALL_TINY_ARCHITECTURES) >= 12
    assert get_adapter("mllama").projection_paths[-1] == "cross_attn.o_proj"
    assert get_adapter("qwen3_5").headless_layers


@pytest.mark.parametrize("policy", list(PatchPolicy))
def test_every_family_reproduces_its_logits_when_patched_with_its_own_activations(
    family, prompt, policy
):
    # Arrange
    inputs = family.inputs([prompt])
    clean = family.logits(inputs)
    heads = family.adapter.head_shape(family.model).all_heads()
    values = own_head_values(family, inputs, heads)

    # Act
    with patch_heads(family.model, family.adapter, heads, values, policy=policy) as record:
        patched = family.logits(inputs)

    # Assert
    assert torch.equal(patched, clean)
    assert record.total_calls == len(heads.layers)


def test_every_family_patch_moves_only_the_last_position(family, prompt):
    # Arrange
    inputs = family.inputs([prompt])
    clean = family.logits(inputs)
    heads = family.adapter.head_shape(family.model).all_heads()
    values = torch.full((len(heads), 16), 3.0)

    # Act
    policy = PatchPolicy.PROMPT_LAST_TOKEN
    with patch_heads(family.model, family.adapter, heads, values, policy=policy):
        patched = family.logits(inputs)

    # Assert: PaliGemma is a prefix LM, so its earlier prompt positions see the last one
    assert not torch.equal(patched[:, -1], clean[:, -1])
    if family.arch != "paligemma":
        assert torch.equal(patched[:, :-1], clean[:, :-1])


def test_every_family_takes_a_two_prompt_batch(family, prompt, query):
    inputs = family.inputs([prompt, Prompt((), query)])

    logits = family.logits(inputs)

    assert logits.shape[0] == 2
    assert torch.isfinite(logits).all()


def test_cross_attention_layers_carry_heads_at_their_own_o_proj(shared_build):
    # Arrange
    model, _ = shared_build("mllama")
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)

    # Act
    projections = adapter.projections_by_layer(model)
    shape = adapter.head_shape(model)

    # Assert: decoder layer 1 is the cross-attention layer; indices stay decoder indices
    assert projections[1] is layers[1].get_submodule("cross_attn.o_proj")
    assert projections[0] is layers[0].get_submodule("self_attn.o_proj")
    assert shape.head_layers == (0, 1, 2)


def test_cross_attention_heads_change_the_answer_when_patched(shared_build, prompt):
    # Arrange
    model, processor = shared_build("mllama")
    adapter = adapter_for(model)
    inputs = adapter.build_batch_inputs(processor, [prompt])
    with torch.no_grad():
        clean = model(**inputs).logits
    heads = HeadSet.of([(1, 0), (1, 3)])

    # Act
    with (
        torch.no_grad(),
        patch_heads(model, adapter, heads, torch.full((2, 16), 4.0), policy=PatchPolicy.EVERY_CALL),
    ):
        patched = model(**inputs).logits

    # Assert
    assert not torch.equal(patched[:, -1], clean[:, -1])


def test_hybrid_model_keeps_decoder_layer_indices_and_zero_rows_for_headless_layers(
    shared_build, prompt
):
    # Arrange: qwen3_5's layer 0 is linear attention, layer 1 softmax attention
    model, processor = shared_build("qwen3_5")
    adapter = adapter_for(model)
    inputs = adapter.build_batch_inputs(processor, [prompt])

    # Act
    shape = adapter.head_shape(model)
    with torch.no_grad(), capture_last_token_heads(model, adapter) as capture:
        model(**inputs)
    activations = capture.activations()

    # Assert
    assert (shape.num_layers, shape.head_layers) == (2, (1,))
    assert shape.all_heads() == HeadSet.of((1, h) for h in range(4))
    assert activations.shape == (1, 2, 4, 16)
    assert torch.count_nonzero(activations[:, 0]) == 0
    assert torch.count_nonzero(activations[:, 1]) > 0


def test_patching_a_headless_layer_is_refused(shared_build):
    model, _ = shared_build("qwen3_5")

    with (
        pytest.raises(ConfigError, match="decoder layer 0 has no attention heads"),
        patch_heads(
            model,
            adapter_for(model),
            HeadSet.of([(0, 1)]),
            torch.zeros(1, 16),
            policy=PatchPolicy.EVERY_CALL,
        ),
    ):
        pass


def test_a_layer_without_projection_is_an_error_unless_the_adapter_allows_it(shared_build):
    model, _ = shared_build("qwen3_5")
    strict = dataclasses.replace(adapter_for(model), headless_layers=False)

    with pytest.raises(ModelError, match=r"layer 0 must have one of \['self_attn.o_proj'\]"):
        strict.head_shape(model)


def tiny_lfm2_vl():
    """A tiny LFM2-VL: layers 0 and 2 short convolutions, layer 1 attention (``out_proj``)."""
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    text = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "layer_types": ["conv", "full_attention", "conv"],
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": 16,
        "num_patches": 16,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = Lfm2VlConfig(text_config=text, vision_config=vision, image_token_id=5)
        model = Lfm2VlForConditionalGeneration(config)
    model.train(False)
    return model


def tiny_mistral3():
    """A tiny Mistral 3 (Pixtral vision, Mistral text): every layer has self_attn.o_proj."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {
        "model_type": "mistral",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 56,
        "patch_size": 14,
        "head_dim": 8,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=5)
        model = Mistral3ForConditionalGeneration(config)
    model.train(False)
    return model


@pytest.mark.parametrize(
    ("build", "head_layers"), [(tiny_mistral3, (0, 1)), (tiny_lfm2_vl, (1,))], ids=MODEL_ONLY_IDS
)
def test_model_only_families_patch_exactly_on_text(build, head_layers):
    # Arrange: text-only input (their processors need torchvision), a fixed token sequence
    model = build()
    adapter = adapter_for(model)
    ids = torch.arange(10, 40).reshape(1, 30)
    shape = adapter.head_shape(model)
    heads = shape.all_heads()
    with torch.no_grad(), capture_last_token_heads(model, adapter) as capture:
        clean = model(input_ids=ids).logits
    rows = heads.to_array()
    values = capture.activations()[0, rows[:, 0], rows[:, 1]]

    # Act
    with torch.no_grad():
        policy = PatchPolicy.EVERY_CALL
        with patch_heads(model, adapter, heads, values, policy=policy):
            same = model(input_ids=ids).logits
        with patch_heads(model, adapter, heads, values + 3.0, policy=policy):
            moved = model(input_ids=ids).logits

    # Assert
    assert shape.head_layers == head_layers
    assert torch.equal(same, clean)
    assert not torch.equal(moved[:, -1], clean[:, -1])
    assert torch.equal(moved[:, :-1], clean[:, :-1])


def test_a_convolution_hybrid_hooks_its_attention_out_proj_only():
    # Arrange
    model = tiny_lfm2_vl()
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)

    # Act
    with torch.no_grad(), capture_last_token_heads(model, adapter) as capture:
        model(input_ids=torch.arange(10, 40).reshape(1, 30))

    # Assert: layers 0 and 2 are convolutions, whose own out_proj is not a head projection
    assert adapter.projections_by_layer(model) == {1: layers[1].get_submodule("self_attn.out_proj")}
    assert adapter.head_shape(model).num_layers == 3
    activations = capture.activations()
    assert torch.count_nonzero(activations[:, [0, 2]]) == 0
    assert torch.count_nonzero(activations[:, 1]) > 0


# --- Third-party adapters through the entry point group --------------------------------------


@pytest.fixture
def isolated_registry(monkeypatch):
    """The registry and the plugin bookkeeping, restored after the test."""
    from client.models import _plugins, adapters

    monkeypatch.setattr(adapters, "_REGISTRY", dict(adapters._REGISTRY))
    monkeypatch.setattr(_plugins, "_loaded", set())


def install_fake_distribution(root, monkeypatch, *, target: str, body: str) -> None:
    """A distribution on sys.path, as `pip install` leaves it: a module and its dist-info."""
    (root / "fake_vlm_plugin.py").write_text(body)
    info = root / "fake_vlm_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-vlm-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ADAPTER_ENTRY_POINT_GROUP}]\nfake_vlm = {target}\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "fake_vlm_plugin", raising=False)


PLUGIN_BODY = """
from client.models import ModelAdapter
ADAPTER = ModelAdapter(("fake_vlm",), "model.layers", "{{ messages }}")
def make_adapter():
    return ModelAdapter(("fake_vlm",), "model.layers", "{{ messages }}")
"""


@pytest.mark.parametrize("target", ["fake_vlm_plugin:ADAPTER", "fake_vlm_plugin:make_adapter"])
@pytest.mark.usefixtures("isolated_registry")
def test_an_installed_plugin_adapter_is_found_by_the_lookup(tmp_path, monkeypatch, target):
    # Arrange
    install_fake_distribution(tmp_path, monkeypatch, target=target, body=PLUGIN_BODY)

    # Act
    adapter = get_adapter("fake_vlm")

    # Assert
    assert adapter.layers_path == "model.layers"
    assert "fake_vlm" in supported_model_types()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("raise RuntimeError('no GPU here')", r"must load, got RuntimeError: no GPU here"),
        ("ADAPTER = 42", "must give a ModelAdapter, got int"),
        (
            "from client.models import get_adapter\nADAPTER = get_adapter('llava')",
            "model_types must be new to the registry",
        ),
    ],
    ids=["import-fails", "not-an-adapter", "taken-model-type"],
)
@pytest.mark.usefixtures("isolated_registry")
def test_a_broken_plugin_is_a_typed_error_naming_its_distribution(
    tmp_path, monkeypatch, body, message
):
    install_fake_distribution(tmp_path, monkeypatch, target="fake_vlm_plugin:ADAPTER", body=body)

    with pytest.raises(AdapterPluginError, match=message) as info:
        get_adapter("fake_vlm")

    assert "fake-vlm-plugin" in str(info.value)


def test_a_registered_model_type_never_loads_plugins(monkeypatch):
    def fail(**_):
        raise AssertionError("entry points must not be read for a built-in type")

    monkeypatch.setattr("client.models._plugins.metadata.entry_points", fail)

    assert get_adapter("llava_next").model_types == ("llava_next",)


# --- Pad token and prompt length --------------------------------------------------------------


def test_a_tokenizer_without_pad_token_still_pads_a_batch_of_two(prompt, query):
    # Arrange: a private build whose tokenizer lost its pad token
    model, processor = build_tiny_model("llava", seed=0)
    processor.tokenizer.pad_token = None
    adapter = adapter_for(model)

    # Act
    inputs = adapter.build_batch_inputs(processor, [prompt, Prompt((), query)])

    # Assert
    assert processor.tokenizer.pad_token == processor.tokenizer.eos_token
    assert inputs["input_ids"][1, 0] == processor.tokenizer.eos_token_id
    assert inputs["attention_mask"][1, 0] == 0


def test_ensure_pad_token_keeps_an_existing_pad_token():
    _, processor = build_tiny_model("llava", seed=0)
    pad = processor.tokenizer.pad_token

    ensure_pad_token(processor)

    assert processor.tokenizer.pad_token == pad != processor.tokenizer.eos_token


def test_prompt_lengths_count_every_token_including_images(tiny, prompt, query):
    lengths = tiny.adapter.prompt_lengths(tiny.processor, [prompt, Prompt((), query)])

    single = tiny.adapter.build_batch_inputs(tiny.processor, [Prompt((), query)])
    assert lengths[1] == single["input_ids"].shape[1]
    assert lengths[0] > lengths[1] + 2 * TOKENS_PER_IMAGE[tiny.arch]


def test_context_length_is_read_from_the_text_config(tiny):
    assert context_length(tiny.model) == 2048


def test_a_prompt_beyond_the_context_is_refused_before_any_layer_runs(tiny, prompt, monkeypatch):
    # Arrange: pretend the model's context is 8 tokens
    monkeypatch.setattr(tiny.model.config.get_text_config(), "max_position_embeddings", 8)
    inputs = tiny.inputs([prompt])

    # Act / Assert
    with (
        pytest.raises(PromptTooLongError, match=r"at most the model's context of 8 tokens, got"),
        torch.no_grad(),
        capture_last_token_heads(tiny.model, tiny.adapter) as capture,
    ):
        tiny.model(**inputs)
    assert all(calls == [] for calls in capture.calls)


def test_check_prompt_length_accepts_a_prompt_that_fits(tiny):
    check_prompt_length(tiny.model, 2048)

    with pytest.raises(PromptTooLongError, match="got 2049"):
        check_prompt_length(tiny.model, 2049)

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, ProcessorMixin

from client.activations.hooks import PatchPolicy, capture_last_token_heads, patch_heads
from client.inference.answers import generate_answers
from client.models import (
    Prompt,
    build_tiny_model,
    default_fingerprint_cache_dir,
    ensure_processor_shim,
    load_model,
    resolve_device,
    resolve_dtype,
    save_tiny_model,
)
from dpmtv_common.errors import ConfigError, ModelError, UnsupportedArchitectureError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadSet


@pytest.fixture
def no_network(monkeypatch):
    """Fail any attempt to open a connection (loading must be local only)."""

    def refuse(*args, **kwargs):
        raise AssertionError("load_model tried to reach the network")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_save_then_load_gives_identical_logits(tiny, saved_tiny, prompt, no_network):
    # Act
    loaded = load_model(saved_tiny, device="cpu")

    # Assert
    inputs = loaded.adapter.build_batch_inputs(loaded.processor, [prompt], instruction="Be brief.")
    assert torch.equal(inputs["input_ids"], tiny.inputs([prompt])["input_ids"])
    with torch.no_grad():
        logits = loaded.model(**inputs).logits
    assert torch.equal(logits, tiny.logits(tiny.inputs([prompt])))
    assert type(loaded.processor) is type(tiny.processor)
    assert loaded.adapter is tiny.adapter
    assert loaded.fingerprint == fingerprint_model_dir(saved_tiny)
    assert not loaded.model.training


def test_loaded_processor_keeps_the_chat_template(tiny, saved_tiny):
    loaded = load_model(saved_tiny, device="cpu")

    assert loaded.processor.chat_template == tiny.adapter.chat_template


def test_saving_twice_with_one_seed_gives_one_fingerprint(tiny, saved_tiny, tmp_path):
    save_tiny_model(tiny.arch, tmp_path, seed=tiny.seed)

    assert fingerprint_model_dir(tmp_path) == fingerprint_model_dir(saved_tiny)


def test_bfloat16_load_keeps_the_no_op_patch_exact(saved_tiny, prompt):
    # Arrange
    loaded = load_model(saved_tiny, device="cpu", dtype="bfloat16")
    model, adapter = loaded.model, loaded.adapter
    inputs = adapter.build_batch_inputs(loaded.processor, [prompt])
    with torch.no_grad(), capture_last_token_heads(model, adapter) as capture:
        clean = model(**inputs).logits
    values = capture.activations()[0].reshape(-1, 16)
    heads = HeadSet.all_heads(num_layers=2, num_heads=4)

    # Act
    policy = PatchPolicy.EVERY_CALL
    with torch.no_grad(), patch_heads(model, adapter, heads, values, policy=policy):
        patched = model(**inputs).logits

    # Assert
    assert model.dtype == torch.bfloat16
    assert values.dtype == torch.float32
    assert torch.equal(patched, clean)


def test_missing_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="path must be an existing model directory"):
        load_model(tmp_path / "absent")


def test_empty_directory_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="path must hold a saved model"):
        load_model(tmp_path)


def test_unsupported_architecture_fails_before_reading_weights(tmp_path):
    LlamaConfig(hidden_size=16, num_attention_heads=2).save_pretrained(tmp_path)  # no weights

    with pytest.raises(UnsupportedArchitectureError, match="got 'llama'"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("device", "dtype", "message"),
    [
        ("toaster", None, "device must be a torch device"),
        ("cpu", "float8", r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"),
    ],
)
def test_bad_device_or_dtype_is_a_config_error(saved_tiny, device, dtype, message):
    with pytest.raises(ConfigError, match=message):
        load_model(saved_tiny, device=device, dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cpu_machine_defaults_to_cpu_float32_and_refuses_cuda():
    device = resolve_device(None)

    assert device == torch.device("cpu")
    assert resolve_dtype(None, device) == torch.float32
    with pytest.raises(ConfigError, match="device must be available"):
        resolve_device("cuda")


def test_gpu_default_dtype_is_bfloat16():
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16


def test_processor_shim_is_idempotent():
    ensure_processor_shim()
    patched = ProcessorMixin.check_argument_for_proper_class

    ensure_processor_shim()

    assert ProcessorMixin.check_argument_for_proper_class is patched


def test_tiny_build_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()

    first, _ = build_tiny_model("qwen2_vl", seed=7)
    second, _ = build_tiny_model("qwen2_vl", seed=7)

    assert torch.equal(torch.random.get_rng_state(), state)
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_unknown_tiny_architecture_is_a_config_error():
    with pytest.raises(ConfigError, match="arch must be one of"):
        build_tiny_model("mistral3", seed=0)


# --- Issue 11: GPU-ready options, torchvision, pad token -------------------------------------

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)


@ONE_ARCH
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_implementation_is_applied_and_keeps_the_no_op_patch_exact(
    saved_tiny, prompt, attention
):
    # Arrange
    loaded = load_model(saved_tiny, device="cpu", attn_implementation=attention)
    model, adapter = loaded.model, loaded.adapter
    inputs = adapter.build_batch_inputs(loaded.processor, [prompt])
    with torch.no_grad(), capture_last_token_heads(model, adapter) as capture:
        clean = model(**inputs).logits
    values = capture.activations()[0].reshape(-1, 16)

    # Act
    heads = HeadSet.all_heads(num_layers=2, num_heads=4)
    with torch.no_grad(), patch_heads(model, adapter, heads, values, policy=PatchPolicy.EVERY_CALL):
        patched = model(**inputs).logits

    # Assert
    assert model.config._attn_implementation == attention
    assert torch.equal(patched, clean)


@ONE_ARCH
def test_unknown_attention_implementation_is_a_config_error(saved_tiny):
    with pytest.raises(ConfigError, match=r"attn_implementation must be one of \['eager'"):
        load_model(saved_tiny, attn_implementation="fast")


@ONE_ARCH
@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is not None, reason="checks the refusal without it"
)
def test_device_map_without_accelerate_names_the_fix(saved_tiny):
    with pytest.raises(ConfigError, match=r"device_map needs the accelerate package.*pip install"):
        load_model(saved_tiny, device="cpu", device_map="auto")


@ONE_ARCH
def test_loaded_model_reports_its_dtype_by_name(saved_tiny):
    assert load_model(saved_tiny, device="cpu", dtype="bfloat16").dtype_name == "bfloat16"
    assert load_model(saved_tiny, device="cpu").dtype_name == "float32"


@ONE_ARCH
def test_a_processor_that_needs_torchvision_is_a_model_error_naming_the_fix(saved_tiny, tmp_path):
    # Arrange: a copy whose processor class is Pixtral's (Mistral3), which needs torchvision
    copy = tmp_path / "pixtral"
    shutil.copytree(saved_tiny, copy)
    config = json.loads((copy / "processor_config.json").read_text())
    (copy / "processor_config.json").write_text(
        json.dumps({**config, "processor_class": "PixtralProcessor"})
    )
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed; the processor would load")

    # Act / Assert
    with pytest.raises(
        ModelError,
        match=r"PixtralProcessor requires the Torchvision.*Install the torchvision build",
    ) as info:
        load_model(copy, device="cpu")
    assert isinstance(info.value.__cause__, ImportError)


@ONE_ARCH
def test_a_saved_tokenizer_without_pad_token_pads_in_memory_and_keeps_the_fingerprint(
    saved_tiny, tmp_path, prompt, query
):
    # Arrange: the site's files have no pad token; nothing may write to them
    copy = tmp_path / "no-pad"
    shutil.copytree(saved_tiny, copy)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("pad_token", None)
    config_path.write_text(json.dumps(config))
    before = fingerprint_model_dir(copy)

    # Act
    loaded = load_model(copy, device="cpu")
    answers = generate_answers(loaded, [prompt, Prompt((), query)], batch_size=2, max_new_tokens=2)

    # Assert
    assert loaded.processor.tokenizer.pad_token == loaded.processor.tokenizer.eos_token
    assert len(answers) == 2
    assert fingerprint_model_dir(copy) == before == loaded.fingerprint
    assert "pad_token" not in json.loads(config_path.read_text())


def test_default_fingerprint_cache_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(Path, "home", staticmethod(lambda: tmp_path))

    assert default_fingerprint_cache_dir() == tmp_path / ".cache" / "dpmtv" / "fingerprints"


@ONE_ARCH
def test_load_with_a_fingerprint_cache_gives_the_plain_fingerprint(saved_tiny, tmp_path):
    cache = tmp_path / "cache"

    first = load_model(saved_tiny, device="cpu", fingerprint_cache=cache)
    second = load_model(saved_tiny, device="cpu", fingerprint_cache=cache)

    assert first.fingerprint == second.fingerprint == fingerprint_model_dir(saved_tiny)
    assert any(cache.iterdir())

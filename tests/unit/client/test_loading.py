from __future__ import annotations

import socket

import pytest
import torch
from transformers import LlamaConfig, ProcessorMixin

from client.hooks import PatchPolicy, capture_last_token_heads, patch_heads
from client.models import (
    build_tiny_model,
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

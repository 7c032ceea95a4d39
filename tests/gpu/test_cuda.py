"""The model side on a CUDA device: loading, hooks and generation (marked ``gpu``).

CPU CI deselects these with ``-m "not gpu"``; on a machine without CUDA they skip. Run them
with ``pytest tests/gpu -m gpu`` on a GPU machine (docs/gpu.md); ``scripts/gpu_check.py`` runs
the whole site path there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from PIL import Image

from client.activations.hooks import PatchPolicy, capture_last_token_heads, patch_heads
from client.inference.answers import TaskVectorPatch, generate_answers
from client.models import (
    ALL_TINY_ARCHITECTURES,
    Example,
    Prompt,
    adapter_for,
    build_tiny_model,
    load_model,
    save_tiny_model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = Prompt(
    (Example(Image.new("RGB", (56, 56), "red"), "What colour?", "red"),),
    Example(Image.new("RGB", (60, 52), "blue"), "What colour?"),
)


@pytest.fixture(scope="module")
def saved_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gpu-llava")
    save_tiny_model("llava", directory, seed=0)
    return directory


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_load_model_puts_every_weight_on_the_gpu_in_the_dtype(saved_llava, dtype):
    loaded = load_model(saved_llava, device="cuda", dtype=dtype)

    assert {p.device.type for p in loaded.model.parameters()} == {"cuda"}
    assert loaded.dtype_name == dtype


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_with_accelerate_the_weights_load_straight_to_the_device(saved_llava):
    loaded = load_model(saved_llava, device="cuda")

    assert getattr(loaded.model, "hf_device_map", None) is not None
    assert loaded.model.device.type == "cuda"


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_capture_is_float32_on_the_host_whatever_the_attention(saved_llava, attention):
    loaded = load_model(saved_llava, device="cuda", attn_implementation=attention)
    inputs = loaded.adapter.build_batch_inputs(loaded.processor, [PROMPT]).to("cuda")

    with torch.no_grad(), capture_last_token_heads(loaded.model, loaded.adapter) as capture:
        loaded.model(**inputs)

    activations = capture.activations()
    assert (activations.device.type, activations.dtype) == ("cpu", torch.float32)


@pytest.mark.parametrize("arch", ALL_TINY_ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_op_patch_is_exact_on_the_gpu(arch, dtype):
    # Arrange
    model, processor = build_tiny_model(arch, seed=0)
    torch.nn.Module.to(model, device="cuda", dtype=dtype)
    adapter = adapter_for(model)
    inputs = adapter.build_batch_inputs(processor, [PROMPT]).to("cuda")
    heads = adapter.head_shape(model).all_heads()
    with torch.no_grad(), capture_last_token_heads(model, adapter) as capture:
        clean = model(**inputs).logits
    rows = heads.to_array()
    values = capture.activations()[0, rows[:, 0], rows[:, 1]]

    # Act
    with torch.no_grad(), patch_heads(model, adapter, heads, values, policy=PatchPolicy.EVERY_CALL):
        patched = model(**inputs).logits

    # Assert
    assert torch.equal(patched, clean)


def test_patched_batch_on_the_gpu_matches_one_by_one_within_float_tolerance(saved_llava):
    # Arrange: kernels may differ with the batch shape, so allow float32 rounding only
    loaded = load_model(saved_llava, device="cuda", dtype="float32")
    model, adapter = loaded.model, loaded.adapter
    shape = adapter.head_shape(model)
    heads = shape.all_heads()
    values = torch.randn(len(heads), shape.head_dim, generator=torch.Generator().manual_seed(0))
    prompts = [PROMPT, Prompt((), PROMPT.query)]
    policy = PatchPolicy.PROMPT_LAST_TOKEN

    # Act
    with torch.no_grad(), patch_heads(model, adapter, heads, values, policy=policy):
        batch = adapter.build_batch_inputs(loaded.processor, prompts).to("cuda")
        together = model(**batch).logits[:, -1]
        alone = [
            model(**adapter.build_batch_inputs(loaded.processor, [p]).to("cuda")).logits[0, -1]
            for p in prompts
        ]
    answers = generate_answers(
        loaded, prompts, patch=TaskVectorPatch(heads, values), batch_size=2, max_new_tokens=3
    )

    # Assert
    torch.testing.assert_close(together, torch.stack(alone), atol=1e-4, rtol=1e-4)
    assert len(answers) == 2

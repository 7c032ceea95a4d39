"""Memory figures from a config alone agree with the model they describe."""

from __future__ import annotations

import pytest
from transformers import BertConfig, LlavaConfig

from client.models import save_tiny_model
from client.models.memory import GIB, estimate_memory, memory_of_folder
from dpmtv_common.errors import ModelError


def test_the_parameter_count_and_shape_match_the_saved_model(tmp_path):
    # Arrange: a real (tiny) checkpoint in a folder
    save_tiny_model("llava", tmp_path, seed=0)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tmp_path, local_files_only=True)
    text = model.config.get_text_config()

    # Act
    estimate = memory_of_folder(tmp_path)

    # Assert
    assert estimate.parameters == sum(p.numel() for p in model.parameters())
    assert (estimate.layers, estimate.heads) == (text.num_hidden_layers, text.num_attention_heads)
    assert estimate.model_type == "llava"


def test_llava_1_5_7b_dimensions_give_the_known_figures():
    # LLaVA 1.5 7B: Llama 2 7B text model (32 layers, 32 heads of 128) + CLIP ViT-L/336
    estimate = estimate_memory(LlavaConfig())

    assert 7.0e9 < estimate.parameters < 7.1e9
    assert estimate.weights_gib() == pytest.approx(estimate.parameters * 2 / GIB)
    # 2 (K and V) x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB a token
    assert estimate.kv_cache_gib(1024) == pytest.approx(0.5)
    assert estimate.kv_cache_gib(1024, batch=4, bytes_per_value=4) == pytest.approx(4.0)
    assert estimate.capture_bytes() == 32 * 32 * 128 * 4


def test_a_config_that_is_no_vision_language_model_is_refused():
    with pytest.raises(ModelError, match=r"config must describe a vision-language model"):
        estimate_memory(BertConfig())

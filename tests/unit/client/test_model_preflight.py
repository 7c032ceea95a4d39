"""Models are refused from their config alone, in one line naming what was found."""

from __future__ import annotations

import pytest
from transformers import BertConfig, LlavaConfig
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

from client.models.preflight import (
    per_layer_heads_refused,
    preflight_model,
    refuse_per_layer_heads,
)
from dpmtv_common.errors import ConfigError, ModelError, UnsupportedArchitectureError

PER_LAYER = r"attention layers must share one head count and head size, got per-layer head_dim"


def test_a_supported_config_passes_and_names_its_type(tmp_path):
    LlavaConfig().save_pretrained(tmp_path)

    assert preflight_model(tmp_path) == "llava"


def test_an_unsupported_model_type_is_refused_without_weights(tmp_path):
    BertConfig().save_pretrained(tmp_path)  # config.json only: no weights anywhere

    with pytest.raises(UnsupportedArchitectureError, match=r"model_type must be one of .*'bert'"):
        preflight_model(tmp_path)


def test_a_folder_without_a_config_and_a_missing_folder_are_refused(tmp_path):
    with pytest.raises(ModelError, match=r"--model must hold a saved model config"):
        preflight_model(tmp_path)
    with pytest.raises(ConfigError, match=r"--model must be an existing model directory"):
        preflight_model(tmp_path / "absent")


def test_per_layer_head_sizes_are_refused_by_name():
    # Gemma 4's full and sliding attention layers have different head sizes.
    config = Gemma4TextConfig()

    with pytest.raises(UnsupportedArchitectureError, match=PER_LAYER):
        refuse_per_layer_heads(config, model_type="gemma4")


def test_a_vlm_whose_text_model_has_per_layer_heads_is_refused():
    config = LlavaConfig(text_config=Gemma4TextConfig().to_dict())
    if "_heterogeneity_spec" not in vars(config.get_text_config()):
        pytest.skip("this transformers rebuilds the text config without per-layer attributes")

    with pytest.raises(UnsupportedArchitectureError, match=PER_LAYER):
        refuse_per_layer_heads(config, model_type="llava")


def test_transformers_per_layer_error_becomes_the_one_line_refusal():
    config = Gemma4TextConfig()

    with (
        pytest.raises(UnsupportedArchitectureError, match=PER_LAYER) as refused,
        per_layer_heads_refused("gemma4"),
    ):
        _ = config.head_dim  # what an adapter reading the global head size does

    assert type(refused.value.__cause__).__name__ == "AmbiguousGlobalPerLayerAttributeError"


def test_other_runtime_errors_pass_through():
    with pytest.raises(RuntimeError, match="other"), per_layer_heads_refused("llava"):
        raise RuntimeError("other")

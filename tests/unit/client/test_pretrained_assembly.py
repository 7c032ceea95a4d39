"""The pretrained-decoder assembly path, cut at the decoder: a tiny random Llama stands in for
SmolLM2 (no download); everything after the GGUF load runs as it does for the real model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from client.data.synthetic import QUESTION, SceneSpec, draw_scene
from client.models import load_model
from client.models._tiny_parts import text_config, tokenizer
from client.models.pretrained import (
    DECODER,
    IMAGE_TOKEN,
    assemble_from_decoder,
    assemble_pretrained_model,
    build_pretrained_vlm,
    pretrained_model_path,
    save_trained_parts,
    trained_parts,
)
from client.models.prompts import Example
from dpmtv_common.errors import ConfigError, ModelError
from dpmtv_common.rng import make_rng


def _quiet(message: str) -> None:
    del message


def _tiny_decoder(tied: bool = True):
    tok = tokenizer((), {})
    torch.manual_seed(0)
    config = tf.LlamaConfig(**text_config(tok, tie_word_embeddings=tied))
    return tf.LlamaForCausalLM(config).eval(), tok


def test_build_keeps_every_decoder_weight_and_adds_one_image_token():
    # Arrange
    decoder, tok = _tiny_decoder()
    # Act
    model, processor = build_pretrained_vlm(decoder, tok)
    # Assert
    assert processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == len(tok)
    assert model.config.image_token_id == len(tok)
    embeddings = model.state_dict()["model.language_model.embed_tokens.weight"]
    assert embeddings.shape[0] == len(tok) + 1
    language = model.model.language_model.state_dict()
    for key, value in decoder.state_dict().items():
        key = key.removeprefix("model.")
        if key == "lm_head.weight":
            continue
        if key == "embed_tokens.weight":
            assert torch.equal(language[key][: len(tok)], value)
        else:
            assert torch.equal(language[key], value), key
    tied = model.state_dict()["lm_head.weight"]
    assert tied.data_ptr() == embeddings.data_ptr()


def test_build_copies_an_untied_head():
    decoder, tok = _tiny_decoder(tied=False)
    model, _ = build_pretrained_vlm(decoder, tok)
    assert torch.equal(model.lm_head.weight[: len(tok)], decoder.lm_head.weight)


def test_trained_parts_are_only_the_vision_tower_and_projector():
    model, _ = build_pretrained_vlm(*_tiny_decoder())
    parts = trained_parts(model)
    assert parts
    assert all(k.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for k in parts)
    assert not any("language_model" in k or "lm_head" in k for k in parts)


def test_assembled_folder_loads_through_the_product_loader_with_the_trained_parts(tmp_path):
    # Arrange: "train" the parts (random values that differ from a fresh init), then assemble
    decoder, tok = _tiny_decoder()
    trained, _ = build_pretrained_vlm(decoder, tok)
    with torch.no_grad():
        for parameter in trained.model.multi_modal_projector.parameters():
            parameter.add_(1.0)
    save_trained_parts(trained, tmp_path / "parts")
    record = {"decoder_sha256": "test"}
    # Act
    out = assemble_from_decoder(
        decoder, tok, tmp_path / "model", parts_dir=tmp_path / "parts", record=record, log=_quiet
    )
    loaded = load_model(out, device="cpu")
    # Assert
    assert json.loads((out / "assembly.json").read_text()) == record
    assert loaded.adapter.head_shape(loaded.model).num_layers == decoder.config.num_hidden_layers
    for key, value in trained_parts(trained).items():
        assert torch.equal(loaded.model.state_dict()[key], value), key
    image = draw_scene(SceneSpec("red", "circle", 2, "left"), make_rng(0))
    demo = Example(image, QUESTION, "red")
    inputs = loaded.adapter.build_inputs(loaded.processor, [demo], Example(image, QUESTION))
    assert int((inputs["input_ids"] == len(tok)).sum()) == 2 * 4  # 4 image tokens an image
    assert torch.isfinite(loaded.model(**inputs).logits).all()
    assert not list(tmp_path.glob("model.*")), "no staging folder is left behind"


def test_parts_with_missing_or_foreign_tensors_are_refused(tmp_path):
    decoder, tok = _tiny_decoder()
    model, _ = build_pretrained_vlm(decoder, tok)
    save_trained_parts(model, tmp_path / "parts")
    parts = load_file(str(tmp_path / "parts" / "vision.safetensors"))
    parts.pop(next(iter(parts)))
    parts["model.language_model.norm.weight"] = torch.zeros(4)
    save_file(parts, str(tmp_path / "parts" / "vision.safetensors"))
    with pytest.raises(ModelError, match="1 unexpected and 1 missing"):
        assemble_from_decoder(
            decoder, tok, tmp_path / "m", parts_dir=tmp_path / "parts", record={}, log=_quiet
        )
    assert not (tmp_path / "m").exists()


def test_a_decoder_file_with_another_digest_is_refused_before_loading(tmp_path):
    decoder, tok = _tiny_decoder()
    model, _ = build_pretrained_vlm(decoder, tok)
    save_trained_parts(model, tmp_path / "parts")
    fake = tmp_path / DECODER.file_name
    fake.write_bytes(b"GGUF not the pinned file")
    with pytest.raises(ModelError, match="must have SHA-256"):
        assemble_pretrained_model(
            tmp_path / "model", gguf_file=fake, parts_dir=tmp_path / "parts", log=_quiet
        )
    assert not (tmp_path / "model").exists()


def test_missing_parts_or_model_name_the_command_that_makes_them(tmp_path):
    with pytest.raises(ConfigError, match="train_pretrained_vlm"):
        assemble_pretrained_model(tmp_path / "m", gguf_file=tmp_path / "x", parts_dir=tmp_path)
    with pytest.raises(ConfigError, match="scripts/assemble_pretrained_model"):
        pretrained_model_path(tmp_path / "nothing")

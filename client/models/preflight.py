"""Refuse a model a site cannot use from its config alone: before weights, before any data.

A command that reads a dataset checks the model first (:func:`preflight_model`), so an
unsupported architecture costs a second, not a full decode of the data. Two refusals, each
one line naming what was found:

* no adapter serves the config's ``model_type`` (``client.models.get_adapter``);
* the text model's attention layers differ in head count or head size (transformers'
  per-layer configs, e.g. Gemma 4's full and sliding attention layers): a task vector is
  one ``(layers, heads, head_dim)`` block, so such models are refused by name rather than
  failing deep in transformers with ``AmbiguousGlobalPerLayerAttributeError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpmtv_common.errors import ConfigError, ModelError, UnsupportedArchitectureError

__all__ = [
    "HEAD_ATTRIBUTES",
    "per_layer_heads_refused",
    "preflight_model",
    "refuse_per_layer_heads",
]

HEAD_ATTRIBUTES = frozenset({"num_attention_heads", "num_key_value_heads", "head_dim"})
"""Config attributes that fix the shape of an attention layer's heads."""


def preflight_model(path: str | os.PathLike[str]) -> str:
    """Check the saved config at ``path`` (no weights read); return its ``model_type``.

    Raises:
        ConfigError: ``path`` is not a folder.
        ModelError: It holds no readable config.
        UnsupportedArchitectureError: No adapter serves the model type, or its attention
            layers differ in head count or size.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"--model must be an existing model directory, got {str(path)!r}.")
    # Imported here: transformers takes seconds to import, and --help must stay fast.
    from transformers import AutoConfig

    from client.models import ensure_processor_shim, get_adapter

    ensure_processor_shim()
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(
            f"--model must hold a saved model config (config.json), got {str(path)!r}: {exc}"
        ) from exc
    model_type = str(config.model_type)
    get_adapter(model_type)
    refuse_per_layer_heads(config, model_type=model_type)
    return model_type


def refuse_per_layer_heads(config: Any, *, model_type: str) -> None:
    """Raise if the (text) config declares head attributes that vary from layer to layer."""
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        configs.append(text())
    for candidate in configs:
        spec = vars(candidate).get("_heterogeneity_spec")
        varying = sorted(HEAD_ATTRIBUTES & set(getattr(spec, "per_layer_attributes", ())))
        if varying:
            raise UnsupportedArchitectureError(_per_layer_message(model_type, varying))


@contextmanager
def per_layer_heads_refused(model_type: str) -> Iterator[None]:
    """Turn transformers' per-layer attribute error into the one-line refusal."""
    try:
        yield
    except RuntimeError as exc:
        if type(exc).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        attribute = str(exc).split("'")[1] if str(exc).count("'") >= 2 else "a head attribute"
        raise UnsupportedArchitectureError(_per_layer_message(model_type, [attribute])) from exc


def _per_layer_message(model_type: str, varying: list[str]) -> str:
    return (
        f"model attention layers must share one head count and head size, got per-layer "
        f"{', '.join(varying)} in model_type {model_type!r} (e.g. full and sliding attention "
        "layers of different sizes): a task vector is one (layers, heads, head_dim) block, so "
        "this model is not supported."
    )

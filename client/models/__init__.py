"""The model side of a site: adapters, prompts, loading and tiny offline builds.

Import from here, not from the modules: ``from client.models import load_model, Example``.
"""

from __future__ import annotations

from client.models._plugins import ADAPTER_ENTRY_POINT_GROUP
from client.models.adapters import (
    HeadShape,
    ModelAdapter,
    adapter_for,
    check_prompt_length,
    context_length,
    ensure_pad_token,
    get_adapter,
    load_adapter_plugins,
    register_adapter,
    supported_model_types,
)
from client.models.errors import AdapterPluginError, PromptTooLongError
from client.models.image_crops import ImageCropCap, cap_image_crops
from client.models.loading import (
    ATTENTION_IMPLEMENTATIONS,
    LoadedModel,
    default_fingerprint_cache_dir,
    ensure_processor_shim,
    load_model,
    prompt_template_digest,
    resolve_device,
    resolve_dtype,
)
from client.models.prompts import (
    Example,
    Message,
    Prompt,
    instruction_digest,
    prompt_to_messages,
)
from client.models.tiny import (
    ALL_TINY_ARCHITECTURES,
    TINY_ARCHITECTURES,
    TINY_IMAGE_SIZE,
    build_tiny_model,
    save_tiny_model,
)

__all__ = [
    "ADAPTER_ENTRY_POINT_GROUP",
    "ALL_TINY_ARCHITECTURES",
    "ATTENTION_IMPLEMENTATIONS",
    "AdapterPluginError",
    "Example",
    "HeadShape",
    "ImageCropCap",
    "LoadedModel",
    "Message",
    "ModelAdapter",
    "Prompt",
    "PromptTooLongError",
    "TINY_ARCHITECTURES",
    "TINY_IMAGE_SIZE",
    "adapter_for",
    "build_tiny_model",
    "cap_image_crops",
    "check_prompt_length",
    "context_length",
    "default_fingerprint_cache_dir",
    "ensure_pad_token",
    "ensure_processor_shim",
    "get_adapter",
    "instruction_digest",
    "load_adapter_plugins",
    "load_model",
    "prompt_template_digest",
    "prompt_to_messages",
    "register_adapter",
    "resolve_device",
    "resolve_dtype",
    "save_tiny_model",
    "supported_model_types",
]

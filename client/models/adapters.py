"""Per-architecture knowledge, kept as data in one registry keyed by ``config.model_type``.

An adapter knows where a model's decoder layers live, that each layer's
``self_attn.o_proj`` input is the concatenation of its heads' outputs ``(batch, seq, H * D)``
with head ``h`` in columns ``h * D:(h + 1) * D``, and how to lay out a K-shot prompt in the
architecture's chat format. Adding an architecture is one ``register_adapter`` call; nothing
else branches on model names (the Opacus ``register_grad_sampler`` pattern).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import BatchFeature, PreTrainedModel, ProcessorMixin

from client.models.prompts import Example, Prompt, prompt_to_messages
from dpmtv_common.errors import ConfigError, ModelError, UnsupportedArchitectureError

__all__ = [
    "HeadShape",
    "ModelAdapter",
    "adapter_for",
    "get_adapter",
    "register_adapter",
    "supported_model_types",
]

# The architectures' documented chat formats, written for content lists. They are used only
# when a processor ships no chat template of its own (a real checkpoint's always wins).
_LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
_QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_IDEFICS3_TURNS = (
    "{% for m in messages %}{{ m['role'] | capitalize }}"
    "{% if m['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
_IDEFICS3_TEMPLATE = "{{ bos_token }}" + _IDEFICS3_TURNS
_SMOLVLM_TEMPLATE = "<|im_start|>" + _IDEFICS3_TURNS


@dataclass(frozen=True)
class HeadShape:
    """The per-head layout of a model's attention outputs.

    Attributes:
        num_layers: Decoder layers ``L`` (every one has a hooked projection).
        num_heads: Query heads ``H`` a layer (GQA shares k/v, not the ``o_proj`` input).
        head_dim: Dimensions ``D`` a head.
    """

    num_layers: int
    num_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelAdapter:
    """How dpmtv reaches into one family of architectures.

    Attributes:
        model_types: The ``config.model_type`` values this adapter serves.
        layers_path: Dotted attribute path from the model to its decoder ``ModuleList``.
        chat_template: Jinja template of the architecture's documented chat format, used
            when the processor has none.
        projection_path: Dotted path from a decoder layer to its attention output projection,
            whose input holds the per-head outputs.
    """

    model_types: tuple[str, ...]
    layers_path: str
    chat_template: str
    projection_path: str = "self_attn.o_proj"

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """Return the model's decoder layers, in order."""
        try:
            layers = model.get_submodule(self.layers_path)
        except AttributeError as exc:
            raise ModelError(
                f"model must have decoder layers at {self.layers_path!r}, "
                f"got a {type(model).__name__} without them."
            ) from exc
        if not isinstance(layers, nn.ModuleList):
            raise ModelError(f"{self.layers_path} must be a ModuleList, got {type(layers)}.")
        return layers

    def output_projections(self, model: nn.Module) -> list[nn.Linear]:
        """Return each decoder layer's attention output projection (index = layer)."""
        projections = []
        for index, layer in enumerate(self.decoder_layers(model)):
            try:
                projection = layer.get_submodule(self.projection_path)
            except AttributeError as exc:
                raise ModelError(
                    f"layer {index} must have {self.projection_path!r}, got {type(layer).__name__}."
                ) from exc
            if not isinstance(projection, nn.Linear):
                raise ModelError(
                    f"layer {index} {self.projection_path} must be nn.Linear, "
                    f"got {type(projection).__name__}."
                )
            projections.append(projection)
        return projections

    def head_shape(self, model: PreTrainedModel) -> HeadShape:
        """Read ``H`` and ``D`` from the text config and check them against the projections.

        ``D`` is the config's ``head_dim`` when set, else ``hidden_size // H``.

        Raises:
            ModelError: A projection's ``in_features`` is not ``H * D``.
        """
        text_config = model.config.get_text_config()
        num_heads = int(text_config.num_attention_heads)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        projections = self.output_projections(model)
        for index, projection in enumerate(projections):
            if projection.in_features != num_heads * head_dim:
                raise ModelError(
                    f"layer {index} o_proj.in_features must equal num_heads * head_dim = "
                    f"{num_heads} * {head_dim}, got {projection.in_features}."
                )
        return HeadShape(len(projections), num_heads, int(head_dim))

    def build_inputs(
        self,
        processor: ProcessorMixin,
        demonstrations: Sequence[Example],
        query: Example,
        *,
        instruction: str | None = None,
    ) -> BatchFeature:
        """Tokenise one K-shot prompt; see :meth:`build_batch_inputs`."""
        prompt = Prompt.of(demonstrations, query)
        return self.build_batch_inputs(processor, [prompt], instruction=instruction)

    def build_batch_inputs(
        self,
        processor: ProcessorMixin,
        prompts: Sequence[Prompt],
        *,
        instruction: str | None = None,
    ) -> BatchFeature:
        """Tokenise prompts into one left-padded batch, each ending with the generation cue.

        Left padding puts every row's last prompt token at position ``-1``, where hooks read
        and patch. The query's answer never enters the prompt.

        Returns:
            The processor's tensors (``input_ids`` and ``attention_mask`` of shape
            ``(batch, seq)``, plus the architecture's image tensors).
        """
        if not prompts:
            raise ConfigError("prompts must hold at least one prompt, got [].")
        tokenizer = processor.tokenizer
        template = getattr(processor, "chat_template", None) or self.chat_template
        # The tokenizer renders the template: some processors' own apply_chat_template
        # (SmolVLM's) insists on a video processor, which an image-only install lacks.
        texts: list[str] = tokenizer.apply_chat_template(
            [prompt_to_messages(p, instruction=instruction) for p in prompts],
            chat_template=template,
            add_generation_prompt=True,
            tokenize=False,
        )
        # A template that writes the BOS itself must not get a second one (as transformers'
        # ProcessorMixin.apply_chat_template decides it).
        bos = tokenizer.bos_token
        outputs: Any = processor(
            text=texts,
            images=[p.images for p in prompts],
            padding=True,
            padding_side="left",
            add_special_tokens=not (bos and texts[0].startswith(bos)),
            return_tensors="pt",
        )
        if not isinstance(outputs, BatchFeature):
            raise ModelError(f"processor must return a BatchFeature, got {type(outputs)}.")
        return outputs


_REGISTRY: dict[str, ModelAdapter] = {}


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Register ``adapter`` under each of its model types and return it.

    Raises:
        ConfigError: A model type already has an adapter.
    """
    taken = [t for t in adapter.model_types if t in _REGISTRY]
    if taken:
        raise ConfigError(f"model_types must be new to the registry, got taken {taken!r}.")
    for model_type in adapter.model_types:
        _REGISTRY[model_type] = adapter
    return adapter


def supported_model_types() -> tuple[str, ...]:
    """Return the registered ``config.model_type`` values, sorted."""
    return tuple(sorted(_REGISTRY))


def get_adapter(model_type: str) -> ModelAdapter:
    """Return the adapter for ``model_type``.

    Raises:
        UnsupportedArchitectureError: No adapter serves ``model_type``.
    """
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model_type must be one of {list(supported_model_types())}, got {model_type!r}."
        ) from None


def adapter_for(model: PreTrainedModel) -> ModelAdapter:
    """Return the adapter for ``model``, looked up by ``model.config.model_type``."""
    return get_adapter(str(model.config.model_type))


register_adapter(ModelAdapter(("llava",), "model.language_model.layers", _LLAVA_TEMPLATE))
register_adapter(
    ModelAdapter(("qwen2_vl", "qwen2_5_vl"), "model.language_model.layers", _QWEN2_VL_TEMPLATE)
)
register_adapter(ModelAdapter(("idefics3",), "model.text_model.layers", _IDEFICS3_TEMPLATE))
register_adapter(ModelAdapter(("smolvlm",), "model.text_model.layers", _SMOLVLM_TEMPLATE))

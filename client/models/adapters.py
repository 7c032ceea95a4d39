"""Per-architecture knowledge, kept as data in one registry keyed by ``config.model_type``.

An adapter knows where a model's decoder layers live, which of them carry attention heads and
where their output projection is (``self_attn.o_proj`` in most; ``cross_attn.o_proj`` in
Mllama's cross-attention layers; none in a hybrid's linear-attention or convolution layers),
that the projection's input is the concatenation of its heads' outputs ``(batch, seq, H * D)``
with head ``h`` in columns ``h * D:(h + 1) * D``, and how to lay out a K-shot prompt in the
architecture's chat format. Layers are always counted in DECODER-layer indices, also in
artifacts: layer ``l`` is ``decoder_layers(model)[l]``, whether or not its neighbours carry
heads. Adding an architecture is one ``register_adapter`` call; nothing else branches on model
names (the Opacus ``register_grad_sampler`` pattern). A site adds one without editing dpmtv by
installing a package that declares it in the ``dpmtv.adapters`` entry point group
(:mod:`client.models._plugins`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import BatchFeature, PreTrainedModel, ProcessorMixin

from client.models import _templates, image_crops
from client.models._plugins import ADAPTER_ENTRY_POINT_GROUP, register_plugins
from client.models.errors import PromptTooLongError
from client.models.prompts import Example, Prompt, prompt_to_messages
from dpmtv_common.errors import ConfigError, ModelError, UnsupportedArchitectureError
from dpmtv_common.heads import HeadLayout, HeadSet

__all__ = [
    "HeadShape",
    "ModelAdapter",
    "adapter_for",
    "check_prompt_length",
    "context_length",
    "ensure_pad_token",
    "get_adapter",
    "load_adapter_plugins",
    "register_adapter",
    "supported_model_types",
]


_NUMPY_COPY_WARNING = r"__array__ implementation doesn't accept a copy keyword"


@dataclass(frozen=True)
class HeadShape:
    """The per-head layout of a model's attention outputs.

    Attributes:
        num_layers: Decoder layers ``L``; layer indices everywhere are decoder-layer indices.
        num_heads: Query heads ``H`` a layer (GQA shares k/v, not the ``o_proj`` input).
        head_dim: Dimensions ``D`` a head.
        head_layers: The decoder layers that carry heads, ascending; empty means all of them.
            A hybrid model's linear-attention or convolution layers carry none.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    head_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.head_layers:
            object.__setattr__(self, "head_layers", tuple(range(self.num_layers)))
        if any(not 0 <= layer < self.num_layers for layer in self.head_layers):
            raise ModelError(
                f"head_layers must lie in [0, {self.num_layers}), got {self.head_layers!r}."
            )

    def all_heads(self) -> HeadSet:
        """Every head the model carries, in decoder-layer indices (headless layers left out)."""
        return self.layout().all_heads()

    def layout(self) -> HeadLayout:
        """Which decoder layers carry heads: the head scope every release of this model uses."""
        return HeadLayout(self.num_layers, self.num_heads, self.head_layers)


@dataclass(frozen=True)
class ModelAdapter:
    """How dpmtv reaches into one family of architectures.

    Attributes:
        model_types: The ``config.model_type`` values this adapter serves.
        layers_path: Dotted attribute path from the model to its decoder ``ModuleList``.
        chat_template: Jinja template of the architecture's documented chat format, used
            when the processor has none (:meth:`prompt_template`); outside the model
            directory, so outside its fingerprint: sites compare its digest instead.
        projection_paths: Dotted paths from a decoder layer to its attention output
            projection, whose input holds the per-head outputs; the first that exists in a
            layer is used (Mllama: ``self_attn.o_proj``, then ``cross_attn.o_proj``).
        headless_layers: Whether a layer may have none of ``projection_paths`` (a hybrid's
            linear-attention or convolution layers); it then carries no heads. When False,
            such a layer is an error: the adapter is wrong for the model.
        image_crops: How the family's processor obeys a plan's ``max_image_crops``
            (:mod:`client.models.image_crops`); None refuses every cap.
        continuous_batching: Whether the service may step the family's decoder itself, rows
            joining and leaving a shared cache (``client.service.decoding``): its cache is
            plain full-attention layers, one column a prompt token, and its positions one
            number a token. Set only where answers were tested equal to ``generate()``'s;
            other families are served in passes through ``generate()``.
    """

    model_types: tuple[str, ...]
    layers_path: str
    chat_template: str
    projection_paths: tuple[str, ...] = ("self_attn.o_proj",)
    headless_layers: bool = False
    image_crops: image_crops.ImageCropCap | None = None
    continuous_batching: bool = False

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

    def _layer_projection(self, index: int, layer: nn.Module) -> nn.Linear | None:
        for path in self.projection_paths:
            try:
                projection = layer.get_submodule(path)
            except AttributeError:
                continue
            if not isinstance(projection, nn.Linear):
                raise ModelError(
                    f"layer {index} {path} must be nn.Linear, got {type(projection).__name__}."
                )
            return projection
        if self.headless_layers:
            return None
        raise ModelError(
            f"layer {index} must have one of {list(self.projection_paths)}, "
            f"got {type(layer).__name__}."
        )

    def projections_by_layer(self, model: nn.Module) -> dict[int, nn.Linear]:
        """Return ``{decoder layer: output projection}`` for the layers that carry heads."""
        found = {
            index: self._layer_projection(index, layer)
            for index, layer in enumerate(self.decoder_layers(model))
        }
        projections = {index: p for index, p in found.items() if p is not None}
        if not projections:
            raise ModelError(
                f"model must have at least one layer with {list(self.projection_paths)}, got none."
            )
        return projections

    def output_projections(self, model: nn.Module) -> list[nn.Linear]:
        """Return the output projections of the layers that carry heads, in layer order.

        For a model where every layer carries heads, item ``l`` is layer ``l``'s; for a hybrid
        use :meth:`projections_by_layer`, which keeps the decoder-layer index.
        """
        return list(self.projections_by_layer(model).values())

    def head_shape(self, model: PreTrainedModel) -> HeadShape:
        """Read ``H`` and ``D`` from the text config and check them against the projections.

        ``D`` is the config's ``head_dim`` when set, else ``hidden_size // H``.

        Raises:
            ModelError: A projection's ``in_features`` is not ``H * D``.
        """
        text_config = model.config.get_text_config()
        num_heads = int(text_config.num_attention_heads)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        projections = self.projections_by_layer(model)
        for index, projection in projections.items():
            if projection.in_features != num_heads * head_dim:
                raise ModelError(
                    f"layer {index} o_proj.in_features must equal num_heads * head_dim = "
                    f"{num_heads} * {head_dim}, got {projection.in_features}."
                )
        num_layers = len(self.decoder_layers(model))
        return HeadShape(num_layers, num_heads, int(head_dim), tuple(projections))

    def prompt_template(self, processor: ProcessorMixin) -> str:
        """Return the chat template every prompt is rendered with: the processor's, else ours.

        The one place that chooses it, so the rendering and its digest (a site reports it at
        plan time, the manifest records it) can never disagree. A processor's template lies
        in the model directory, under the fingerprint; the adapter's own does not, so only
        the digest ties it to a release. Named templates (a dict) render their ``"default"``,
        as ``transformers`` does.

        Raises:
            ModelError: The processor holds named templates without a ``"default"``.
        """
        shipped: str | dict[str, str] | None = getattr(processor, "chat_template", None)
        if isinstance(shipped, dict):
            if "default" not in shipped:
                raise ModelError(
                    f"a processor's named chat templates must include 'default', got "
                    f"{sorted(shipped)}."
                )
            shipped = shipped["default"]
        return shipped or self.chat_template

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
        and patch. The query's answer never enters the prompt. A tokenizer without a pad
        token gets one in memory (:func:`ensure_pad_token`).

        Returns:
            The processor's tensors (``input_ids`` and ``attention_mask`` of shape
            ``(batch, seq)``, plus the architecture's image tensors).
        """
        if not prompts:
            raise ConfigError("prompts must hold at least one prompt, got [].")
        tokenizer = processor.tokenizer
        ensure_pad_token(processor)
        template = self.prompt_template(processor)
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
        with warnings.catch_warnings():
            # PaliGemma's processor copies the ids through np.array(BatchEncoding), which numpy 2
            # flags; harmless (it builds the labels dropped below) and not ours to fix.
            warnings.filterwarnings("ignore", _NUMPY_COPY_WARNING, DeprecationWarning)
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
        outputs.pop("labels", None)  # PaliGemma's processor adds them; a prompt has no target
        return outputs

    def prompt_lengths(
        self,
        processor: ProcessorMixin,
        prompts: Sequence[Prompt],
        *,
        instruction: str | None = None,
    ) -> list[int]:
        """Return each prompt's length in tokens, image tokens included (no padding).

        This runs the processor (image preprocessing and tokenisation), never the model: a
        site can report the prompt lengths of its chunks before spending anything.
        """
        lengths = []
        for prompt in prompts:
            inputs = self.build_batch_inputs(processor, [prompt], instruction=instruction)
            lengths.append(int(inputs["input_ids"].shape[1]))
        return lengths


def ensure_pad_token(processor: ProcessorMixin) -> None:
    """Give a tokenizer without a pad token one, in memory only.

    Left-padded batches need a pad id; the padded positions are masked out, so which token
    fills them does not matter. The end-of-sequence token is used, else the unknown token,
    else id 0. The model's files are never edited, so the fingerprint is unchanged (editing
    ``tokenizer_config.json`` would change it at every site). Idempotent.
    """
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is not None:
        return
    for candidate in (tokenizer.eos_token, tokenizer.unk_token):
        if candidate is not None:
            tokenizer.pad_token = candidate
            return
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)


def context_length(model: PreTrainedModel) -> int | None:
    """Return the most tokens the language model was made for, or None if it says nothing.

    Read from the text config's ``max_position_embeddings`` (or ``max_sequence_length``).
    """
    text_config = model.config.get_text_config()
    for name in ("max_position_embeddings", "max_sequence_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_prompt_length(model: PreTrainedModel, num_tokens: int) -> None:
    """Refuse a prompt longer than the model's context, before any forward.

    Raises:
        PromptTooLongError: ``num_tokens`` exceeds :func:`context_length`.
    """
    limit = context_length(model)
    if limit is not None and num_tokens > limit:
        raise PromptTooLongError(
            f"prompt length must be at most the model's context of {limit} tokens, got "
            f"{num_tokens}. Use fewer shots a chunk, smaller images or fewer crops an image "
            "(image splitting multiplies image tokens: cap it with the plan's max-image-crops); "
            "`dpmtv-site data check DIR --model M --max-image-crops N` prints the lengths."
        )


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


def load_adapter_plugins() -> None:
    """Register every installed ``dpmtv.adapters`` plugin adapter not registered yet.

    Raises:
        AdapterPluginError: An entry point cannot be imported, does not give a
            ``ModelAdapter``, or claims a model type that is already registered.
    """
    register_plugins(register_adapter, ModelAdapter)


def supported_model_types() -> tuple[str, ...]:
    """Return the registered ``config.model_type`` values, sorted (installed plugins too)."""
    load_adapter_plugins()
    return tuple(sorted(_REGISTRY))


def get_adapter(model_type: str) -> ModelAdapter:
    """Return the adapter for ``model_type``, from the built-ins or an installed plugin.

    Raises:
        UnsupportedArchitectureError: No adapter serves ``model_type``.
        AdapterPluginError: An installed ``dpmtv.adapters`` entry point is broken.
    """
    if model_type not in _REGISTRY:
        load_adapter_plugins()  # lazily: a site pays for plugins only when it needs one
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model_type must be one of {list(supported_model_types())}, got {model_type!r}. "
            f"Register an adapter with register_adapter(), or install a package that declares "
            f"one in the {ADAPTER_ENTRY_POINT_GROUP!r} entry point group."
        ) from None


def adapter_for(model: PreTrainedModel) -> ModelAdapter:
    """Return the adapter for ``model``, looked up by ``model.config.model_type``."""
    return get_adapter(str(model.config.model_type))


def _builtin(model_types: tuple[str, ...], layers_path: str, template: str, **kw: Any) -> None:
    register_adapter(ModelAdapter(model_types, layers_path, template, **kw))


_LM = "model.language_model.layers"
_ONE = image_crops.never_splits
# continuous_batching only where the service's stepped decoding was tested equal to generate():
# not for sliding-window decoders (idefics2's Mistral, Gemma 3), PaliGemma's prefix attention,
# multimodal rotary positions (Qwen-VL), Mllama's cross-attention cache, hybrid stacks, or
# families without a tiny build here (Mistral 3, LFM2-VL); those are served in passes.
_builtin(("llava",), _LM, _templates.LLAVA, image_crops=_ONE, continuous_batching=True)
# Anyres: the crops follow the model config's image_grid_pinpoints (refused below their count).
_ANYRES = image_crops.fixed_by_model(image_crops.llava_next_max_crops, "image_grid_pinpoints")
_builtin(("llava_next",), _LM, _templates.LLAVA, image_crops=_ANYRES, continuous_batching=True)
_builtin(
    ("llava_onevision",),
    _LM,
    _templates.LLAVA_ONEVISION,
    image_crops=_ANYRES,
    continuous_batching=True,
)
# Dynamic resolution: image tokens grow with pixels up to max_pixels, never crops. Served in
# passes through generate(): their rotary positions are three numbers a token, offset per prompt.
_builtin(("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), _LM, _templates.QWEN_VL, image_crops=_ONE)
_TEXT = "model.text_model.layers"
_builtin(("idefics2",), _TEXT, _templates.IDEFICS2, image_crops=image_crops.split_in_four)
_builtin(
    ("idefics3",),
    _TEXT,
    _templates.IDEFICS3,
    image_crops=image_crops.split_into_tiles,
    continuous_batching=True,
)
_builtin(
    ("smolvlm",),
    _TEXT,
    _templates.SMOLVLM,
    image_crops=image_crops.split_into_tiles,
    continuous_batching=True,
)
_builtin(("paligemma",), _LM, _templates.PALIGEMMA, image_crops=_ONE)
_builtin(("gemma3",), _LM, _templates.GEMMA3, image_crops=image_crops.pan_and_scan)
_builtin(
    ("internvl",),
    _LM,
    _templates.INTERNVL,
    image_crops=image_crops.crop_to_patches,
    continuous_batching=True,
)
# Its processor (Pixtral, never splits) needs torchvision: tested model-only, like LFM2-VL.
_builtin(("mistral3",), _LM, _templates.MISTRAL3, image_crops=_ONE)
# Cross-attention stack: every fifth layer or so attends to the image through cross_attn.
# Its tiles are laid out as the vision config's max_num_tiles (refused below it).
_builtin(
    ("mllama",),
    _LM,
    _templates.MLLAMA,
    projection_paths=("self_attn.o_proj", "cross_attn.o_proj"),
    image_crops=image_crops.fixed_by_model(image_crops.mllama_max_crops, "max_num_tiles"),
)
# Hybrid stack: Gated DeltaNet (linear attention) layers carry no softmax heads to patch.
_builtin(("qwen3_5",), _LM, _templates.QWEN_VL, headless_layers=True, image_crops=_ONE)
# Hybrid stack: short-convolution layers carry no heads; attention ends in out_proj. Its
# processor needs torchvision, so the tests build the model only (no tiny processor); it
# splits into tiles (min_tiles/max_tiles), untested here, so a crop cap is refused.
_builtin(
    ("lfm2_vl",),
    _LM,
    _templates.LFM2_VL,
    projection_paths=("self_attn.out_proj",),
    headless_layers=True,
)

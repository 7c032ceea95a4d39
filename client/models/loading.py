"""Load a vision-language model, its processor and its adapter from a local directory.

Nothing here touches the network: every ``from_pretrained`` call sets
``local_files_only=True``, so ``HF_HUB_OFFLINE=1`` is enough and a missing file fails fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    PreTrainedModel,
    ProcessorMixin,
)

# The real class: ``transformers.AutoVideoProcessor`` is a placeholder without torchvision.
from transformers.models.auto.video_processing_auto import AutoVideoProcessor
from transformers.utils.hub import PushToHubMixin
from transformers.utils.import_utils import is_torchvision_available

from client.models.adapters import ModelAdapter, ensure_pad_token, get_adapter
from client.models.image_crops import cap_image_crops
from dpmtv_common.errors import ConfigError, ModelError
from dpmtv_common.fingerprint import fingerprint_model_dir

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "LoadedModel",
    "default_fingerprint_cache_dir",
    "ensure_processor_shim",
    "load_model",
    "prompt_template_digest",
    "resolve_device",
    "resolve_dtype",
]

_LOG = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
"""Values ``load_model(attn_implementation=...)`` accepts (transformers' names).

Every one computes per-head outputs before ``o_proj``, so the hooks read and patch the same
tensor under each; ``eager`` is the reference, ``sdpa`` the default."""
_TORCHVISION_FIX = (
    "This processor needs torchvision. Install the torchvision build that matches your torch "
    "(e.g. `pip install torchvision==<the version paired with torch {torch}>` from the same "
    "index as torch); the CPU torch wheel pinned for CI has no matching torchvision on PyPI, "
    "so use a CUDA machine's torch, or a model whose processor has a PIL image processor."
)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for hooks: in eval mode, on its device, with what describes it.

    Attributes:
        model: The ``*ForConditionalGeneration`` model.
        processor: Its processor (tokenizer + image processor + chat template).
        adapter: The registry entry for ``model.config.model_type``.
        fingerprint: ``fingerprint_model_dir`` of the directory it was read from; task-vector
            artifacts record it, and a site refuses a vector made for another model.
        max_image_crops: The cap on crops an image ``processor`` obeys (a plan's or an
            artifact's ``max_image_crops``), or None for the processor as shipped.
    """

    model: PreTrainedModel
    processor: ProcessorMixin
    adapter: ModelAdapter
    fingerprint: str
    max_image_crops: int | None = None

    def with_image_crops(self, max_crops: int | None) -> LoadedModel:
        """This model with a processor that splits no image into more than ``max_crops`` crops.

        None, or the cap already in force, returns ``self``. The processor is a copy (see
        ``client.models.image_crops``): the loaded one stays as shipped for other releases.

        Raises:
            ConfigError: The family cannot meet the cap (or declares no way to), or another
                cap is already in force (caps are applied to the shipped processor only).
        """
        if max_crops == self.max_image_crops:
            return self
        if self.max_image_crops is not None:
            raise ConfigError(
                f"max_image_crops must be applied to the processor as shipped, got "
                f"{max_crops!r} on a processor already capped at {self.max_image_crops}."
            )
        family = str(self.model.config.model_type)
        capped = cap_image_crops(
            self.processor, self.adapter.image_crops, max_crops=max_crops, family=family
        )
        return replace(self, processor=capped, max_image_crops=max_crops)

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as a name (``"float32"``, ``"bfloat16"``...), for artifacts."""
        return str(self.model.dtype).removeprefix("torch.")


def prompt_template_digest(loaded: LoadedModel) -> str:
    """Return the SHA-256 hex of the chat template ``loaded`` renders every prompt with.

    The text is the adapter's choice (:meth:`ModelAdapter.prompt_template`), the one the
    prompts are built with, whether the processor shipped it or the adapter supplies it. Sites
    report the digest at plan time and the manifest records it: the fingerprint alone misses
    a template that lives in dpmtv or a plugin rather than in the model directory.
    """
    template = loaded.adapter.prompt_template(loaded.processor)
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


class _AbsentSubprocessor(PushToHubMixin):
    """Stands in for a ``None`` sub-processor while a processor is saved; serialises to null."""

    _auto_class = None

    def to_dict(self) -> None:
        return None


def ensure_processor_shim() -> None:
    """Let image-only processors live without a video processor when torchvision is missing.

    transformers' video processors need torchvision, and processors that own one (Qwen2-VL,
    Qwen2.5-VL, SmolVLM) then refuse to be built, saved or loaded. torchvision cannot be
    installed next to the CPU torch this project pins, and dpmtv never feeds video, so the
    video processor is ``None``: accepted at construction, written as ``null`` by
    ``save_pretrained``, and read back as ``None`` by ``from_pretrained``. Idempotent; does
    nothing when torchvision is available.
    """
    if is_torchvision_available() or getattr(ProcessorMixin, "_dpmtv_shim", False):
        return
    check = ProcessorMixin.check_argument_for_proper_class
    save = ProcessorMixin.save_pretrained

    def check_allowing_none(self: ProcessorMixin, name: str, argument: Any) -> Any:
        return None if argument is None else check(self, name, argument)  # type: ignore[no-untyped-call]

    def save_allowing_none(self: ProcessorMixin, *args: Any, **kwargs: Any) -> Any:
        attributes = self.get_attributes()  # type: ignore[no-untyped-call]
        absent = [name for name in attributes if getattr(self, name) is None]
        for name in absent:
            setattr(self, name, _AbsentSubprocessor())
        try:
            return save(self, *args, **kwargs)
        finally:
            for name in absent:
                setattr(self, name, None)

    def no_video_processor(*args: Any, **kwargs: Any) -> None:
        return None

    ProcessorMixin.check_argument_for_proper_class = check_allowing_none  # type: ignore[method-assign]
    ProcessorMixin.save_pretrained = save_allowing_none  # type: ignore[method-assign]
    AutoVideoProcessor.from_pretrained = staticmethod(no_video_processor)  # type: ignore[method-assign]
    ProcessorMixin._dpmtv_shim = True  # type: ignore[attr-defined]


def resolve_device(device: str | None) -> torch.device:
    """Return ``device``, or CUDA when available and CPU otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device must be a torch device such as 'cpu', got {device!r}.") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device must be available, got {device!r} on a machine without CUDA.")
    return resolved


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """Return ``dtype``, or bfloat16 on GPU and float32 on CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.") from None


def default_fingerprint_cache_dir() -> Path:
    """Return ``$XDG_CACHE_HOME/dpmtv/fingerprints`` (``~/.cache/...``): remembered weight digests.

    Pass it (or a site's own cache folder) as ``load_model(fingerprint_cache=...)`` so a
    deployed site does not re-hash many GB of weights for every command or Flower message.
    """
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).absolute() / "dpmtv" / "fingerprints"


def _placement(device: torch.device, device_map: str | dict[str, Any] | None) -> dict[str, Any]:
    """``from_pretrained`` arguments that put the weights on ``device`` as they are read.

    With accelerate installed, a GPU model is loaded straight to the device (``device_map``)
    and never staged in host memory; without it, transformers refuses any device_map, so the
    weights are read to host memory and moved (logged, with the fix).
    """
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    if device_map is not None:
        if not has_accelerate:
            raise ConfigError(
                f"device_map needs the accelerate package, got device_map={device_map!r} "
                "without it. Install it: `pip install accelerate`."
            )
        return {"device_map": device_map}
    if device.type == "cpu":
        return {}
    if has_accelerate:
        return {"device_map": {"": str(device)}}
    _LOG.warning(
        "loading to host memory, then moving to %s: install accelerate to load straight "
        "to the device (`pip install accelerate`).",
        device,
    )
    return {}


def _check_attention(attn_implementation: str | None) -> dict[str, Any]:
    if attn_implementation is None:
        return {}
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            f"attn_implementation must be one of {list(ATTENTION_IMPLEMENTATIONS)}, "
            f"got {attn_implementation!r}."
        )
    return {"attn_implementation": attn_implementation}


def _read(
    directory: Path, path: object, options: dict[str, Any]
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Read the weights and the processor, turning transformers' errors into dpmtv's."""
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            directory, local_files_only=True, **options
        )
        processor = AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
            directory, local_files_only=True
        )
    except ImportError as exc:
        message = str(exc)
        if "orchvision" in message:
            fix = _TORCHVISION_FIX.format(torch=torch.__version__)
            first = next(line.strip() for line in message.splitlines() if line.strip())
            raise ModelError(f"processor must load, got {first!r}. {fix}") from exc
        raise ModelError(
            f"path must hold a model whose dependencies are installed, got {str(path)!r}: "
            f"{message.strip()}"
        ) from exc
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"path must hold a saved model and processor, got {str(path)!r}.") from exc
    return model, processor


def load_model(
    path: str | os.PathLike[str],
    *,
    device: str | None = None,
    dtype: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    fingerprint_cache: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load the model, processor and adapter saved in directory ``path``.

    Args:
        path: A local directory written by ``save_pretrained`` (model and processor).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available. On a GPU
            the weights go straight to the device when accelerate is installed.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; default bfloat16 on GPU,
            float32 on CPU.
        device_map: Passed to ``from_pretrained`` (``"auto"`` spreads a model too large for
            one GPU over several); needs accelerate. Overrides ``device`` for placement.
        attn_implementation: One of :data:`ATTENTION_IMPLEMENTATIONS`; default transformers'
            choice (``sdpa`` where supported).
        fingerprint_cache: Folder that remembers weight-file digests between loads (see
            ``dpmtv_common.fingerprint`` and :func:`default_fingerprint_cache_dir`); None
            hashes every weight file each time.

    Raises:
        ConfigError: ``path``, ``device``, ``dtype``, ``device_map`` or
            ``attn_implementation`` is unusable.
        UnsupportedArchitectureError: No adapter serves the saved ``model_type``.
        ModelError: transformers cannot read the model or processor (a processor that needs
            torchvision says so, with the fix).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"path must be an existing model directory, got {str(path)!r}.")
    torch_device = resolve_device(device)
    options: dict[str, Any] = {"dtype": resolve_dtype(dtype, torch_device)}
    options |= _check_attention(attn_implementation) | _placement(torch_device, device_map)
    ensure_processor_shim()
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"path must hold a saved model and processor, got {str(path)!r}.") from exc
    adapter = get_adapter(str(config.model_type))  # fail before reading any weights
    model, processor = _read(directory, path, options)
    if "device_map" not in options:
        cast(nn.Module, model).to(torch_device)  # in place; the typed .to() is mis-annotated
    model.train(False)  # eval mode; .eval() is untyped in transformers
    ensure_pad_token(processor)  # in memory only: the files, and the fingerprint, stay as they are
    adapter.head_shape(model)  # validates the hook sites now, not at the first forward
    fingerprint = fingerprint_model_dir(directory, cache_dir=fingerprint_cache)
    return LoadedModel(model, processor, adapter, fingerprint)

"""The plan's cap on crops an image: every site (and every query) splits images alike.

Small VLMs ship image splitting, and each crop costs its own image tokens: Idefics3 and
SmolVLM resize an image to ``size["longest_edge"]`` and cut it into ``max_image_size`` tiles
plus a global view (one 28-pixel image became 17 crops, 1,342 tokens, with SmolVLM's
defaults); Idefics2 cuts 4 crops and keeps the image; InternVL's GotOcr2 processor cuts up to
``max_patches`` and adds a thumbnail; Gemma3's pan-and-scan cuts up to
``pan_and_scan_max_num_crops`` and keeps the image. Two sites that split differently prompt
differently, so the plan fixes ``max_image_crops`` and each family declares, as data on its
adapter (``ModelAdapter.image_crops``), how its processor obeys a cap of N:

* :func:`never_splits`: the processor never splits (LLaVA 1.5, PaliGemma, Qwen-VL's dynamic
  resolution, Pixtral): every cap holds as shipped.
* a knob (:func:`split_into_tiles`, :func:`split_in_four`, :func:`crop_to_patches`,
  :func:`pan_and_scan`): sets the family's options on a copy of the processor so that no
  image yields more than N crops (N = 1: no splitting).
* :func:`fixed_by_model`: the crop count is tied to the model's config (LLaVA-NeXT's
  ``image_grid_pinpoints``, Mllama's ``max_num_tiles``); the processor alone cannot lower it
  without breaking the model's feature layout, so a cap at or above the most it makes holds
  and a lower one is refused.

An adapter that declares nothing (a plugin's, or LFM2-VL's, whose processor needs torchvision
and is untested here) has every cap refused: a cap is never silently ignored. The processor
a site loaded is never changed: :func:`cap_image_crops` returns a capped copy.

An option is read and set where the processor takes it from: a processor's class-level
``images_kwargs`` default (InternVL's ``crop_to_patches=True``, Gemma3's ``do_pan_and_scan``)
is passed to the image processor on every call and wins over the image processor's own
attribute, so both are set.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from transformers import ProcessorMixin

from dpmtv_common.errors import ConfigError

__all__ = [
    "ImageCropCap",
    "cap_image_crops",
    "crop_to_patches",
    "fixed_by_model",
    "llava_next_max_crops",
    "mllama_max_crops",
    "never_splits",
    "pan_and_scan",
    "split_in_four",
    "split_into_tiles",
]


class ImageCropCap(Protocol):
    """Make ``processor`` (a private copy) yield at most ``max_crops`` crops an image.

    Raises:
        ConfigError: The family cannot meet the cap (the message says what it can).
    """

    def __call__(self, processor: ProcessorMixin, max_crops: int) -> None:
        """Set the family's options on ``processor`` (a copy) for at most ``max_crops``."""


def _option(processor: ProcessorMixin, name: str) -> Any:
    """The value the processor passes for image option ``name`` (its own default first)."""
    defaults = getattr(processor, "images_kwargs", None)
    if isinstance(defaults, Mapping) and name in defaults:
        return defaults[name]
    return getattr(processor.image_processor, name, None)


def _set_option(processor: ProcessorMixin, name: str, value: Any) -> None:
    setattr(processor.image_processor, name, value)
    defaults = getattr(processor, "images_kwargs", None)
    if isinstance(defaults, Mapping) and name in defaults:
        # An instance attribute on the copy: the class-level dict stays as shipped.
        setattr(processor, "images_kwargs", {**defaults, name: value})  # noqa: B010


def _dimension(size: Any, key: str) -> int | None:
    """``size[key]`` of a dict or a transformers ``SizeDict``; None when unset."""
    value = size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)
    return int(value) if value else None


def _processor_name(processor: ProcessorMixin) -> str:
    return type(getattr(processor, "image_processor", processor)).__name__


def never_splits(processor: ProcessorMixin, max_crops: int) -> None:
    """A processor that never splits an image: one crop an image, every cap holds."""


def split_into_tiles(processor: ProcessorMixin, max_crops: int) -> None:
    """Idefics3, SmolVLM: ``size["longest_edge"]`` bounds the grid of ``max_image_size`` tiles.

    The image is resized so its longest edge is ``size["longest_edge"]``, rounded up to whole
    tiles and cut into them, plus one global view; a longest edge of ``g`` tiles gives at most
    ``g * g + 1`` crops. So the largest ``g`` with ``g * g + 1 <= N`` is kept (never above
    the shipped edge), and ``g <= 1`` turns splitting off (``do_image_splitting``).
    """
    if not _option(processor, "do_image_splitting"):
        return
    tile = _dimension(_option(processor, "max_image_size"), "longest_edge")
    longest = _dimension(_option(processor, "size"), "longest_edge")
    grid = math.isqrt(max_crops - 1)
    if grid <= 1 or tile is None or longest is None:
        _set_option(processor, "do_image_splitting", False)
        return
    _set_option(processor, "size", {"longest_edge": min(longest, grid * tile)})


def split_in_four(processor: ProcessorMixin, max_crops: int) -> None:
    """Idefics2: ``do_image_splitting`` cuts 4 crops and keeps the image (5); fewer: off."""
    if max_crops < 5:
        _set_option(processor, "do_image_splitting", False)


def crop_to_patches(processor: ProcessorMixin, max_crops: int) -> None:
    """GotOcr2 (InternVL): n patches, n in [min_patches, max_patches], plus a thumbnail if n > 1.

    So n is capped at ``N - 1`` (n = 1, no thumbnail, when N <= 2); ``max_patches = 1`` is
    the processor's own "do not crop".
    """
    if not _option(processor, "crop_to_patches"):
        return
    most = _option(processor, "max_patches") or 1
    patches = max(1, min(int(most), max_crops - 1))
    _set_option(processor, "max_patches", patches)
    fewest = _option(processor, "min_patches") or 1
    _set_option(processor, "min_patches", min(int(fewest), patches))


def pan_and_scan(processor: ProcessorMixin, max_crops: int) -> None:
    """Gemma3: pan-and-scan cuts 2 to ``pan_and_scan_max_num_crops`` crops and keeps the image.

    So at most ``N - 1`` crops; below 2 pan-and-scan is turned off (``do_pan_and_scan``).
    """
    if not _option(processor, "do_pan_and_scan"):
        return
    crops = max_crops - 1
    if crops < 2:
        _set_option(processor, "do_pan_and_scan", False)
        return
    most = _option(processor, "pan_and_scan_max_num_crops") or crops
    _set_option(processor, "pan_and_scan_max_num_crops", min(int(most), crops))


def llava_next_max_crops(processor: ProcessorMixin) -> int:
    """Most crops LLaVA-NeXT's anyres makes: the largest pinpoint's patches plus the base image."""
    images = processor.image_processor
    patch = (
        _dimension(getattr(images, "crop_size", None), "height")
        or _dimension(images.size, "height")
        or _dimension(images.size, "shortest_edge")
    )
    pinpoints = _option(processor, "image_grid_pinpoints") or []
    if not patch or not pinpoints:
        raise ConfigError(
            f"image processor must state its patch size and image_grid_pinpoints to count its "
            f"crops, got {_processor_name(processor)} without them."
        )
    return max(int(height) // patch * (int(width) // patch) for height, width in pinpoints) + 1


def mllama_max_crops(processor: ProcessorMixin) -> int:
    """Most tiles Mllama's processor makes an image: ``max_image_tiles``."""
    return int(_option(processor, "max_image_tiles"))


def fixed_by_model(count: Callable[[ProcessorMixin], int], config_key: str) -> ImageCropCap:
    """A family whose crop count the model's config fixes: caps below it are refused."""

    def check(processor: ProcessorMixin, max_crops: int) -> None:
        most = count(processor)
        if max_crops < most:
            raise ConfigError(
                f"max_image_crops must be at least {most} for this model, got {max_crops}: "
                f"its processor ({_processor_name(processor)}) makes up to {most} crops an "
                f"image, and the model's config ({config_key}) fixes that layout, so the "
                f"processor alone cannot make fewer. Leave the plan's max-image-crops unset "
                f"(0) or set it to {most} or more."
            )

    return check


def cap_image_crops(
    processor: ProcessorMixin,
    cap: ImageCropCap | None,
    *,
    max_crops: int | None,
    family: str,
) -> ProcessorMixin:
    """Return a copy of ``processor`` that splits no image into more than ``max_crops`` crops.

    ``max_crops`` None returns ``processor`` itself (as shipped). The copy shares the
    tokenizer; its image processor and option defaults are its own, so the processor a site
    loaded (and any other release's copy) is untouched.

    Args:
        processor: The loaded processor.
        cap: The family's way to obey a cap (``ModelAdapter.image_crops``); None refuses
            every cap.
        max_crops: The plan's ``max_image_crops``.
        family: The model type, for messages.

    Raises:
        ConfigError: ``max_crops`` < 1, the family declares no way to cap crops, or it cannot
            meet this cap.
    """
    if max_crops is None:
        return processor
    if max_crops < 1:
        raise ConfigError(f"max_image_crops must be >= 1 or unset, got {max_crops!r}.")
    if cap is None:
        raise ConfigError(
            f"max_image_crops must be unset for model type {family!r}, got {max_crops}: its "
            f"adapter declares no way to cap the crops of its image processor "
            f"({_processor_name(processor)}), and a cap is never ignored. Leave the plan's "
            "max-image-crops unset (0), or declare image_crops on the adapter "
            "(client.models.image_crops)."
        )
    capped = copy.copy(processor)
    capped.image_processor = copy.deepcopy(processor.image_processor)
    cap(capped, max_crops)
    return capped

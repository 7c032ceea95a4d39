"""Decode an image file as what it holds: 8-bit RGB, and how its stored values were read.

A model sees 8-bit RGB. How stored values become 0..255 depends on what the file holds, and
is decided from each image alone (one record's content must never change how another record
is read: that would let one record move many chunks):

============================  ==============================================================
stored as                     read as
============================  ==============================================================
8-bit modes (L, RGB, P, ...)  PIL's conversion: palette looked up, CMYK inverted, ``1``
                              widened; transparency composited over white
16-bit or 32-bit integer      **bit depth from the data**: the fewest of 8, 10, 12, 14 or 16
greyscale (``I;16*``, ``I``)  bits that hold the image's brightest value, divided by
                              2**bits - 1 (12-bit CT or X-ray content in a 16-bit PNG is
                              divided by 4095, not 65535). Values outside 0..65535 (signed or
                              wider data) are stretched from the image's own range
32-bit float (``F``)          0..1: times 255; 0..255: as is; any other range: stretched
                              from the image's own range. NaN or infinite values are refused
16-bit colour (48-bit RGB)    PIL keeps each channel's high byte. When that leaves fewer
                              than 16 levels (content of 12 bits or fewer, which would read
                              as black) the image is refused with the fix
============================  ==============================================================

Every image is decoded in full (a truncated file fails here, not mid-release), the EXIF
orientation is applied, and a decompression bomb (a header claiming more pixels than PIL's
``MAX_IMAGE_PIXELS``) is refused. :data:`IMAGE_SUFFIXES` is every extension PIL opens.
A query's image bytes (the site service's ``ask`` and HTTP endpoint) are decoded by the same
rules (:func:`rgb_from_bytes`), so a query is read as the release's examples were.
"""

from __future__ import annotations

import enum
import io
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image, ImageFile, ImageOps

from dpmtv_common.errors import DataError

__all__ = [
    "IMAGE_SUFFIXES",
    "DecodedImage",
    "PixelScale",
    "PixelSummary",
    "decode_image",
    "decoded_from_image",
    "read_rgb",
    "rgb_from_bytes",
    "size_from_bytes",
    "summarize_pixels",
    "to_rgb",
]

IMAGE_SUFFIXES: frozenset[str] = frozenset(
    suffix for suffix, name in Image.registered_extensions().items() if name in Image.OPEN
)
"""Every file extension PIL has a reader for (``.png``, ``.jpg``, ``.tif``, ``.bmp``, ...)."""

_INTEGER_GREY_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N", "I;16S"})
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_BACKGROUND = (255, 255, 255, 255)  # what transparent pixels show: a white page
_BIT_DEPTHS = (8, 10, 12, 14, 16)
_FEWEST_LEVELS = 16  # a 16-bit colour image whose high bytes stay below this reads as black


class PixelScale(enum.StrEnum):
    """How an image's stored values became 0..255 (the module docstring has the rules)."""

    EIGHT_BIT = "8-bit"
    BIT_DEPTH = "bit depth"
    FLOAT_UNIT = "float 0..1"
    FLOAT_BYTE = "float 0..255"
    OWN_RANGE = "own range"
    HIGH_BYTE = "high byte"


@dataclass(frozen=True)
class DecodedImage:
    """One image as the model will see it, and what was stored.

    Attributes:
        rgb: The 8-bit RGB image, EXIF orientation applied.
        mode: The PIL mode as stored (``I;16B`` and its kin read as ``I;16``).
        low: The smallest stored value (over all channels).
        high: The largest stored value.
        scale: How stored values became 0..255.
        bits: The bit depth read from the data (``BIT_DEPTH`` only; else None).
        frames: Frames the file holds (multi-page TIFF, animated GIF): the first is read.
    """

    rgb: Image.Image
    mode: str
    low: float
    high: float
    scale: PixelScale
    bits: int | None = None
    frames: int = 1

    def describe(self) -> str:
        """How the values were read, in words, e.g. ``12-bit content, divided by 4095``."""
        if self.scale is PixelScale.BIT_DEPTH and self.bits is not None:
            return f"{self.bits}-bit content, divided by {2**self.bits - 1}"
        return {
            PixelScale.EIGHT_BIT: "8-bit, as stored",
            PixelScale.BIT_DEPTH: "divided by its bit depth",
            PixelScale.FLOAT_UNIT: "float 0..1, times 255",
            PixelScale.FLOAT_BYTE: "float 0..255, as stored",
            PixelScale.OWN_RANGE: "stretched from each image's own range to 0..255",
            PixelScale.HIGH_BYTE: "16-bit colour, high byte of each channel",
        }[self.scale]

    def summary(self) -> PixelSummary:
        """This image's stored values, for :func:`summarize_pixels`."""
        several = int(self.frames > 1)
        return PixelSummary(self.mode, self.describe(), self.scale, 1, self.low, self.high, several)


def decode_image(path: str | os.PathLike[str] | io.BytesIO) -> DecodedImage:
    """Decode the whole image at ``path`` or in a buffer (closed on return); see the module doc.

    Raises:
        PIL.Image.DecompressionBombError: The header claims more than PIL's pixel limit (its
            warning is raised as :class:`PIL.Image.DecompressionBombWarning`).
        DataError: Values that cannot be read faithfully (NaN, 16-bit colour of few bits).
        OSError: The file cannot be opened or decoded (PIL raises other types too).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as image:
            wide_colour = _holds_wide_colour(image)  # the tile list is gone after load()
            frames = int(getattr(image, "n_frames", 1))  # the first is read: data check says so
            # load() decodes every pixel: verify() alone passes a truncated JPEG.
            image.load()
            # A camera's EXIF orientation is how the image is meant to be seen.
            upright = ImageOps.exif_transpose(image)
            return replace(decoded_from_image(upright, wide_colour=wide_colour), frames=frames)


def read_rgb(path: str | os.PathLike[str]) -> Image.Image:
    """The whole image at ``path`` as 8-bit RGB (:func:`decode_image`), file closed."""
    return decode_image(path).rgb


def rgb_from_bytes(data: bytes, index: int) -> Image.Image:
    """Image ``index`` of a query, decoded as a site's files are (:func:`decode_image`): RGB.

    Raises:
        DataError: The bytes are not a readable picture, exceed PIL's pixel limit, or hold
            values that cannot be read faithfully. The message names the image's index and
            never a memory address, so it may be returned to whoever asked.
    """
    try:
        return _rgb_alone(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(
            f"image {index} must have at most {Image.MAX_IMAGE_PIXELS} pixels."
        ) from exc
    except DataError as exc:
        raise DataError(f"image {index}: {exc}") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        reason = _without_addresses(str(exc))
        raise DataError(f"image {index} must be a readable picture: {reason}") from exc


def _rgb_alone(source: io.BytesIO) -> Image.Image:
    """:func:`decode_image`'s RGB, without the pixel summary a query never reads.

    The same reading (first frame, EXIF orientation, alpha, 16-bit checks), without the
    frame count (a GIF's is a pass over every frame) nor each pixel's minimum and maximum,
    which only the greyscale, float and 16-bit colour readings need: a small 8-bit PNG read in
    two thirds of the time in a one-off timing (46 against 70 us for a 40 x 40 one), and the
    HTTP front reads one for every image of every request.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(source) as image:
            wide_colour = _holds_wide_colour(image)  # the tile list is gone after load()
            image.load()
            upright = ImageOps.exif_transpose(image)
            if wide_colour or upright.mode in _INTEGER_GREY_MODES or upright.mode == "F":
                return decoded_from_image(upright, wide_colour=wide_colour).rgb
            return _eight_bit_rgb(upright)


def size_from_bytes(data: bytes, index: int, *, max_pixels: int) -> tuple[int, int]:
    """Width and height of image ``index`` of a query from its header alone (no pixel decoded).

    Raises:
        DataError: The header cannot be read, or the image has more than ``max_pixels``
            pixels; the message names the index and the bound, never a memory address.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # lazy: reads the header only
                width, height = image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"image {index} must have at most {max_pixels} pixels.") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        reason = _without_addresses(str(exc))
        raise DataError(f"image {index} must be a readable picture: {reason}") from exc
    if width * height > max_pixels:
        raise DataError(
            f"image {index} must have at most {max_pixels} pixels, got {width}x{height}."
        )
    return width, height


def _without_addresses(text: str) -> str:
    """``text`` without object reprs such as ``<_io.BytesIO object at 0x7f...>``."""
    return re.sub(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>", "", text)


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert an opened, loaded ``image`` to 8-bit RGB by the module docstring's rules."""
    return decoded_from_image(image).rgb


def decoded_from_image(image: Image.Image, *, wide_colour: bool = False) -> DecodedImage:
    """Read a loaded ``image``; ``wide_colour``: it was stored with 16 bits a colour channel."""
    mode = "I;16" if image.mode.startswith("I;16") else image.mode
    if image.mode in _INTEGER_GREY_MODES or image.mode == "F":
        return _grey_from_values(np.asarray(image), mode)
    rgb = _eight_bit_rgb(image)
    values = np.asarray(rgb)
    low, high = float(values.min()), float(values.max())
    if not wide_colour:
        return DecodedImage(rgb, mode, low, high, PixelScale.EIGHT_BIT)
    if high < _FEWEST_LEVELS:
        raise DataError(
            f"a 16-bit colour image must use more than 12 bits a channel to be read (PIL keeps "
            f"each channel's high byte), got high bytes of at most {high:g}: the image would "
            "read as black. Save it as 16-bit greyscale, or scale it to 8-bit colour."
        )
    return DecodedImage(rgb, mode, low, high, PixelScale.HIGH_BYTE)


def _holds_wide_colour(image: Image.Image) -> bool:
    """Whether PIL will narrow 16-bit colour channels to 8 when it loads ``image``."""
    if image.mode in _INTEGER_GREY_MODES or not isinstance(image, ImageFile.ImageFile):
        return False
    if not image.tile:
        return False
    args = image.tile[0].args
    rawmode = args[0] if isinstance(args, tuple) and args else args
    return isinstance(rawmode, str) and ";16" in rawmode


def _grey_from_values(values: np.ndarray, mode: str) -> DecodedImage:
    wide = values.astype(np.float64)
    if not np.isfinite(wide).all():
        bad = int((~np.isfinite(wide)).sum())
        raise DataError(
            f"pixel values must be finite, got {bad} NaN or infinite values in a mode {mode} image."
        )
    low, high = float(wide.min()), float(wide.max())
    bits = None
    if mode == "F" and low >= 0 and high <= 1:
        scale, scaled = PixelScale.FLOAT_UNIT, wide * 255
    elif mode == "F" and low >= 0 and high <= 255:
        scale, scaled = PixelScale.FLOAT_BYTE, wide
    elif mode != "F" and low >= 0 and high <= 65535:
        bits = next(b for b in _BIT_DEPTHS if high <= 2**b - 1)
        scale, scaled = PixelScale.BIT_DEPTH, wide * (255 / (2**bits - 1))
    else:
        span = high - low
        scaled = (wide - low) * (255 / span) if span > 0 else np.zeros_like(wide)
        scale = PixelScale.OWN_RANGE
    narrow = np.rint(scaled).clip(0, 255).astype(np.uint8)
    rgb = Image.fromarray(narrow).convert("RGB")
    return DecodedImage(rgb, mode, low, high, scale, bits)


def _eight_bit_rgb(image: Image.Image) -> Image.Image:
    """Palette, CMYK, alpha and the other 8-bit modes, as a viewer shows them."""
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        # Dropping alpha would show whatever colour the transparent pixels happen to hold.
        background = Image.new("RGBA", image.size, _BACKGROUND)
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class PixelSummary:
    """Stored values of the images of one mode read one way, for a site admin's report.

    Attributes:
        mode: The PIL mode as stored.
        reading: How the values were read (:meth:`DecodedImage.describe`).
        scale: The rule that read them.
        images: How many images.
        low: The smallest stored value over those images.
        high: The largest.
        several_frames: Images among them whose file holds more than one frame.
    """

    mode: str
    reading: str
    scale: PixelScale
    images: int
    low: float
    high: float
    several_frames: int = 0

    def line(self) -> str:
        """E.g. ``I;16 x6: 0..4095 (12-bit content, divided by 4095)``."""
        return f"{self.mode} x{self.images}: {self.low:g}..{self.high:g} ({self.reading})"


def summarize_pixels(images: Iterable[PixelSummary]) -> tuple[PixelSummary, ...]:
    """Merge summaries (e.g. one an image: :meth:`DecodedImage.summary`) by mode and reading."""
    groups: dict[tuple[str, str], PixelSummary] = {}
    for image in images:
        key = (image.mode, image.reading)
        seen = groups.get(key)
        groups[key] = (
            image
            if seen is None
            else replace(
                seen,
                images=seen.images + image.images,
                low=min(seen.low, image.low),
                high=max(seen.high, image.high),
                several_frames=seen.several_frames + image.several_frames,
            )
        )
    return tuple(sorted(groups.values(), key=lambda s: (-s.images, s.mode, s.reading)))

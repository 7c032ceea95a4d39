"""Argument types of ``dpmtv-site``: a bad value stops at the parser, before any work.

Each function is an argparse ``type=``: it turns the text the user typed into a value or
raises :class:`argparse.ArgumentTypeError`, which argparse prints as one line naming the
option (``argument --epsilon: must be a finite number > 0, got '-1'``) and exit code 2. The
ranges mirror the pydantic models the values end up in (``ReleasePlan``, ``SiteSettings``),
so a value that passes here cannot become a validation traceback later.
"""

from __future__ import annotations

import argparse
import math

__all__ = [
    "file_mode",
    "non_negative_int",
    "open_unit_float",
    "positive_float",
    "positive_int",
]


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (counts: shots, heads, chunks, batch size, steps)."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a limit where 0 is meaningful, a seed)."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (epsilon, clip norm, a budget); NaN and infinity are refused."""
    value = _number(text, float)
    # `not value > 0` also catches NaN, which compares false with everything.
    if not math.isfinite(value) or not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def open_unit_float(text: str) -> float:
    """A number strictly between 0 and 1 (delta, a share of epsilon)."""
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number strictly between 0 and 1, got {text!r}")
    return value


def file_mode(text: str) -> int:
    """Permission bits written in octal (``660`` or ``0o660``), at most ``0o777``."""
    try:
        value = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be octal permission bits such as 660, got {text!r}"
        ) from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"must be at most 777 (octal), got {text!r}")
    return value

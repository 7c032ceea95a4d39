"""Errors of the model side that only ``client`` raises, rooted in ``dpmtv_common.errors``.

::

    ModelError
    └── AdapterPluginError           an installed ``dpmtv.adapters`` entry point is broken
    ConfigError (ValueError)
    └── PromptTooLongError           a prompt exceeds the model's context
"""

from __future__ import annotations

from dpmtv_common.errors import ConfigError, ModelError

__all__ = ["AdapterPluginError", "PromptTooLongError"]


class AdapterPluginError(ModelError):
    """An installed ``dpmtv.adapters`` entry point cannot be loaded or is not an adapter."""


class PromptTooLongError(ConfigError):
    """A prompt has more tokens than the model's context; raised before any forward."""

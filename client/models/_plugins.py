"""Third-party adapters, found through the ``dpmtv.adapters`` entry point group.

A site that needs an architecture dpmtv does not ship installs a package declaring, e.g. in
its ``pyproject.toml``::

    [project.entry-points."dpmtv.adapters"]
    my_vlm = "my_package.dpmtv_adapter:ADAPTER"

where ``ADAPTER`` is a :class:`client.models.ModelAdapter` (or a function of no arguments that
returns one). The registry (:mod:`client.models.adapters`, which hands its own
``register_adapter`` and adapter type to :func:`register_plugins`, so this module imports
nothing of it) loads the group lazily, the first time a lookup misses, so the CLI
and the Flower site (which both look adapters up through ``get_adapter``) see the plugin
without any flag. A broken entry point is an :class:`AdapterPluginError` naming the
distribution, never a bare traceback from inside the plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from client.models.errors import AdapterPluginError

__all__ = ["ADAPTER_ENTRY_POINT_GROUP", "AdapterPluginError", "register_plugins"]

ADAPTER_ENTRY_POINT_GROUP = "dpmtv.adapters"

_loaded: set[str] = set()  # entry points already registered, by "dist:name"


def _describe(entry_point: metadata.EntryPoint) -> str:
    dist = entry_point.dist.name if entry_point.dist is not None else "an unknown distribution"
    return f"entry point {entry_point.name!r} = {entry_point.value!r} of {dist}"


def _adapter_of(entry_point: metadata.EntryPoint, adapter_type: type) -> Any:
    try:
        target = entry_point.load()
        factory = callable(target) and not isinstance(target, adapter_type)
        adapter = target() if factory else target
    except Exception as exc:  # a plugin may raise anything; name it and stop
        raise AdapterPluginError(
            f"{_describe(entry_point)} must load, got {type(exc).__name__}: {exc}. "
            "Fix or uninstall that package."
        ) from exc
    if not isinstance(adapter, adapter_type):
        raise AdapterPluginError(
            f"{_describe(entry_point)} must give a ModelAdapter, got {type(adapter).__name__}."
        )
    return adapter


def register_plugins(register: Callable[[Any], object], adapter_type: type) -> None:
    """Register every installed ``dpmtv.adapters`` adapter not registered yet.

    Args:
        register: The registry's own registration function (``register_adapter``).
        adapter_type: What an entry point must give (``ModelAdapter``).

    Raises:
        AdapterPluginError: An entry point cannot be imported, does not give a
            ``ModelAdapter``, or claims a model type that is already registered.
    """
    from dpmtv_common.errors import ConfigError

    for entry_point in metadata.entry_points(group=ADAPTER_ENTRY_POINT_GROUP):
        key = f"{entry_point.value}:{entry_point.name}"
        if key in _loaded:
            continue
        adapter = _adapter_of(entry_point, adapter_type)
        try:
            register(adapter)
        except ConfigError as exc:
            raise AdapterPluginError(f"{_describe(entry_point)}: {exc}") from exc
        _loaded.add(key)

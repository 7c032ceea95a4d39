"""Test helpers around the in-process grid (``server.simulation``).

``LoopbackGrid`` is the product's ``InProcessGrid`` under the name the tests grew up with;
:func:`flower_process_state` restores what tests change process-wide.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

from flwr.supercore.task_identity import TaskIdentity

from server.simulation import (
    FIRST_NODE_ID,
    InProcessGrid,
    make_server_context,
    set_task_identity,
)

LoopbackGrid = InProcessGrid

__all__ = [
    "FIRST_NODE_ID",
    "LoopbackGrid",
    "flower_process_state",
    "make_server_context",
    "set_task_identity",
]


@contextmanager
def flower_process_state() -> Iterator[None]:
    """Restore what tests change process-wide: the task identity and both mask PRG names."""
    identity = {name: vars(TaskIdentity)[name] for name in _IDENTITY_FIELDS}
    modules = [importlib.import_module(name) for name in _PRG_MODULES]
    prgs = [vars(module)["pseudo_rand_gen"] for module in modules]
    try:
        yield
    finally:
        for name, value in identity.items():
            setattr(TaskIdentity, name, value)
        for module, prg in zip(modules, prgs, strict=True):
            vars(module)["pseudo_rand_gen"] = prg


_IDENTITY_FIELDS = ("_run_id", "_node_id", "_task_id")
# Where flwr 1.42 looks up the mask PRG (client mod and server workflow).
_PRG_MODULES = (
    "flwr.client.mod.secure_aggregation.secaggplus_mod",
    "flwr.server.workflow.secure_aggregation.secaggplus_workflow",
)

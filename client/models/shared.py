"""One read-only model per process for every site that runs it.

How this connects: :meth:`client.release.site.Site.model` asks :func:`shared_model` for the model
its settings name. The weights are public (every site of a release runs the same fingerprinted
model), so sites simulated in one process (``scripts/demo``, the benchmarks, the integration
tests) share one loaded copy: N sites cost one load and the memory of one model. What is
private stays per site — its data, ledger, seeds, references and records live on its own
:class:`~client.release.site.Site`. A deployed site service runs one site per process and loads its
model once, as before.

The key is what changes the loaded object: the resolved model folder and the identity of
its files (a folder rewritten in place loads again), the resolved device and dtype, the
device map and the attention implementation. The fingerprint cache folder is not part of
it: it only spares re-hashing, the fingerprint is the same.

Sharing is only safe if no site writes to the weights, so they are read-only by contract
and the contract is checked: every parameter has ``requires_grad`` False, and
:class:`WeightGuard` notes each parameter's (and persistent buffer's) tensor, storage and
torch version counter at load. Every hand-out checks them (a few microseconds a tensor): an
in-place write (``p.add_``, ``p[0] = ...``, ``p.copy_``, through a view or ``detach()``), a
replaced tensor, or a parameter put back under training raises :class:`ModelError` before the
next site computes on altered weights. ``p.data`` writes bypass torch's version counter; the
full check (:meth:`WeightGuard.check_contents`, a digest of every byte, taken at load for a
model in host memory: one pass over its weights) catches those too.

Sites in one process use the model one at a time (the in-process grid delivers one message
after another; the service holds a lock per request), so forward hooks registered by one
site's computation are gone before the next site's begins (:mod:`client.activations.hooks`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from client.models import LoadedModel, load_model, resolve_device, resolve_dtype
from dpmtv_common.errors import ConfigError, ModelError

__all__ = [
    "ModelKey",
    "WeightGuard",
    "check_shared_contents",
    "clear_shared_models",
    "model_key",
    "shared_model",
    "shared_model_count",
]


@dataclass(frozen=True)
class ModelKey:
    """What makes two loads of a model the same object.

    Attributes:
        folder: The model folder, resolved (links followed).
        files: ``(name, inode, size, mtime_ns)`` of each file at its top level, so a folder
            rewritten in place is loaded again rather than served stale.
        device: The resolved torch device (``"cpu"``, ``"cuda:0"``).
        dtype: The resolved weight dtype (``"float32"``, ``"bfloat16"``...).
        device_map: ``from_pretrained``'s device map, if any.
        attn_implementation: The attention implementation asked for, if any.
    """

    folder: Path
    files: tuple[tuple[str, int, int, int], ...]
    device: str
    dtype: str
    device_map: str | None
    attn_implementation: str | None


def model_key(
    path: str | os.PathLike[str],
    *,
    device: str | None = None,
    dtype: str | None = None,
    device_map: str | None = None,
    attn_implementation: str | None = None,
) -> ModelKey:
    """The :class:`ModelKey` of a load of ``path`` with these options.

    Raises:
        ConfigError: ``path`` is not a folder, or ``device`` or ``dtype`` is unusable.
    """
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise ConfigError(f"path must be an existing model directory, got {str(path)!r}.")
    torch_device = resolve_device(device)
    device_name = str(torch_device)
    if device_name == "cuda":  # "cuda" and "cuda:0" load to the same place
        device_name = f"cuda:{torch.cuda.current_device()}"
    torch_dtype = resolve_dtype(dtype, torch_device)
    return ModelKey(
        folder=folder,
        files=_file_identities(folder),
        device=device_name,
        dtype=str(torch_dtype).removeprefix("torch."),
        device_map=device_map,
        attn_implementation=attn_implementation,
    )


def _file_identities(folder: Path) -> tuple[tuple[str, int, int, int], ...]:
    identities = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file():  # follows links, as from_pretrained does
                info = entry.stat()
                identities.append((entry.name, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(sorted(identities))


@dataclass(frozen=True)
class _TensorState:
    """Where a guarded tensor lives and what it was at load."""

    name: str
    owner: nn.Module
    attribute: str
    is_parameter: bool
    tensor: torch.Tensor
    data_ptr: int
    version: int

    def current(self) -> torch.Tensor | None:
        table = self.owner._parameters if self.is_parameter else self.owner._buffers
        return table.get(self.attribute)


class WeightGuard:
    """Detects any change to a shared model's weights after it was loaded.

    Construct it once, right after loading: it turns ``requires_grad`` off on every
    parameter and notes what :meth:`check` and :meth:`check_contents` compare against.
    :meth:`check` looks each tensor up where it was registered (no walk of the module
    tree), so a hand-out costs about a microsecond a tensor.
    """

    def __init__(self, model: nn.Module) -> None:
        """Freeze ``model``'s parameters and note their state."""
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        self._states = _guarded(model)
        # Host weights only: hashing a GPU model would copy all of it to host memory.
        on_host = all(state.tensor.device.type == "cpu" for state in self._states)
        self._digest = self._contents_digest() if on_host else None

    def check(self) -> None:
        """Raise if a guarded tensor was written in place, replaced, or made trainable.

        Raises:
            ModelError: The shared weights are no longer as loaded.
        """
        for state in self._states:
            tensor = state.current()
            if tensor is not state.tensor or tensor.data_ptr() != state.data_ptr:
                raise _altered(f"{state.name!r} was replaced or removed")
            if tensor._version != state.version:
                raise _altered(f"{state.name!r} was written in place")
            if tensor.requires_grad:
                raise _altered(f"{state.name!r} has requires_grad=True")

    def check_contents(self) -> None:
        """:meth:`check`, then compare a digest of every weight byte with the one at load.

        Costs one pass over the weights; catches writes through ``.data``, which torch's
        version counter does not see. Only for weights in host memory (the digest of a GPU
        model is not taken at load).

        Raises:
            ModelError: The shared weights are no longer as loaded, or are not in host memory.
        """
        self.check()
        if self._digest is None:
            raise ModelError(
                "check_contents must run on a model loaded to the CPU, got weights on "
                f"{self._states[0].tensor.device}; check() still guards them."
            )
        if self._contents_digest() != self._digest:
            raise _altered("their bytes differ from the loaded ones")

    def _contents_digest(self) -> bytes:
        digest = hashlib.blake2b(digest_size=32)
        for state in self._states:
            digest.update(state.name.encode())
            flat = state.tensor.detach().reshape(-1).contiguous().view(torch.uint8)
            digest.update(flat.numpy().data)  # the tensor's own bytes, not a copy
        return digest.digest()


def _guarded(model: nn.Module) -> list[_TensorState]:
    """Parameters and persistent buffers, each noted where it is registered.

    Non-persistent buffers (rotary frequency tables) are derived, and some models recompute
    them during a forward pass (dynamic RoPE): they are not weights. A tensor shared by two
    modules (tied embeddings) is noted under each.
    """
    states = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        tables = [(True, module._parameters, set[str]())]
        tables.append((False, module._buffers, module._non_persistent_buffers_set))
        for is_parameter, table, skipped in tables:
            for attribute, tensor in table.items():
                if tensor is not None and attribute not in skipped:
                    states.append(
                        _TensorState(
                            name=prefix + attribute,
                            owner=module,
                            attribute=attribute,
                            is_parameter=is_parameter,
                            tensor=tensor,
                            data_ptr=tensor.data_ptr(),
                            version=tensor._version,
                        )
                    )
    return states


def _altered(what: str) -> ModelError:
    return ModelError(
        f"shared model weights must stay as loaded (sites in one process share them), got "
        f"{what}. Compute on copies; never write to a loaded model."
    )


@dataclass(frozen=True)
class _Shared:
    loaded: LoadedModel
    guard: WeightGuard


_SHARED: dict[ModelKey, _Shared] = {}
_LOCK = threading.Lock()


def shared_model(
    path: str | os.PathLike[str],
    *,
    device: str | None = None,
    dtype: str | None = None,
    device_map: str | None = None,
    attn_implementation: str | None = None,
    fingerprint_cache: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """The process's one loaded copy of the model ``path`` names, loaded on first use.

    Arguments are :func:`client.models.load_model`'s. Every call checks the weights are as
    loaded (:meth:`WeightGuard.check`).

    Raises:
        ConfigError: As :func:`model_key` and :func:`client.models.load_model`.
        ModelError: The model cannot be loaded, or a user wrote to its weights.
    """
    key = model_key(
        path,
        device=device,
        dtype=dtype,
        device_map=device_map,
        attn_implementation=attn_implementation,
    )
    with _LOCK:  # two threads asking at once load once
        shared = _SHARED.get(key)
        if shared is None:
            loaded = load_model(
                key.folder,
                device=device,
                dtype=dtype,
                device_map=device_map,
                attn_implementation=attn_implementation,
                fingerprint_cache=fingerprint_cache,
            )
            shared = _Shared(loaded, WeightGuard(loaded.model))
            _SHARED[key] = shared
    shared.guard.check()
    return shared.loaded


def shared_model_count() -> int:
    """How many models this process holds."""
    return len(_SHARED)


def check_shared_contents() -> None:
    """Run :meth:`WeightGuard.check_contents` on every model this process holds.

    Raises:
        ModelError: A shared model's weights changed since it was loaded.
    """
    for shared in list(_SHARED.values()):
        shared.guard.check_contents()


def clear_shared_models() -> None:
    """Forget every held model (tests; a process that is done with its models)."""
    with _LOCK:
        _SHARED.clear()

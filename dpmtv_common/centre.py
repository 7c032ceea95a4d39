"""The public centre of a centred release: subtracted before clipping, added back after noise.

Why a centre. Clipping shrinks every chunk whose layer norm exceeds C, so the clipped mean is
a shorter, biased vector. On a pretrained decoder most of a head's activation is shared by
every task of a domain (the same images, the same question): the part that carries *this*
task is a small shift on top of it. Clipping the raw activation spends C on the shared part;
clipping ``a - r``, with r the mean activation of public chunks of *other* tasks of the domain
(task-agnostic public data), spends it on the shift, so a smaller C keeps the signal and the
release carries proportionally less noise (measured in docs/benchmarks.md).

Privacy (why nothing changes). The centre r is public: it is computed from public data only,
fixed before any private data is read, and pinned by its digest in the plan (so in the plan
hash and in every ledger that records it). Each chunk contributes ``clip_per_layer(a - r, C)``,
whose norm in every in-scope layer is at most C whatever r is, so the secure sum keeps its
sensitivity Δ₂ = 2·C·√L_scope under replace-one of one privacy unit's chunk, and the plan's
calibration (z, ε₀) is the same with or without a centre. Adding r back to the noisy mean is
post-processing. A hostile centre can only cost utility, never privacy; a site still checks
that the centre it is sent is the one the plan pins (:meth:`ActivationCentre.digest`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

__all__ = ["CENTRE_TENSOR", "ActivationCentre"]

CENTRE_TENSOR = "centre"
"""Name of the one tensor in a centre file (safetensors)."""
_DIGEST_DOMAIN = b"dpmtv-centre/1\x00"


@dataclass(frozen=True, eq=False)
class ActivationCentre:
    """A dense public mean activation ``(L, H, D)``, float64, one slot per (layer, head).

    Slots of headless layers hold zeros (nothing is read there). Build it with
    :meth:`from_array`, which copies and checks the values.
    """

    values: Float64Array

    @classmethod
    def from_array(cls, values: object) -> ActivationCentre:
        """Check ``values`` (3-d, finite) and keep a read-only float64 copy.

        Raises:
            ConfigError: Not a 3-d array of finite numbers.
        """
        array = np.array(values, dtype=np.float64)
        if array.ndim != 3 or 0 in array.shape:
            raise ConfigError(
                f"centre must be a non-empty (layers, heads, head_dim) array, got shape "
                f"{array.shape!r}."
            )
        if not np.isfinite(array).all():
            raise ConfigError(
                f"centre must hold finite values only, got {int((~np.isfinite(array)).sum())} "
                "non-finite values."
            )
        array.setflags(write=False)
        return cls(array)

    @classmethod
    def from_flat(cls, flat: object, *, shape: tuple[int, int, int]) -> ActivationCentre:
        """Rebuild a centre sent as a flat float64 vector for a model of ``shape``.

        Raises:
            ConfigError: The vector does not hold ``L * H * D`` values.
        """
        array = np.asarray(flat, dtype=np.float64)
        expected = int(np.prod(shape))
        if array.ndim != 1 or array.size != expected:
            raise ConfigError(
                f"centre must hold L*H*D = {expected} values for a model of shape {shape!r}, "
                f"got an array of shape {array.shape!r}."
            )
        return cls.from_array(array.reshape(shape))

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(L, H, D)``."""
        layers, heads, dim = self.values.shape
        return int(layers), int(heads), int(dim)

    def digest(self) -> str:
        """SHA-256 hex of the shape and the little-endian float64 values (what a plan pins)."""
        header = np.asarray(self.shape, dtype="<u8").tobytes()
        body = np.ascontiguousarray(self.values, dtype="<f8").tobytes()
        return hashlib.sha256(_DIGEST_DOMAIN + header + body).hexdigest()

    def flat(self) -> Float64Array:
        """The values as one float64 vector (how a centre travels beside a plan)."""
        return np.ascontiguousarray(self.values.ravel())

    def rows(self, heads: HeadSet) -> Float64Array:
        """The centre's rows for ``heads``, ``(len(heads), D)`` in the set's order.

        Raises:
            ConfigError: A head lies outside the centre's layers or heads.
        """
        index = heads.to_array()
        layers, per_layer, _ = self.shape
        if len(index) and (index[:, 0].max() >= layers or index[:, 1].max() >= per_layer):
            raise ConfigError(
                f"heads must lie inside the centre's {layers} layers x {per_layer} heads, got "
                f"{[list(h) for h in heads.heads if h[0] >= layers or h[1] >= per_layer][:4]}."
            )
        return np.array(self.values[index[:, 0], index[:, 1]], dtype=np.float64)

    def save(self, path: Path) -> None:
        """Write the centre as a safetensors file (one tensor, its digest in the metadata)."""
        save_file({CENTRE_TENSOR: np.array(self.values)}, str(path), {"sha256": self.digest()})

    @classmethod
    def load(cls, path: Path) -> ActivationCentre:
        """Read a centre file written by :meth:`save`.

        Raises:
            ConfigError: The file is missing, not a centre file, or its values are invalid.
        """
        try:
            tensors = load_file(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"centre file must be a readable safetensors file: {exc}") from exc
        except Exception as exc:  # safetensors raises its own error type on a malformed header
            raise ConfigError(f"centre file must be a valid safetensors file: {exc}") from exc
        if set(tensors) != {CENTRE_TENSOR}:
            raise ConfigError(
                f"centre file must hold exactly one tensor {CENTRE_TENSOR!r}, got "
                f"{sorted(tensors)!r} in {str(path)!r}."
            )
        return cls.from_array(tensors[CENTRE_TENSOR])

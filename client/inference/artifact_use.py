"""May this artifact be used here? One answer for every command and the site service.

A released task vector patches the heads it was read from, at the prompt position it was read
at, in the precision it was read in. Used anywhere else it answers something, just not what
was released. So before any query is patched, the artifact must be: signed by a trusted key,
its tensors the ones the manifest hashes, made for this model (fingerprint), read in this
model's dtype, prompted with this model's chat template, and made of heads that exist in the
model with finite values of its head width. The queries' instruction is checked per query by
:func:`client.inference.answers.check_instruction` (each query brings its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from client.models import LoadedModel, prompt_template_digest
from dpmtv_common.artifact import TaskVectorArtifact, load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError

__all__ = ["Remedies", "usable_artifact"]


@dataclass(frozen=True)
class Remedies:
    """What the caller's user changes when a check refuses (a flag, a setting).

    Attributes:
        dtype: How to load the model in the artifact's dtype; ``{dtype}`` is replaced by it.
        template: How to get the chat template the artifact's prompts were rendered with.
    """

    dtype: str
    template: str


def usable_artifact(
    folder: Path, *, loaded: LoadedModel, keys: TrustedKeys, remedies: Remedies
) -> tuple[TaskVectorArtifact, torch.Tensor]:
    """The artifact in ``folder`` and its values, if it may patch ``loaded`` here.

    Raises:
        DpmtvError: What refused it: the signature, the tensors' hash or the model
            fingerprint (:func:`dpmtv_common.artifact.load_artifact`); a ``ConfigError`` for
            the dtype, the chat template, heads the model lacks or values not finite.
    """
    artifact = load_artifact(
        folder, trusted_keys=keys, expected_model_fingerprint=loaded.fingerprint
    )
    manifest = artifact.manifest
    if manifest.model_dtype is not None and manifest.model_dtype != loaded.dtype_name:
        raise ConfigError(
            f"the model's dtype must be the artifact's extraction dtype {manifest.model_dtype!r} "
            f"(its heads were read in that precision), got {loaded.dtype_name!r}; "
            f"{remedies.dtype.format(dtype=manifest.model_dtype)}."
        )
    rendered_with = manifest.prompt_template_sha256
    if rendered_with is not None and rendered_with != prompt_template_digest(loaded):
        raise ConfigError(
            f"the model's chat template must be the one the artifact's prompts were rendered "
            f"with (sha256 {rendered_with}), got sha256 {prompt_template_digest(loaded)}; "
            f"{remedies.template}."
        )
    values = torch.tensor(np.asarray(artifact.values, dtype=np.float64), dtype=torch.float32)
    _check_heads(loaded, artifact.heads.heads, values)
    return artifact, values


def _check_heads(
    loaded: LoadedModel, heads: tuple[tuple[int, int], ...], values: torch.Tensor
) -> None:
    shape = loaded.adapter.head_shape(loaded.model)
    for layer, head in heads:
        if layer not in shape.head_layers or head >= shape.num_heads:
            raise ConfigError(
                f"artifact heads must exist in the model's layers {list(shape.head_layers)} x "
                f"{shape.num_heads} heads, got {(layer, head)!r}."
            )
    if tuple(values.shape) != (len(heads), shape.head_dim):
        raise ConfigError(
            f"artifact values must have shape {(len(heads), shape.head_dim)}, "
            f"got {tuple(values.shape)}."
        )
    if not bool(torch.isfinite(values).all()):
        raise ConfigError("artifact values must be finite, got NaN or infinity.")

"""Loading an artifact for a site's model: verified signature, same model, ready to patch."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from client.activations.hooks import PatchPolicy
from client.inference.answers import TaskVectorPatch, check_instruction, rescale_heads
from client.inference.artifact_use import Remedies, usable_artifact
from client.models import LoadedModel
from dpmtv_common.artifact import TaskVectorArtifact, load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError

__all__ = ["artifact_model", "artifact_patch"]


def artifact_model(
    path: Path, *, loaded: LoadedModel, keys: TrustedKeys, requested: int | None = None
) -> LoadedModel:
    """``loaded`` prompted as the artifact's chunks were: under its ``max_image_crops``.

    Args:
        path: The artifact folder (verified again here: signature, integrity, model).
        loaded: The site's model, its processor as shipped.
        keys: The trusted keys.
        requested: A ``--max-image-crops`` given on the command line, which must then be
            the artifact's (queries prompted otherwise would not match the released heads).

    Raises:
        ConfigError: ``requested`` differs from the artifact's cap, or the processor cannot
            meet it.
    """
    artifact = load_artifact(path, trusted_keys=keys, expected_model_fingerprint=loaded.fingerprint)
    made_with = artifact.manifest.max_image_crops
    if requested is not None and requested != made_with:
        raise ConfigError(
            f"--max-image-crops must be the artifact's {made_with!r} (its chunks were prompted "
            f"under it), got {requested}; leave the option out to use the artifact's."
        )
    return loaded.with_image_crops(made_with)


# What a command's user changes when the artifact does not fit the model it loaded.
_COMMAND_REMEDIES = Remedies(
    dtype="pass --dtype {dtype}",
    template="use the model directory and dpmtv version (or adapter plugin) the release used",
)


def artifact_patch(
    path: Path,
    *,
    loaded: LoadedModel,
    keys: TrustedKeys,
    policy: PatchPolicy,
    instruction: str | None,
    rescale_norm: float | None = None,
    answer_end_from: Sequence[Path] = (),
) -> TaskVectorPatch:
    """Verify the artifact for this model (:func:`usable_artifact`) and the queries' instruction.

    ``instruction`` is the one the queries will be prompted with (the evaluated dataset's,
    or ``--instruction``); it must be the release's. ``rescale_norm`` sets every head's
    vector to that L2 norm (a typical norm measured on public data; post-processing, no
    privacy cost). ``answer_end_from`` names labelled PUBLIC datasets (already checked not to
    be the site's private data) to learn where a one-token answer ends
    (``client.inference.answer_end``); ``loaded`` must then be prompted as the queries are.
    """
    artifact, values = usable_artifact(path, loaded=loaded, keys=keys, remedies=_COMMAND_REMEDIES)
    check_instruction(
        artifact.manifest,
        instruction,
        remedy="prompt the queries with the release's instruction (its dataset.json "
        "'instruction'; --instruction for infer)",
    )
    if rescale_norm is not None:
        values = torch.tensor(
            rescale_heads(values.numpy(), target_norm=rescale_norm), dtype=torch.float32
        )
    answer_end = None
    if answer_end_from:
        answer_end = _answer_end(artifact, loaded, answer_end_from, instruction)
    return TaskVectorPatch(artifact.heads, values, policy, answer_end)


def _answer_end(
    artifact: TaskVectorArtifact,
    loaded: LoadedModel,
    folders: Sequence[Path],
    instruction: str | None,
) -> torch.Tensor:
    from client.data.records import load_dataset
    from client.inference.answer_end import learn_answer_end

    datasets = [load_dataset(folder) for folder in folders]
    end = learn_answer_end(
        loaded, datasets, artifact.heads, shots=artifact.manifest.shots, instruction=instruction
    )
    print(
        f"answer's end learnt from {end.chunks} public chunks of {len(datasets)} dataset(s) "
        f"({end.skipped} skipped: answers of more than one token)",
        file=sys.stderr,
    )
    return end.values

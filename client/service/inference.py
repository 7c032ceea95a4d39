"""Local inference by the site service: its loaded model, patched by an artifact it stores.

A site admin asks the running service (``dpmtv-site ask``) instead of loading the model again.
The request names a release whose verified artifact the service stored, and carries the
images as bytes: the service never opens a path it is sent, so whoever can reach the socket
(the relay included) can query the model with its own inputs and learns nothing of the site's
data. Released vectors are public post-processing: answering costs no privacy.

Whoever can reach the socket can send a request, so every bound is checked before the work
it bounds: the frame's length before it is read (:data:`MAX_REQUEST_BYTES`), the number of
images and each image's bytes when the request is parsed, and each image's pixel count from
its header (PIL reads the size without decoding a pixel) before any image is decoded, before
the model or the artifact is touched. A small file that would decode to gigabytes (a
"decompression bomb") is refused from its header alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from client.activations.hooks import PatchPolicy
from client.data.images import rgb_from_bytes
from client.inference.answers import TaskVectorPatch, check_instruction, generate_answers
from client.inference.artifact_use import Remedies, usable_artifact
from client.models import Example, Prompt
from client.release.site import Site
from client.service.request_limits import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_REQUEST_BYTES,
    InferRequest,
    check_request,
)
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from client.service.answer_ends import AnswerEnds
    from dpmtv_common.artifact import TaskVectorArtifact

__all__ = [
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_REQUEST_BYTES",
    "InferAnswers",
    "InferRequest",
    "answer_queries",
    "check_request",
]


class InferAnswers(BaseModel):
    """One answer a query, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    answers: tuple[str, ...]


def answer_queries(
    site: Site, request: InferRequest, answer_ends: AnswerEnds | None = None
) -> InferAnswers:
    """Check the request, verify the stored artifact, decode the images, answer greedily.

    The images are prompted under the artifact's ``max_image_crops`` and with the request's
    instruction, which must be the one the artifact's chunks were prompted with. With
    ``answer_ends`` (the site's public sets), a ``prompt-last-token`` request also takes the
    release's answer's end. The caller holds the model lock.

    Raises:
        ConfigError: Questions and images differ in number, no such artifact is stored, or
            the request's instruction is not the artifact's.
        DataError: An image cannot be decoded or is too large.
    """
    check_request(request)  # every bound before the model, the artifact or a pixel
    artifact, patch = _patch(site, request)
    # Queries are prompted under the crop cap the artifact's chunks were prompted under.
    loaded = site.model().with_image_crops(artifact.manifest.max_image_crops)
    if answer_ends is not None and patch.policy is PatchPolicy.PROMPT_LAST_TOKEN:
        end = answer_ends.for_release(
            artifact.manifest, artifact.heads, loaded, request.instruction
        )
        patch = dataclasses.replace(patch, answer_end=end)
    prompts = [
        Prompt.of([], Example(rgb_from_bytes(image, index), question))
        for index, (image, question) in enumerate(
            zip(request.images, request.questions, strict=True)
        )
    ]
    answers = generate_answers(
        loaded,
        prompts,
        patch=patch,
        instruction=request.instruction,
        max_new_tokens=request.max_new_tokens,
        batch_size=site.settings.batch_size,
    )
    return InferAnswers(answers=tuple(answers))


def _patch(site: Site, request: InferRequest) -> tuple[TaskVectorArtifact, TaskVectorPatch]:
    folder = site.settings.artifacts_folder / request.release_id  # a checked token
    if not folder.is_dir():
        raise ConfigError(
            f"release_id must name an artifact this site stores, got {request.release_id!r}."
        )
    artifact, values = verified_artifact(site, folder)
    check_instruction(
        artifact.manifest,
        request.instruction,
        remedy="ask with the release's instruction (--instruction)",
    )
    return artifact, TaskVectorPatch(artifact.heads, values, PatchPolicy(request.policy))


# What a site admin changes when a stored artifact does not fit the service's model.
_SERVICE_REMEDIES = Remedies(
    dtype="serve with dtype = {dtype!r} in the site's settings",
    template="serve the model directory and dpmtv version (or adapter plugin) the release used",
)


def verified_artifact(site: Site, folder: Path) -> tuple[TaskVectorArtifact, torch.Tensor]:
    """The stored artifact in ``folder`` and its values, if it may patch this service's model.

    Every check of :func:`client.inference.artifact_use.usable_artifact` against the site's
    trusted keys (the socket's ``ask`` and the HTTP endpoint both go through here).
    """
    return usable_artifact(
        folder,
        loaded=site.model(),
        keys=TrustedKeys.from_files(site.settings.trusted_keys),
        remedies=_SERVICE_REMEDIES,
    )

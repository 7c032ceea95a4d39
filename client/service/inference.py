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

import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from client.data import to_rgb
from client.hooks import PatchPolicy
from client.inference import TaskVectorPatch, check_instruction, generate_answers
from client.models import Example, Prompt, prompt_template_digest
from client.site import Site
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError, DataError
from protocol.plan import ReleaseId

if TYPE_CHECKING:
    import torch

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

MAX_IMAGES = 8
"""Images (and questions) one request may carry."""
MAX_IMAGE_BYTES = 4 << 20
"""Encoded bytes of one image."""
MAX_IMAGE_PIXELS = 2048 * 2048
"""Pixels of one image, read from its header (at most ~16 MiB once decoded to RGBA)."""
_MAX_QUESTION_CHARS = 2000
_MAX_INSTRUCTION_CHARS = 8000  # well inside the frame's room for text, beside 8 questions
MAX_REQUEST_BYTES = (4 * MAX_IMAGES * MAX_IMAGE_BYTES) // 3 + (1 << 20)
"""The largest request frame: the images in base64 and room for the questions (JSON)."""


class InferRequest(BaseModel):
    """Queries for the model patched with the stored artifact of ``release_id``.

    ``instruction`` is put before each query, as the release's data put it before its prompts;
    it must be the release's (None: no instruction).
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    release_id: ReleaseId
    questions: Annotated[
        tuple[Annotated[str, Field(min_length=1, max_length=_MAX_QUESTION_CHARS)], ...],
        Field(min_length=1, max_length=MAX_IMAGES),
    ]
    images: Annotated[
        tuple[Annotated[bytes, Field(max_length=MAX_IMAGE_BYTES)], ...],
        Field(min_length=1, max_length=MAX_IMAGES),
    ]
    instruction: Annotated[str, Field(max_length=_MAX_INSTRUCTION_CHARS)] | None = None
    max_new_tokens: Annotated[int, Field(ge=1, le=64)] = 10
    policy: Literal["prompt-last-token", "every-call"] = "prompt-last-token"


class InferAnswers(BaseModel):
    """One answer a query, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    answers: tuple[str, ...]


def check_request(request: InferRequest) -> None:
    """Refuse a request whose images do not pair with its questions or are too large.

    Reads each image's header only: no pixel is decoded here. The messages name the image's
    index and the bound, never a path, so they may be returned to whoever asked.

    Raises:
        ConfigError: Questions and images differ in number.
        DataError: An image's header cannot be read, or it has more than
            :data:`MAX_IMAGE_PIXELS` pixels.
    """
    if len(request.questions) != len(request.images):
        raise ConfigError(
            f"questions and images must pair up, got {len(request.questions)} and "
            f"{len(request.images)}."
        )
    for index, data in enumerate(request.images):
        width, height = _header_size(data, index)
        if width * height > MAX_IMAGE_PIXELS:
            raise DataError(
                f"image {index} must have at most {MAX_IMAGE_PIXELS} pixels, got {width}x{height}."
            )


def answer_queries(site: Site, request: InferRequest) -> InferAnswers:
    """Check the request, verify the stored artifact, decode the images, answer greedily.

    The images are prompted under the artifact's ``max_image_crops`` and with the request's
    instruction, which must be the one the artifact's chunks were prompted with.

    Raises:
        ConfigError: Questions and images differ in number, no such artifact is stored, or
            the request's instruction is not the artifact's.
        DataError: An image cannot be decoded or is too large.
    """
    check_request(request)  # every bound before the model, the artifact or a pixel
    patch, max_image_crops = _patch(site, request)
    # Queries are prompted under the crop cap the artifact's chunks were prompted under.
    loaded = site.model().with_image_crops(max_image_crops)
    prompts = [
        Prompt.of([], Example(_decode(image, index), question))
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


def _patch(site: Site, request: InferRequest) -> tuple[TaskVectorPatch, int | None]:
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
    patch = TaskVectorPatch(artifact.heads, values, PatchPolicy(request.policy))
    return patch, artifact.manifest.max_image_crops


def verified_artifact(site: Site, folder: Path) -> tuple[TaskVectorArtifact, torch.Tensor]:
    """The stored artifact in ``folder``, checked for this service's model, and its values.

    Checks the signature against the site's trusted keys, the model fingerprint, the dtype the
    vector was made in and the chat template its prompts were rendered with (the socket's
    ``ask`` and the HTTP endpoint both go through here).
    """
    import numpy as np
    import torch

    loaded = site.model()
    artifact = load_artifact(
        folder,
        trusted_keys=TrustedKeys.from_files(site.settings.trusted_keys),
        expected_model_fingerprint=loaded.fingerprint,
    )
    made_in = artifact.manifest.model_dtype
    if made_in is not None and made_in != loaded.dtype_name:
        raise ConfigError(
            f"the service's model dtype must be the artifact's {made_in!r}, "
            f"got {loaded.dtype_name!r}."
        )
    rendered_with = artifact.manifest.prompt_template_sha256
    if rendered_with is not None and rendered_with != prompt_template_digest(loaded):
        raise ConfigError(
            f"the service's chat template must be the artifact's (sha256 {rendered_with}), "
            f"got sha256 {prompt_template_digest(loaded)}: its chunks were prompted otherwise."
        )
    return artifact, torch.tensor(np.asarray(artifact.values), dtype=torch.float32)


def _header_size(data: bytes, index: int) -> tuple[int, int]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # lazy: reads the header only
                width, height = image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"image {index} must have at most {MAX_IMAGE_PIXELS} pixels.") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise DataError(f"image {index} must be a readable picture: {exc}") from exc
    return width, height


def _decode(data: bytes, index: int) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                image.load()  # every pixel now: a truncated file fails here, not mid-answer
                return to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(
            f"image {index} must have at most {Image.MAX_IMAGE_PIXELS} pixels."
        ) from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise DataError(f"image {index} must be a readable picture: {exc}") from exc

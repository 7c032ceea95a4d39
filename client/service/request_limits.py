"""What one query request may carry: its bounds, checked before any pixel is decoded.

Light on purpose (pydantic and PIL's header reader, no model): the service's socket and the
HTTP front process both check requests with it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from client.data.images import size_from_bytes
from dpmtv_common.errors import ConfigError
from protocol.plan import ReleaseId

__all__ = [
    "DEFAULT_REQUEST_MEMORY",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_INSTRUCTION_CHARS",
    "MAX_QUESTION_CHARS",
    "MAX_REQUEST_BYTES",
    "InferRequest",
    "check_request",
]

MAX_IMAGES = 8
"""Images (and questions) one request may carry."""
MAX_IMAGE_BYTES = 4 << 20
"""Encoded bytes of one image."""
MAX_IMAGE_PIXELS = 2048 * 2048
"""Pixels of one image, read from its header (at most ~16 MiB once decoded to RGBA)."""
MAX_QUESTION_CHARS = 2000
"""Characters of one question (and of one answer of a demonstration)."""
MAX_INSTRUCTION_CHARS = 8000
"""Characters of the instruction (well inside a frame's room for text, beside 8 questions)."""
MAX_REQUEST_BYTES = (4 * MAX_IMAGES * MAX_IMAGE_BYTES) // 3 + (1 << 20)
"""The largest request frame: the images in base64 and room for the questions (JSON)."""
DEFAULT_REQUEST_MEMORY = 1 << 30
"""Bytes of request bodies and decoded images the HTTP endpoint holds at once, by default."""


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
        tuple[Annotated[str, Field(min_length=1, max_length=MAX_QUESTION_CHARS)], ...],
        Field(min_length=1, max_length=MAX_IMAGES),
    ]
    images: Annotated[
        tuple[Annotated[bytes, Field(max_length=MAX_IMAGE_BYTES)], ...],
        Field(min_length=1, max_length=MAX_IMAGES),
    ]
    instruction: Annotated[str, Field(max_length=MAX_INSTRUCTION_CHARS)] | None = None
    max_new_tokens: Annotated[int, Field(ge=1, le=64)] = 10
    policy: Literal["prompt-last-token", "every-call"] = "prompt-last-token"


def check_request(request: InferRequest) -> list[tuple[int, int]]:
    """Refuse a request whose images do not pair with its questions or are too large.

    Reads each image's header only: no pixel is decoded here. The messages name the image's
    index and the bound, never a path, so they may be returned to whoever asked.

    Returns:
        Each image's width and height, as its header gives them.

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
    return [
        size_from_bytes(data, index, max_pixels=MAX_IMAGE_PIXELS)
        for index, data in enumerate(request.images)
    ]

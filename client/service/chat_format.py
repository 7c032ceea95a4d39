"""The OpenAI chat-completions request, as the site's model can answer it.

The model answers one image-question query, optionally after answered demonstrations. So a
request maps onto a :class:`~client.models.Prompt` as follows: ``system`` messages (first
only, text only) become the instruction; each ``user`` message carries exactly one image
(an ``image_url`` holding a ``data:`` URI: the service never fetches a URL) and its question
as text; a ``user`` message followed by an ``assistant`` message is a demonstration with its
answer; the last message is the ``user`` query. Everything else is refused with a message
saying what was given.

Every bound of ``dpmtv-site ask`` applies, checked before any pixel is decoded
(:func:`client.service.inference.check_request`): images a request, bytes an image, pixels
an image (read from the header), characters a question.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.data.images import rgb_from_bytes
from client.service.request_limits import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_INSTRUCTION_CHARS,
    MAX_QUESTION_CHARS,
    InferRequest,
    check_request,
)
from dpmtv_common.errors import ConfigError, DataError

if TYPE_CHECKING:
    from PIL import Image

    from client.models import Prompt

__all__ = [
    "MAX_COMPLETION_TOKENS",
    "ChatFrame",
    "ChatRequest",
    "ParsedChat",
    "chat_frame",
    "chat_request_from_json",
    "decode_images",
    "parse_chat",
    "prompt_from_chat",
    "prompt_of",
]

MAX_COMPLETION_TOKENS = 512
"""Most tokens one answer may ask for (``max_tokens``)."""
_MAX_MESSAGES = 17  # 8 images: 7 demonstrations with answers, the query, one system message
_DATA_URI = re.compile(r"data:(image/[A-Za-z0-9.+-]+);base64,(.*)", re.DOTALL)


class ImageUrl(BaseModel):
    """``{"url": "data:image/png;base64,..."}``."""

    model_config = ConfigDict(extra="forbid")

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    """A text part of a message."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    """An image part of a message."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: ImageUrl


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]
    name: str | None = None


class StreamOptions(BaseModel):
    """``stream_options``: whether the last chunk reports token usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class ChatRequest(BaseModel):
    """The fields of a chat-completions request this endpoint honours (others are refused).

    ``temperature`` absent or 0 means greedy decoding (as ``dpmtv-site ask`` answers);
    ``n`` must be 1; ``top_p`` 1; penalties 0: settings the service does not apply are
    refused rather than silently ignored.
    """

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=_MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_COMPLETION_TOKENS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_COMPLETION_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    top_p: Literal[1] | None = None
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    user: Annotated[str, Field(max_length=200)] | None = None
    policy: Literal["prompt-last-token", "every-call"] = "prompt-last-token"

    @property
    def answer_tokens(self) -> int:
        """Most tokens to generate (16 when the request sets no limit)."""
        return self.max_completion_tokens or self.max_tokens or 16


class ParsedChat(BaseModel):
    """A request reduced to what the model sees, checked but not yet decoded."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    instruction: str | None
    questions: tuple[str, ...]
    images: tuple[bytes, ...]
    sizes: tuple[tuple[int, int], ...]  # each image's width and height, from its header
    answers: tuple[str, ...]  # one per demonstration: len(questions) - 1

    def decoded_bytes(self) -> int:
        """Bytes its images take once decoded to 8-bit RGB (from the headers: none decoded)."""
        return sum(3 * width * height for width, height in self.sizes)


_Text = Annotated[str, Field(max_length=MAX_QUESTION_CHARS)]


class ChatFrame(BaseModel):
    """A checked, decoded request as the HTTP front sends it to the site service.

    The front builds it (a request beyond a bound is answered 400 there); the service checks
    it again when it arrives, so a front that misbehaved cannot ask more of the model than a
    request may (more tokens, images or text, pixels that do not fit their sizes).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["chat"] = "chat"
    id: int = 0
    model: Annotated[str, Field(min_length=1, max_length=200)]
    policy: Literal["prompt-last-token", "every-call"]
    instruction: Annotated[str, Field(max_length=MAX_INSTRUCTION_CHARS)] | None
    questions: Annotated[tuple[_Text, ...], Field(min_length=1, max_length=MAX_IMAGES)]
    answers: Annotated[tuple[_Text, ...], Field(max_length=MAX_IMAGES - 1)]
    sizes: Annotated[
        tuple[tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]], ...],
        Field(min_length=1, max_length=MAX_IMAGES),
    ]
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_COMPLETION_TOKENS)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)]
    seed: int | None
    stream: bool

    def check_pixels(self, blobs: Sequence[bytes]) -> None:
        """Each image's RGB bytes must fit its size, within the pixel bound.

        Raises:
            ConfigError: They do not pair up, or an image is larger than the bound.
        """
        lengths = [len(blob) for blob in blobs]
        wanted = [3 * w * h for w, h in self.sizes]
        too_large = [f"{w}x{h}" for w, h in self.sizes if w * h > MAX_IMAGE_PIXELS]
        if lengths != wanted or too_large or len(self.questions) != len(self.sizes):
            raise ConfigError(
                f"a chat frame's images must be RGB of their sizes, at most {MAX_IMAGE_PIXELS} "
                f"pixels, one a question: got {lengths} bytes for sizes {list(self.sizes)} and "
                f"{len(self.questions)} questions."
            )


def chat_frame(chat: ChatRequest, parsed: ParsedChat, images: Sequence[Image.Image]) -> ChatFrame:
    """The frame of a parsed request and its decoded images.

    Raises:
        ConfigError: The request's instruction or answers are longer than a request may carry.
    """
    try:
        return ChatFrame(
            model=chat.model, policy=chat.policy, instruction=parsed.instruction,
            questions=parsed.questions, answers=parsed.answers,
            sizes=tuple(image.size for image in images), max_new_tokens=chat.answer_tokens,
            temperature=chat.temperature or 0.0, seed=chat.seed, stream=chat.stream,
        )  # fmt: skip
    except ValidationError as exc:
        raise ConfigError(f"request must stay within the inference limits: {_brief(exc)}") from exc


def chat_request_from_json(body: bytes) -> ChatRequest:
    """Parse a request body.

    Raises:
        ConfigError: The body is not a chat-completions request this endpoint honours.
    """
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ConfigError(f"request must be a chat-completions request: {_brief(exc)}") from exc


def parse_chat(request: ChatRequest) -> ParsedChat:
    """Map the conversation onto instruction, demonstrations and query; check every bound.

    Raises:
        ConfigError: The conversation does not have the shape the module docstring says.
        DataError: An image is not a data URI, not base64, unreadable or too large.
    """
    messages = list(request.messages)
    system: list[str] = []
    while messages and messages[0].role in ("system", "developer"):
        system.append(_text_only(messages.pop(0), "a system message"))
    if not messages or messages[-1].role != "user":
        raise ConfigError(
            "messages must end with a user message (the query), got "
            f"{messages[-1].role if messages else 'only system messages'!r}."
        )
    questions: list[str] = []
    images: list[bytes] = []
    answers: list[str] = []
    for index, message in enumerate(messages):
        expected = "user" if index % 2 == 0 else "assistant"
        if message.role != expected:
            raise ConfigError(
                f"messages[{index + len(system)}].role must be {expected!r} (user and assistant "
                f"alternate after the system messages), got {message.role!r}."
            )
        if expected == "assistant":
            answers.append(_text_only(message, "an assistant message"))
            continue
        question, image = _user_turn(message, index + len(system))
        questions.append(question)
        images.append(image)
    sizes = _check_bounds(questions, images)
    instruction = "\n".join(system) if system else None
    return ParsedChat(
        instruction=instruction,
        questions=tuple(questions),
        images=tuple(images),
        sizes=tuple(sizes),
        answers=tuple(answers),
    )


def prompt_from_chat(parsed: ParsedChat) -> Prompt:
    """Decode the images (every pixel) and build the prompt.

    Raises:
        DataError: An image cannot be decoded.
    """
    return prompt_of(decode_images(parsed), parsed.questions, parsed.answers)


def decode_images(parsed: ParsedChat) -> list[Image.Image]:
    """Every image of the request, decoded to RGB as a site's files are.

    Raises:
        DataError: An image cannot be decoded (the message names its index).
    """
    return [rgb_from_bytes(data, index) for index, data in enumerate(parsed.images)]


def prompt_of(
    images: Sequence[Image.Image], questions: Sequence[str], answers: Sequence[str]
) -> Prompt:
    """The prompt of decoded images and their questions: answered turns, then the query.

    Raises:
        ConfigError: The images, questions and answers do not pair up (one answer a
            demonstration: one fewer than the questions).
    """
    from client.models import Example, Prompt  # the model's side only: it imports torch

    if len(images) != len(questions) or len(answers) != len(questions) - 1 or not questions:
        raise ConfigError(
            f"a prompt must pair each image with a question and answer all but the last, got "
            f"{len(images)} images, {len(questions)} questions and {len(answers)} answers."
        )
    examples = [Example(image, question) for image, question in zip(images, questions, strict=True)]
    demonstrations = [
        Example(example.image, example.question, answer)
        for example, answer in zip(examples[:-1], answers, strict=True)
    ]
    return Prompt.of(demonstrations, examples[-1])


def _text_only(message: ChatMessage, what: str) -> str:
    if isinstance(message.content, str):
        return message.content
    if any(not isinstance(part, TextPart) for part in message.content):
        raise ConfigError(f"{what} must hold text only, got an image.")
    return "\n".join(part.text for part in message.content if isinstance(part, TextPart))


def _user_turn(message: ChatMessage, index: int) -> tuple[str, bytes]:
    parts = (
        [TextPart(type="text", text=message.content)]
        if isinstance(message.content, str)
        else message.content
    )
    texts = [part.text for part in parts if isinstance(part, TextPart)]
    urls = [part.image_url.url for part in parts if isinstance(part, ImagePart)]
    if len(urls) != 1:
        raise ConfigError(
            f"messages[{index}] must carry exactly one image_url (the model answers about one "
            f"image a turn), got {len(urls)}."
        )
    return "\n".join(texts).strip(), _image_bytes(urls[0], index)


def _image_bytes(url: str, index: int) -> bytes:
    match = _DATA_URI.fullmatch(url.strip())
    if match is None:
        scheme = url.split(":", 1)[0][:20] if ":" in url else url[:20]
        raise DataError(
            f"messages[{index}] image_url must be a base64 data URI "
            f"(data:image/png;base64,...): the service fetches no URL, got {scheme!r}..."
        )
    try:
        return base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DataError(f"messages[{index}] image_url must hold valid base64: {exc}") from exc


def _check_bounds(questions: list[str], images: list[bytes]) -> list[tuple[int, int]]:
    """The bounds of ``dpmtv-site ask``, headers included (no pixel decoded); the sizes."""
    try:
        request = InferRequest(release_id="http", questions=tuple(questions), images=tuple(images))
    except ValidationError as exc:
        raise ConfigError(f"request must stay within the inference limits: {_brief(exc)}") from exc
    return check_request(request)  # its messages name no memory address


def _brief(exc: ValidationError) -> str:
    """Each error's location and message, without echoing the (possibly huge) input."""
    items = [
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()[:5]
    ]
    return "; ".join(items)

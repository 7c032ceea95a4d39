"""K-shot multimodal prompts as data, and their chat-message form.

This module is pure: it turns demonstrations and a query into the ``messages`` list that
chat templates read (``{"role": ..., "content": [{"type": "image" | "text", ...}]}``).
Rendering and tokenising belong to the model's processor (see ``client.models.adapters``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from PIL import Image

from dpmtv_common.errors import ConfigError

__all__ = ["Example", "Message", "Prompt", "instruction_digest", "prompt_to_messages"]

Message: TypeAlias = dict[str, Any]
"""One chat turn: ``{"role": "user" | "assistant", "content": [content parts]}``."""


@dataclass(frozen=True)
class Example:
    """One image-question-answer triple.

    Attributes:
        image: The image the question is about (any PIL mode; processors convert it).
        question: The question text, without any answer cue.
        answer: The gold answer. Required for demonstrations; for a query it is kept for
            scoring and never shown to the model.
    """

    image: Image.Image
    question: str
    answer: str | None = None


@dataclass(frozen=True)
class Prompt:
    """A K-shot prompt: K answered demonstrations, then one query whose answer is withheld."""

    demonstrations: tuple[Example, ...]
    query: Example

    def __post_init__(self) -> None:
        for index, example in enumerate(self.demonstrations):
            if example.answer is None:
                raise ConfigError(
                    f"demonstrations[{index}].answer must be a string, got None; "
                    "only the query may come without an answer."
                )

    @classmethod
    def of(cls, demonstrations: Sequence[Example], query: Example) -> Prompt:
        """Build a prompt from any sequence of demonstrations."""
        return cls(tuple(demonstrations), query)

    @property
    def images(self) -> list[Image.Image]:
        """The images in prompt order: each demonstration's, then the query's."""
        return [example.image for example in (*self.demonstrations, self.query)]


def instruction_digest(instruction: str | None) -> str:
    """Return the SHA-256 hex of the instruction text prompts are built with.

    ``None`` and ``""`` share one digest, that of the empty string: :func:`prompt_to_messages`
    adds nothing for either, so they build the same prompts. Any other text is hashed exactly
    (UTF-8, whitespace included), since every character of it enters the prompt. Sites report
    the digest at plan time and the manifest records it, like the chat template's.
    """
    return hashlib.sha256((instruction or "").encode("utf-8")).hexdigest()


def _user_turn(example: Example, prefix: str | None) -> Message:
    content: list[dict[str, Any]] = []
    if prefix:
        content.append({"type": "text", "text": prefix})
    content.append({"type": "image", "image": example.image})
    content.append({"type": "text", "text": example.question})
    return {"role": "user", "content": content}


def prompt_to_messages(prompt: Prompt, *, instruction: str | None = None) -> list[Message]:
    """Interleave a prompt as chat turns, ending on the query's user turn.

    Each demonstration becomes a user turn (image, then question) and an assistant turn
    (its answer); the query becomes a last user turn. The caller asks the template for the
    generation prompt, so the final prompt token is the one MTV reads activations at.

    Args:
        prompt: The demonstrations and the query.
        instruction: Task instruction, put as text before the first image, as MTV's VizWiz
            prompt does. ``None`` or ``""`` adds nothing.

    Returns:
        ``2 * K + 1`` messages, each with a list of content parts.
    """
    messages: list[Message] = []
    for index, example in enumerate((*prompt.demonstrations, prompt.query)):
        messages.append(_user_turn(example, instruction if index == 0 else None))
        if index < len(prompt.demonstrations):
            answer = {"type": "text", "text": example.answer}
            messages.append({"role": "assistant", "content": [answer]})
    return messages

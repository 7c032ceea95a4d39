"""The instruction digest tells prompts apart exactly as the prompt builder does."""

from __future__ import annotations

import hashlib

import pytest
from PIL import Image

from client.models import Example, Prompt, instruction_digest, prompt_to_messages

EMPTY = hashlib.sha256(b"").hexdigest()


@pytest.fixture(scope="module")
def prompt() -> Prompt:
    image = Image.new("RGB", (8, 8), "red")
    return Prompt.of([Example(image, "Colour?", "red")], Example(image, "Colour?"))


def test_no_instruction_and_an_empty_one_share_a_digest_as_they_build_one_prompt(prompt):
    assert prompt_to_messages(prompt, instruction=None) == prompt_to_messages(
        prompt, instruction=""
    )
    assert instruction_digest(None) == instruction_digest("") == EMPTY


@pytest.mark.parametrize("text", ["Answer with one word.", " ", "Answer with one word. ", "é"])
def test_any_other_text_is_hashed_exactly_as_it_enters_the_prompt(prompt, text):
    # Every character, whitespace included, enters the prompt, so it enters the digest.
    assert prompt_to_messages(prompt, instruction=text)[0]["content"][0]["text"] == text
    assert instruction_digest(text) == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert instruction_digest(text) != EMPTY

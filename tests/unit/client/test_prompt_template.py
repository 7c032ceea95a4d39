"""The prompt template digest is the digest of the template the prompts are rendered with."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import Any

import pytest

from client.models import LoadedModel, build_tiny_model, get_adapter, prompt_template_digest
from dpmtv_common.errors import ModelError

OTHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tiny_llava() -> LoadedModel:
    model, processor = build_tiny_model("llava", seed=0)
    return LoadedModel(model, processor, get_adapter("llava"), "sha256:test-llava")


def with_template(loaded: LoadedModel, template: Any) -> LoadedModel:
    """``loaded`` with a processor copy whose chat template is ``template``."""
    processor = copy.copy(loaded.processor)
    processor.chat_template = template
    return dataclasses.replace(loaded, processor=processor)


def rendered_template(loaded: LoadedModel, prompt, monkeypatch: pytest.MonkeyPatch) -> str:
    """The ``chat_template`` the tokenizer is asked to render ``prompt`` with."""
    tokenizer = loaded.processor.tokenizer
    render = tokenizer.apply_chat_template
    seen: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["chat_template"])
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    loaded.adapter.build_batch_inputs(loaded.processor, [prompt])
    monkeypatch.undo()
    (template,) = seen
    return template


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.mark.parametrize(
    "source",
    ["processor", "adapter fallback", "plugin adapter", "named default"],
)
def test_the_digest_is_the_digest_of_the_template_rendered(tiny_llava, prompt, monkeypatch, source):
    # Arrange: each way a template reaches the prompt
    loaded = {
        "processor": with_template(tiny_llava, OTHER_TEMPLATE),
        "adapter fallback": with_template(tiny_llava, None),
        "plugin adapter": dataclasses.replace(
            with_template(tiny_llava, None),
            adapter=dataclasses.replace(tiny_llava.adapter, chat_template=OTHER_TEMPLATE),
        ),
        "named default": with_template(tiny_llava, {"default": OTHER_TEMPLATE, "tools": "x"}),
    }[source]

    # Act
    rendered = rendered_template(loaded, prompt, monkeypatch)

    # Assert
    assert prompt_template_digest(loaded) == sha256(rendered)


def test_two_templates_give_two_digests_whichever_side_supplies_them(tiny_llava):
    # Arrange: the default adapter's template, and another from the processor or a plugin
    builtin = with_template(tiny_llava, None)
    from_processor = with_template(tiny_llava, OTHER_TEMPLATE)
    from_plugin = dataclasses.replace(
        builtin, adapter=dataclasses.replace(tiny_llava.adapter, chat_template=OTHER_TEMPLATE)
    )

    # Act
    digests = [prompt_template_digest(m) for m in (builtin, from_processor, from_plugin)]

    # Assert
    assert digests[0] == sha256(tiny_llava.adapter.chat_template)
    assert digests[0] != digests[1]
    assert digests[1] == digests[2]  # one text, one digest: where it came from does not matter
    assert all(len(d) == 64 and d == d.lower() for d in digests)


def test_a_processor_template_hides_the_adapters(tiny_llava):
    # Arrange: two adapters that differ only in their built-in template
    other_adapter = dataclasses.replace(tiny_llava.adapter, chat_template=OTHER_TEMPLATE)

    # Act / Assert: the processor ships one, so the built-in ones never render
    assert prompt_template_digest(tiny_llava) == prompt_template_digest(
        dataclasses.replace(tiny_llava, adapter=other_adapter)
    )


def test_named_templates_without_a_default_are_refused(tiny_llava):
    loaded = with_template(tiny_llava, {"tools": OTHER_TEMPLATE})

    with pytest.raises(ModelError, match=r"must include 'default', got \['tools'\]"):
        prompt_template_digest(loaded)

"""Each architecture family's documented chat format, as Jinja templates over content lists.

A template here is used only when a processor ships no chat template of its own (a real
checkpoint's always wins). Each renders ``messages`` whose ``content`` is a list of
``{"type": "image"}`` and ``{"type": "text", "text": ...}`` parts, with the image placeholder
the family's processor expands into image tokens.
"""

from __future__ import annotations

__all__ = [
    "GEMMA3",
    "IDEFICS2",
    "IDEFICS3",
    "INTERNVL",
    "LFM2_VL",
    "LLAVA",
    "LLAVA_ONEVISION",
    "MISTRAL3",
    "MLLAMA",
    "PALIGEMMA",
    "QWEN_VL",
    "SMOLVLM",
]


def _chatml(image: str, system: bool) -> str:
    """ChatML turns (Qwen, InternVL, LLaVA-OneVision) with ``image`` as the placeholder."""
    preamble = (
        "{% if loop.first and m['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        if system
        else ""
    )
    return (
        "{% for m in messages %}" + preamble + "<|im_start|>{{ m['role'] }}\n"
        "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image + "{% else %}"
        "{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


LLAVA = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
QWEN_VL = _chatml("<|vision_start|><|image_pad|><|vision_end|>", system=True)
LLAVA_ONEVISION = _chatml("<image>\n", system=False)
INTERNVL = _chatml("<IMG_CONTEXT>\n", system=False)
LFM2_VL = "{{ bos_token }}" + _chatml("<image>", system=False)

_IDEFICS_TURNS = (
    "{% for m in messages %}{{ m['role'] | capitalize }}"
    "{% if m['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
IDEFICS2 = _IDEFICS_TURNS
IDEFICS3 = "{{ bos_token }}" + _IDEFICS_TURNS
SMOLVLM = "<|im_start|>" + _IDEFICS_TURNS

# Gemma 3 calls the assistant "model"; the processor expands <start_of_image>.
GEMMA3 = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% else %}"
    "{{ c['text'] }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MLLAMA = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{% for c in m['content'] %}{% if c['type'] == 'image' %}<|image|>{% else %}"
    "{{ c['text'] }}{% endif %}{% endfor %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Mistral 3 (Pixtral vision): [INST] turns; the processor expands [IMG] into rows of image tokens.
MISTRAL3 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}[IMG]{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}[/INST]{% else %}{% for c in m['content'] %}{{ c['text'] }}"
    "{% endfor %}{{ eos_token }}{% endif %}{% endfor %}"
)
# PaliGemma has no chat format: a prefix of text, images in place; its processor adds the BOS
# after the last image and a newline at the end.
PALIGEMMA = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
    "{% else %}{{ c['text'] }}\n{% endif %}{% endfor %}{% endfor %}"
)

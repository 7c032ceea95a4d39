"""The wrapper of every tokenizer dpmtv builds itself (tiny random models, embedded models).

Each of them has the same four special tokens (``<pad>``, ``<s>``, ``</s>``, ``<unk>``) and
its own extra ones (``<image>`` and what an architecture's processor looks up by name).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

__all__ = ["wrap_tokenizer"]


def wrap_tokenizer(backend: Tokenizer, extra: dict[str, str]) -> PreTrainedTokenizerFast:
    """``backend`` as a transformers tokenizer with the shared specials and ``extra`` ones."""
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token="<s>",  # noqa: S106 (tokens, not secrets; likewise below)
        eos_token="</s>",  # noqa: S106
        pad_token="<pad>",  # noqa: S106
        unk_token="<unk>",  # noqa: S106
        extra_special_tokens=extra,
    )

"""A prompt's processor inputs, stacked with other prompts' into one batch.

Per-token inputs (shape ``(1, seq)``, like ``input_ids`` and ``attention_mask``) are
left-padded to a common length, so every prompt's last token sits in the last column; every
other input (pixel values, image sizes) is concatenated as it is. Masked positions
(``attention_mask`` 0) get exactly zero attention weight, so the pad id only has to be a
valid token. Used by the release path's fixed-shape passes and by the service's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["left_padded_stack", "token_keys"]

_Inputs = dict[str, torch.Tensor]


def token_keys(inputs: _Inputs) -> list[str]:
    """The per-token inputs (``(batch, seq)``, like ``input_ids``; a prompt alone: batch 1)."""
    shape = inputs["input_ids"].shape
    return [k for k, v in inputs.items() if v.ndim == 2 and v.shape == shape]


def left_padded_stack(rows: Sequence[_Inputs], length: int, pad_id: int) -> _Inputs:
    """Left-pad each row's per-token inputs to ``length``; concatenate every input."""
    tokens = set(token_keys(rows[0]))
    out: _Inputs = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if key in tokens:
            fill = pad_id if key == "input_ids" else 0
            values = [
                torch.cat([torch.full((1, length - v.shape[1]), fill, dtype=v.dtype), v], dim=1)
                for v in values
            ]
        out[key] = torch.cat(values, dim=0)
    return out

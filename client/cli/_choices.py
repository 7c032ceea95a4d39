"""The fixed choices of ``dpmtv-site`` options, as plain strings.

The enums they name live in modules that import torch (or, for ``protocol``, Flower); listing
their values here lets the parser (and ``--help``, ``keygen``, ``ledger``) start without them.
A test keeps each tuple equal to its enum, so they cannot drift apart.
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_CHOICES",
    "DEFAULT_SELECTION_SHARE",
    "DTYPES",
    "MIN_MODEL_GAIN",
    "EVALUATION_MODES",
    "PATCH_POLICIES",
    "ORDER_HELP",
    "RELEASE_ORDERS",
    "SCORE_METHODS",
    "SELECTION_METHODS",
    "SELECTION_MODES",
]

PATCH_POLICIES = ("prompt-last-token", "every-call")
"""``client.activations.hooks.PatchPolicy``."""
EVALUATION_MODES = ("zero-shot", "icl", "artifact")
"""``client.evaluation.EvaluationMode``."""
SELECTION_METHODS = ("attribution", "reinforce")
"""``client.public.selection.SelectionMethod``."""
SCORE_METHODS = ("shift", "attribution")
"""``client.activations.scoring.ScoreMethod``."""
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes ``client.models.resolve_dtype`` accepts."""
SELECTION_MODES = ("public", "private", "all")
"""``protocol.SelectionMode``."""
RELEASE_ORDERS = ("select-first", "release-first")
"""``protocol.ReleaseOrder``."""
ORDER_HELP = (
    "release-first or select-first (default: the order a heads file from select-heads was "
    "chosen for; else release-first for private selection, which wins on large pools only "
    "(docs/benchmarks.md: select-heads --public-task compares both on public data), and "
    "select-first for public or all heads, which release-first would only noise over every "
    "layer)"
)
ATTENTION_CHOICES = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
"""``client.models.ATTENTION_IMPLEMENTATIONS``."""

DEFAULT_SELECTION_SHARE = 0.3  # share of epsilon private selection spends unless told

MIN_MODEL_GAIN = 0.2
"""Below this gain of a public task's own plain mean over zero-shot, the model cannot do it."""

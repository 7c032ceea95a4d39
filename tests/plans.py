"""One release plan for tests that need a valid plan and care about a field or two of it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from protocol import PROTOCOL_VERSION, ReleaseOrder, ReleasePlan, SelectionMode


def make_plan(**overrides: Any) -> ReleasePlan:
    """A select-first plan over every head (colour task, two shots), with ``overrides`` set."""
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "release_id": "r1",
        "task": "colour",
        "model_fingerprint": "sha256:" + "0" * 64,
        "epsilon": 1.0,
        "delta": 1e-5,
        "shots": 2,
        "clip_norm": 1.0,
        "selection": SelectionMode.ALL,
        "order": ReleaseOrder.SELECT_FIRST,
        "num_selected_heads": 2,
        "public_heads": None,
        "selection_share": 0.3,
        "score_top_r": 2,
        "min_sites": 2,
        "max_chunks_per_site": 100,
        "created": datetime.now(UTC).isoformat(),
    }
    fields.update(overrides)
    return ReleasePlan(**fields)

"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


@st.composite
def layered_activations(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """An (n_heads, d_head) float array and the layer of each row."""
    num_heads = draw(st.integers(1, 12))
    d_head = draw(st.integers(1, 8))
    layers = np.array(
        sorted(draw(st.lists(st.integers(0, 5), min_size=num_heads, max_size=num_heads)))
    )
    values = draw(
        hnp.arrays(
            np.float64,
            (num_heads, d_head),
            elements=st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
        )
    )
    return values, layers


clip_norms = st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def unit_replacements(draw: st.DrawFn) -> dict[str, object]:
    """A dataset's shape and one unit replacement, for the chunking property tests.

    Returns a dict with ``privacy_unit`` (``"example"`` or ``"group"``), ``sizes`` (records
    per unit: all 1 at example level), ``shots``, ``max_chunks`` (None or >= 1), ``seed``
    (256 bits), ``replaced`` (the index of the unit replaced), ``new_size`` (records of the
    replacing unit: 1 at example level) and ``insert_at`` (where in file order the new records
    go, as a fraction of the file).
    """
    unit = draw(st.sampled_from(["example", "group"]))
    shots = draw(st.integers(1, 6))
    if unit == "example":
        sizes = [1] * draw(st.integers(shots + 1, 60))
        new_size = 1
    else:
        sizes = draw(st.lists(st.integers(1, 10), min_size=1, max_size=20))
        new_size = draw(st.integers(1, 10))
    return {
        "privacy_unit": unit,
        "sizes": sizes,
        "shots": shots,
        "max_chunks": draw(st.none() | st.integers(1, 12)),
        "seed": draw(st.integers(0, 2**256 - 1)),
        "replaced": draw(st.integers(0, len(sizes) - 1)),
        "new_size": new_size,
        "insert_at": draw(st.floats(0, 1)),
    }

"""The headline report tells a DP row's variant from its field, and from its label in older runs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def report() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("_report_headline")


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"label": "10 sites, central, public heads", "variant": "chosen"}, "chosen"),
        # A label that reads like a side row does not decide once the field says otherwise.
        ({"label": "10 sites, no centre (other mode)", "variant": "chosen"}, "chosen"),
        ({"label": "10 sites, central", "variant": "sweep"}, "sweep"),
        ({"label": "10 sites, C' = 2 x scale (sweep)"}, "sweep"),
        ({"label": "10 sites, no centre, public heads"}, "no centre"),
        ({"label": "10 sites, private heads (the other mode)"}, "other heads mode"),
        ({"label": "10 sites, central, public heads"}, "chosen"),
    ],
)
def test_a_row_s_variant(report: Any, row: dict[str, str], expected: str) -> None:
    assert report._variant(row) == expected

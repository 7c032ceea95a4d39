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


@pytest.mark.parametrize(
    ("row", "option", "tag"),
    [
        ({"label": "x", "selection": "public", "order": "select-first"}, ("public", "select-first"),
         "public"),
        ({"label": "x", "selection": "private", "order": "release-first"},
         ("private", "release-first"), "private r-f"),
        ({"label": "x", "selection": "private", "order": "release-first",
          "among_every_head": True}, ("private", "release-first among every head"),
         "private r-f all heads"),
        # older runs: no order field, read from the label
        ({"label": "30 sites, central, private heads, release-first (attribution votes)",
          "selection": "private"}, ("private", "release-first"), "private r-f"),
        ({"label": "10 sites, central, private heads", "selection": "private"},
         ("private", "select-first"), "private s-f"),
    ],
)  # fmt: skip
def test_a_row_s_option(
    report: Any, row: dict[str, str], option: tuple[str, str], tag: str
) -> None:
    assert report.option_of(row) == option
    assert report.option_tag(row) == tag


def _row(selection: str, order: str, variant: str, accuracy: float) -> dict[str, Any]:
    return {"label": f"10 sites, {selection}", "selection": selection, "order": order,
            "variant": variant, "sites": 10, "mode": "central", "accuracy": accuracy,
            "sd": 0.1}  # fmt: skip


def test_the_side_table_puts_each_option_in_its_column_and_marks_the_chosen_one(report):
    # Arrange: private select-first chosen; the two others released beside it
    task = {
        "task": "colour",
        "baselines": {"zero_shot": 0.0, "mtv_own_selection": 1.0, "site_alone_icl": 0.9,
                      "public_only_task_agnostic": 0.0, "public_only_tiny": 0.5,
                      "public_icl_tiny": 0.5},
        "rows": [
            _row("private", "select-first", "chosen", 0.5),
            _row("public", "select-first", "another option", 0.25),
            _row("private", "release-first", "another option", 0.75),
            _row("private", "release-first", "another option", 0.375) | {"among_every_head": True},
            _row("private", "select-first", "no centre", 0.125),
        ],
    }  # fmt: skip

    # Act
    line = report.side_table({"pretrained": {"tasks": [task]}})[-1]

    # Assert
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["pretrained", "colour", "10"]
    assert "(0.25" in cells[3]
    assert "(0.50" in cells[4]
    assert cells[4].endswith("(chosen)")
    assert "(0.75" in cells[5]
    assert "(0.38" in cells[6]  # release-first among every head: a column of its own
    assert "(0.12" in cells[7]

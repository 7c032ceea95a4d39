"""The utility benchmark keeps one run per task family and the report shows both families."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def utility() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("utility")


@pytest.fixture(scope="module")
def report() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("report")


def _headline(task: str, ratio: float) -> dict[str, Any]:
    return {
        "task": task,
        "zero": 0.1,
        "oracle": 0.5,
        "mtv_same_heads": 0.5,
        "dp": 0.1 + 0.4 * ratio,
        "dp_std": 0.0,
        "m": 200,
        "ratio": ratio,
        "ratio_same_heads": ratio,
        "recall": 1.0,
        "majority": 0.5,
    }


def test_writing_one_family_keeps_the_other(tmp_path, utility):
    out = tmp_path / "utility-small.json"
    utility._write_family(out, "trained", {"headline": [_headline("shape", 1.0)]})
    utility._write_family(out, "untrained", {"headline": [_headline("shape-merged", 0.5)]})
    utility._write_family(out, "untrained", {"headline": [_headline("count-merged", 0.25)]})
    families = json.loads(out.read_text())["families"]
    assert set(families) == {"trained", "untrained"}
    assert families["trained"]["headline"][0]["task"] == "shape"
    assert families["untrained"]["headline"][0]["task"] == "count-merged"  # replaced, not kept


def test_the_headline_table_shows_every_task_of_both_families_on_both_models(report):
    utility = {
        size: {
            "trained": {"headline": [_headline("shape", 0.93), _headline("colour", 1.0)]},
            "untrained": {"headline": [_headline("shape-merged", 0.5)]},
        }
        for size in ("small", "deep")
    }
    rows = report._headline(utility)[2:]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[:3] for c in cells] == [
        ["trained", "small", "shape"],
        ["trained", "small", "colour"],
        ["trained", "deep", "shape"],
        ["trained", "deep", "colour"],
        ["untrained", "small", "shape-merged"],
        ["untrained", "deep", "shape-merged"],
    ]
    assert cells[0][9] == "**93%**"
    assert cells[-1][9] == "**50%**"


def test_the_headline_ratio_divides_by_mtv_with_its_own_selection_not_the_same_heads(report):
    # Arrange: MTV's own heads reach 0.9, the heads DP picked only 0.5 (a bad private pick)
    row = _headline("position", 1.0) | {"zero": 0.1, "oracle": 0.9, "mtv_same_heads": 0.5}
    row["dp"] = 0.5
    # Act
    cells = [
        c.strip()
        for c in report._headline({"deep": {"trained": {"headline": [row]}}})[2]
        .strip("|")
        .split("|")
    ]
    # Assert: (0.5 - 0.1) / (0.9 - 0.1) = 50 %, while the same-heads diagnostic says 100 %
    assert cells[9] == "**50%**"
    assert cells[10] == "100%"


def test_headline_ratios_use_own_selection_and_keep_same_heads_as_a_diagnostic():
    sys.path.insert(0, str(BENCHMARKS))
    lib = importlib.import_module("_utility_lib")
    ratios = lib.headline_ratios(zero=0.2, dp=0.5, own_selection=0.8, same_heads=0.5)
    assert ratios["ratio"] == pytest.approx(0.5)
    assert ratios["ratio_same_heads"] == pytest.approx(1.0)
    nothing = lib.headline_ratios(zero=0.5, dp=0.6, own_selection=0.5, same_heads=0.4)
    assert nothing["ratio"] != nothing["ratio"]  # NaN: MTV itself gains nothing


def test_the_benchmark_accepts_every_task_and_reports_its_family(monkeypatch, utility):
    monkeypatch.setattr(sys, "argv", ["utility.py", "--task", "count-merged"])
    args = utility.parse_args()
    assert args.family == "untrained"
    assert args.tasks == ["colour-merged", "shape-merged", "count-merged", "position-merged"]
    monkeypatch.setattr(sys, "argv", ["utility.py", "--task", "count"])
    assert utility.parse_args().tasks == ["colour", "shape", "count", "position"]


@pytest.mark.parametrize(("icl", "learned"), [(0.485, False), (0.56, False), (0.8, True)])
def test_the_untrained_note_says_whether_the_rule_is_learned_beyond_the_shortcut(
    report, icl, learned
):
    table = [
        {"name": "zero-shot", "accuracy": 0.1},
        {"name": "4-shot ICL", "accuracy": icl},
        {"name": "oracle: MTV, heads by attribution on validation", "accuracy": 0.5},
        {"name": "MTV, public heads (no clip, no noise)", "accuracy": 0.5},
    ]
    run = {"args": {"shots": "4", "test": "200"}, "table": table}
    note = report._untrained_note({"small": {"untrained": run}})[0]
    assert (" learns part of the merged rule" in note) is learned
    assert f"4-shot ICL {icl:.3f}" in note

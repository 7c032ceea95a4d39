"""The default check stays a quickstart: reproductions that take minutes are not in it."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "check"
REPRODUCTIONS = REPO / "scripts" / "check-reproductions"
# Tests that retrain or re-score a shipped model: minutes on 2 shared cores.
SLOW_REPRODUCTIONS = {
    "tests/integration/test_embedded_model.py": (
        "test_short_retraining_reproduces_the_documented_checkpoint",
        "test_shipped_weights_reproduce_documented_accuracies",
    ),
}


def _marker_expression(script: Path) -> str:
    line = next(line for line in script.read_text().splitlines() if line.startswith("pytest "))
    words = shlex.split(line)
    return words[words.index("-m") + 1]


def _markers(path: str, name: str) -> set[str]:
    """The ``pytest.mark.*`` decorators of test ``name`` (read, not imported: no torch)."""
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    test = next(
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name
    )
    marks = set()
    for decorator in test.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute):
            marks.add(target.attr)
    return marks


def test_ci_runs_scripts_check():
    assert re.search(r"^exec scripts/check\b", (REPO / ".ci" / "run").read_text(), re.MULTILINE)


def test_scripts_check_leaves_out_gpu_tests_and_reproductions():
    assert _marker_expression(CHECK) == "not gpu and not reproduction"


def test_scripts_check_reproductions_runs_exactly_the_reproductions():
    assert _marker_expression(REPRODUCTIONS) == "reproduction and not gpu"


def test_every_retraining_or_rescoring_test_is_marked_reproduction():
    for path, names in SLOW_REPRODUCTIONS.items():
        for name in names:
            assert "reproduction" in _markers(path, name), f"{path}::{name}"


def test_the_retraining_script_runs_in_the_default_selection_only_as_a_smoke_test():
    # A test module that starts the training script without --smoke retrains for minutes.
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "train_embedded_model" not in text or path.name == Path(__file__).name:
            continue
        relative = path.relative_to(REPO).as_posix()
        for name in re.findall(r"^def (test_\w+)\(", text, flags=re.MULTILINE):
            body = text.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
            retrains = "subprocess.run" in body and "--smoke" not in body
            if retrains:
                assert "reproduction" in _markers(relative, name), f"{relative}::{name}"

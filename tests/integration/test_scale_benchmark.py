"""The scale benchmark runs a whole in-process release in which every site shares one model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_benchmark", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_four_sites_release_with_one_model_load(scale: ModuleType, mode: str) -> None:
    # Act: a fresh process, as the benchmark runs each configuration
    row = scale.run_child(4, mode, per_site=10, timeout=300.0)

    # Assert
    assert isinstance(row, scale.Row), row
    assert row.acknowledged == 4
    assert row.models_loaded == 1
    assert set(row.stages) >= {"plan", "sums+noise", "broadcast"}
    assert row.wall_s > 0
    assert row.peak_mib > 0


def test_a_failed_configuration_is_a_table_row(scale: ModuleType) -> None:
    # Act
    lines = scale.table([(300, "central", "did not finish in 10 s")])

    # Assert
    assert lines[-1] == "| 300 | central | — | — | — | — | failed: did not finish in 10 s |"

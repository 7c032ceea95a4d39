"""scripts/setup keeps a torch a site installed (a CUDA build) and installs the pin otherwise.

The script runs for real in a copy of the repository's setup files, with a stand-in for the
virtual environment's python: pip calls are recorded instead of run (no network, nothing
installed), and the torch the environment "has" is a package metadata folder.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    """A script of scripts/ as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


torch_choice = _script("torch_choice")

_SHIM = """#!/usr/bin/env bash
if [[ "$1 $2" == "-m pip" ]]; then echo "pip ${*:3}" >> "$PIP_LOG"; exit 0; fi
exec "$REAL_PYTHON" -S "$@"
"""


@pytest.mark.parametrize(
    ("installed", "expected"),
    [
        (None, "install"),
        ("2.13.0+cu128", "keep 2.13.0+cu128"),
        ("2.4.0+cpu", "keep 2.4.0+cpu"),
        ("2.3.1", "install"),
        ("2.11.0+rocm6.4", "keep 2.11.0+rocm6.4"),
    ],
)
def test_a_torch_that_meets_the_range_is_kept_whatever_its_build(installed, expected):
    assert torch_choice.choice(installed, (2, 4)) == expected


def test_the_range_is_read_from_the_project() -> None:
    assert torch_choice.required_minimum() == (2, 4)


def _run_setup(tmp_path: Path, torch_version: str | None, **env: str) -> list[str]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("pyproject.toml", "scripts/setup", "scripts/torch_choice.py"):
        shutil.copy(REPO / name, repo / name)
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(_SHIM)
    (venv_bin / "python").chmod(0o755)
    site = tmp_path / "site"
    site.mkdir()
    if torch_version is not None:
        info = site / f"torch-{torch_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n"
        )
    log = tmp_path / "pip.log"
    log.touch()
    subprocess.run(
        ["bash", str(repo / "scripts" / "setup")],
        check=True,
        capture_output=True,
        env={
            "PATH": "/usr/bin:/bin",
            "PIP_LOG": str(log),
            "REAL_PYTHON": sys.executable,
            "PYTHONPATH": str(site),
            **env,
        },
    )
    return log.read_text().splitlines()


def test_setup_keeps_a_cuda_torch_the_site_installed(tmp_path: Path) -> None:
    calls = _run_setup(tmp_path, "2.13.0+cu128")
    assert not [call for call in calls if "torch==" in call]
    assert any("-e .[pretrained]" in call for call in calls)


def test_setup_installs_the_pinned_torch_where_there_is_none(tmp_path: Path) -> None:
    calls = _run_setup(tmp_path, None)
    assert "pip install --quiet torch==2.13.0" in calls


def test_a_cpu_only_site_names_pytorch_s_cpu_index(tmp_path: Path) -> None:
    index = "https://download.pytorch.org/whl/cpu"
    calls = _run_setup(tmp_path, None, DPMTV_TORCH_INDEX_URL=index)
    assert f"pip install --quiet --index-url {index} torch==2.13.0" in calls

"""``dpmtv-site audit`` on a tiny model: the report, its JSON, its refusals, and its help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client.cli import main
from client.models import save_tiny_model
from client.synthetic import write_task_datasets

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root: Path = tmp_path_factory.mktemp("audit-cli")
    save_tiny_model("llava", root / "model", seed=0)
    write_task_datasets(
        root / "data", task="colour", sites=1, per_site=15, public=0, test=0, seed=0
    )
    return root


def _args(root: Path, *extra: str) -> list[str]:
    return [
        "audit",
        "--model",
        str(root / "model"),
        "--device",
        "cpu",
        "--data",
        str(root / "data" / "site-0"),
        "--shots",
        "2",
        *extra,
    ]


def test_audit_prints_and_writes_its_report(workspace, capsys):
    # Arrange
    out = workspace / "report.json"
    # Act
    code = main(
        _args(
            workspace,
            "--clip-norm",
            "0.05",
            "--selection",
            "all",
            "--epsilon",
            "8",
            "--runs",
            "100",
            "--json",
            str(out),
        )
    )
    # Assert
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 0
    assert "canary pair: 1 chunk changed, m=5" in printed
    # progress goes to stderr: each stage named, each side's runs as a bar with an estimate
    assert "audit: choosing a canary among" in captured.err
    for label in ("production", "sigma halved", "noise off"):
        assert f"audit {label}, without canary: 100%" in captured.err
        assert f"audit {label}, with: 100%" in captured.err
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["reports"]]
    assert labels == ["production", "sigma halved", "noise off"]
    production, halved, off = report["reports"]
    assert report["distance"] <= report["sensitivity"] * (1 + 1e-9)
    assert production["mu_claimed"] == pytest.approx(halved["mu_claimed"])
    assert production["epsilon_claimed"] <= 8.0 + 1e-6
    assert off["epsilon_lower_cp"] > production["epsilon_lower_cp"]


def test_private_release_first_configuration_is_audited_without_power_rows(workspace, capsys):
    code = main(
        _args(
            workspace,
            "--clip-norm",
            "0.05",
            "--selection",
            "private",
            "--heads",
            "2",
            "--runs",
            "40",
            "--no-power",
        )
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "production:" in printed
    assert "sigma halved" not in printed


def test_audit_without_clip_norm_is_one_line(workspace, capsys):
    code = main(_args(workspace, "--selection", "all", "--runs", "40"))
    assert code == 2
    assert "--clip-norm is required" in capsys.readouterr().err


def test_audit_without_data_is_one_line(workspace, capsys):
    code = main(["audit", "--model", str(workspace / "model"), "--clip-norm", "1"])
    assert code == 2
    assert "audit needs --data" in capsys.readouterr().err


def test_help_says_what_the_audit_cannot_show(capsys):
    code = main(["audit", "--help"])
    text = capsys.readouterr().out
    assert code == 0
    assert "What it cannot show" in text
    assert "Nothing is" in text

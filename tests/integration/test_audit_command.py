"""``dpmtv-site audit`` on a tiny model: the report, its JSON, its refusals, and its help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client.cli import main
from client.data.synthetic import write_task_datasets
from client.models import save_tiny_model

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
    assert "audited noise mode: central" in printed
    assert (
        "privacy unit: example (the canary replaces one example; every epsilon is per " in printed
    )
    # progress goes to stderr: each stage named, each side's runs as a bar with an estimate
    assert "audit: choosing a canary among" in captured.err
    for label in ("production", "sigma halved", "noise off"):
        assert f"audit {label}, without canary: 100%" in captured.err
        assert f"audit {label}, with: 100%" in captured.err
    report = json.loads(out.read_text())
    assert report["privacy_unit"] == "example"
    labels = [r["label"] for r in report["reports"]]
    assert labels == ["production", "sigma halved", "noise off"]
    production, halved, off = report["reports"]
    assert report["distance"] <= report["sensitivity"] * (1 + 1e-9)
    # the power of the given runs is stated, in the report and in the JSON
    power = report["power"]
    assert power["runs"] == 100
    assert "power: sigma halved is flagged as" in printed
    assert f"with probability {power['power']:.2f} at 100 runs a side" in printed
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
    assert not [line for line in printed.splitlines() if line.startswith("sigma halved")]


def test_distributed_noise_mode_is_audited_and_named(workspace, capsys):
    # Arrange
    out = workspace / "distributed.json"
    # Act
    code = main(
        _args(
            workspace,
            "--clip-norm", "0.05", "--selection", "all", "--epsilon", "8",
            "--noise-mode", "distributed", "--min-honest", "2", "--runs", "40",
            "--json", str(out),
        )
    )  # fmt: skip
    # Assert: the mode is printed and recorded, with every row at two honest shares
    printed = capsys.readouterr().out
    assert code == 0
    assert "audited noise mode: distributed" in printed
    assert "2 = min-honest in all" in printed
    report = json.loads(out.read_text())
    assert (report["noise_mode"], report["min_honest"]) == ("distributed", 2)
    assert [r["label"] for r in report["reports"]] == ["production", "sigma halved", "noise off"]
    assert {(r["noise_mode"], r["honest_shares"]) for r in report["reports"]} == {
        ("distributed", 2)
    }
    production, _, off = report["reports"]
    assert production["epsilon_claimed"] == pytest.approx(8.0, rel=1e-4)
    assert off["epsilon_lower_cp"] > production["epsilon_lower_cp"]


def test_distributed_audit_with_too_few_sites_is_one_line(workspace, capsys):
    code = main(
        _args(
            workspace,
            "--clip-norm", "0.05", "--selection", "all", "--noise-mode", "distributed",
            "--min-honest", "3", "--max-sites", "2", "--runs", "40",
        )
    )  # fmt: skip
    assert code == 2
    assert "--max-sites must be at least max(2, --min-honest) = 3, got 2" in capsys.readouterr().err


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


def test_default_runs_are_sized_for_the_asked_power(workspace, capsys):
    # Arrange
    from dpmtv_common.privacy.auditing import detection_power, runs_for_power

    out = workspace / "sized.json"
    # Act: no --runs; a low power and confidence keep the run count small here
    code = main(
        _args(
            workspace,
            "--clip-norm", "0.05", "--selection", "all", "--epsilon", "8",
            "--power", "0.5", "--confidence", "0.6", "--no-power", "--json", str(out),
        )
    )  # fmt: skip
    # Assert: the runs are the fewest that reach 0.5 with either check (the canary is drawn
    # with a fresh secret shuffle, so which check sizes them varies from run to run)
    assert code == 0
    report = json.loads(out.read_text())
    power = report["power"]
    halved = 2 * power["mu_canary"]
    bars = {"violation": power["mu_claimed"], "calibration": power["mu_canary"]}
    needed = [
        runs_for_power(mu_true=halved, mu_bar=bar, power=0.5, confidence=0.6, max_runs=100_000)
        for bar in bars.values()
    ]
    expected = min(n for n in needed if n is not None)
    assert power["runs"] == expected
    assert report["reports"][0]["runs"] == expected
    assert power["power"] >= 0.5
    assert power["power"] == detection_power(
        mu_true=halved, mu_bar=bars[power["check"]], runs=expected, confidence=0.6
    )
    assert "power: sigma halved is flagged" in capsys.readouterr().out

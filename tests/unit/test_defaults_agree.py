"""The coordinator's and a site's defaults agree: a default plan is one a default site takes.

The run config's defaults live twice (``server.settings.RunConfig`` and the FAB's
``[tool.flwr.app.config]`` in pyproject.toml, which Flower sends); a site's policy defaults
live in ``client.settings.SiteSettings``. A consortium started with every default must not be
refused by sites started with every default (it was: min-sites 2 against a site minimum of 3).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from client.release.policy import ModelShape, check_plan
from client.settings import SiteSettings
from dpmtv_common.heads import HeadLayout
from server.coordinator import build_plan
from server.settings import RunConfig

REPO = Path(__file__).resolve().parents[2]
FINGERPRINT = "sha256:" + "0" * 64


def _fab_config() -> dict[str, object]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(pyproject["tool"]["flwr"]["app"]["config"])


def test_the_fab_config_and_the_run_config_defaults_are_the_same() -> None:
    # Arrange: the keys with no default (the model, and C: chosen on public data) aside
    required = {"model-fingerprint", "clip-norm"}
    defaults = RunConfig(model_fingerprint=FINGERPRINT, clip_norm=1.0).model_dump(by_alias=True)
    # Act
    differ = {
        key: (value, defaults[key])
        for key, value in _fab_config().items()
        if key not in required and defaults[key] != value
    }
    # Assert
    assert differ == {}


@pytest.mark.parametrize("source", ["fab", "run-config"])
def test_a_default_site_accepts_a_default_plan(source: str, tmp_path: Path) -> None:
    # Arrange
    config = _fab_config() if source == "fab" else {}
    run = RunConfig.from_context({"clip-norm": 1.0, **config, "model-fingerprint": FINGERPRINT})
    plan = build_plan(run)
    site = SiteSettings(state_dir=tmp_path)  # every policy at its default
    shape = ModelShape(HeadLayout(num_layers=4, num_heads=4), head_dim=8)
    # Act / Assert: no refusal (min sites, noise mode, epsilon cap, unit, heads)
    check_plan(plan, settings=site, fingerprint=FINGERPRINT, shape=shape, data_unit="example")
    assert plan.min_sites == site.min_sites

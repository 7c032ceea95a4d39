"""End-to-end GDP canary audit of the PRODUCTION path (notes/dp.md §4.3 test 6).

A tiny random LLaVA and a small synthetic dataset; one record is replaced by a canary record.
Both datasets are cut with the same secret chunk seed and summed by
``client.release.single_holder.LocalSums`` (per-layer clipping in
``client.activations.extraction``); ``protocol.run_release`` (selection "all") then adds the
production Gaussian draw N times per side with ``secure_noise()``, through
``client.audit.empirical.audit_pair``. Projected on the canary direction, the outputs are
N(a, σ²) and N(a + ‖Δ‖, σ²), so μ̂ estimates ‖Δ‖/σ with standard error ≈ sqrt(2/N + μ²/(4N)).

Distributed noise mode: the same pair, each run the production encoder's shares of exactly
``min_honest`` = 2 honest sites (this site's sum and a zero sum, discrete-Gaussian shares from
``secure_noise()``), added and decoded as the coordinator decodes them, then
``run_release`` in distributed mode; the claim is the production accounting's (√(2ρ) at t).

Thresholds: every check is a normal-tail bound at z = 4.89 (two-sided false-failure rate 1e-6
per check, nine checks: at most 9e-6 for the file), applied to μ̂'s standard error. The
distributed checks run N_d = 400 a side: σ halved (μ ≈ 1.54 against the bar 0.77 + 4.89·0.073
= 1.13, standard error 0.083) still clears its bar by 5 standard errors.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import client.activations.extraction
from client.audit.canary import canary_candidates, choose_canary, plant_canary
from client.audit.empirical import (
    CanaryPair,
    ScaledNoise,
    audit_pair,
    make_canary_pair,
)
from client.data.records import SiteDataset, load_dataset
from client.data.synthetic import write_task_datasets
from client.models import LoadedModel, load_model, save_tiny_model
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout
from dpmtv_common.privacy.auditing import epsilon_of_gdp
from dpmtv_common.privacy.noise import secure_noise
from protocol import (
    PROTOCOL_VERSION,
    NoiseMode,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    plan_distributed_calibration,
)

pytestmark = pytest.mark.statistical

Z_BOUND = float(stats.norm.isf(1e-6 / 2))
RUNS = 600
DISTRIBUTED_RUNS = 400  # each run encodes two shares: fewer runs keep the file fast
CHUNK_SEED = 2**200 + 12345  # a fixed "secret" shuffle: the test must be reproducible
LAYOUT = HeadLayout(2, 4)  # the tiny LLaVA: 2 layers x 4 heads, every layer carries heads


def _standard_error(mu: float, runs: int = RUNS) -> float:
    return math.sqrt(2 / runs + mu * mu / (4 * runs))


def _distributed_plan(
    loaded: LoadedModel, clip_norm: float, *, max_chunks_per_site: int = 5
) -> ReleasePlan:
    """The same configuration in distributed mode: shares sized for t = 2 honest sites."""
    fields = dict(_plan(loaded, clip_norm)) | {
        "noise_mode": NoiseMode.DISTRIBUTED,
        "min_honest": 2,
        "min_sites": 2,
        "max_sites": 3,
        "max_chunks_per_site": max_chunks_per_site,
    }
    return ReleasePlan(**fields)


def _plan(loaded: LoadedModel, clip_norm: float) -> ReleasePlan:
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id="audit-test",
        task="colour",
        model_fingerprint=loaded.fingerprint,
        # epsilon 8 keeps sigma small, so this canary's mu is about 1: a halved sigma moves mu
        # by ~1, twenty standard errors.
        epsilon=8.0,
        delta=1e-5,
        shots=2,
        clip_norm=clip_norm,
        selection=SelectionMode.ALL,
        order=ReleaseOrder.SELECT_FIRST,
        num_selected_heads=1,
        public_heads=None,
        selection_share=0.3,
        score_top_r=1,
        min_sites=1,
        max_chunks_per_site=None,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> tuple[LoadedModel, SiteDataset, SiteDataset]:
    root: Path = tmp_path_factory.mktemp("audit")
    save_tiny_model("llava", root / "model", seed=0)
    loaded = load_model(root / "model", device="cpu")
    write_task_datasets(
        root / "data", task="colour", sites=1, per_site=15, public=0, test=0, seed=0
    )
    dataset = load_dataset(root / "data" / "site-0")
    plan = _plan(loaded, clip_norm=0.05)
    candidates = canary_candidates(dataset, root / "canaries")
    canary, index, _ = choose_canary(loaded, dataset, candidates, plan, chunk_seed=CHUNK_SEED)
    return loaded, dataset, plant_canary(dataset, canary, index=index)


@pytest.fixture(scope="module")
def pair(setting) -> tuple[ReleasePlan, CanaryPair]:
    loaded, dataset, neighbour = setting
    plan = _plan(loaded, clip_norm=0.05)
    return plan, make_canary_pair(loaded, dataset, neighbour, plan, chunk_seed=CHUNK_SEED)


def test_canary_changes_one_chunk_within_the_sensitivity_bound(pair):
    _, canary = pair
    assert canary.changed_chunks == 1
    assert 0.2 * canary.sensitivity < canary.distance <= canary.sensitivity * (1 + 1e-9)


def test_production_noise_shows_the_mu_its_calibration_implies(pair):
    plan, canary = pair
    report = audit_pair(plan, canary, noise=secure_noise(), runs=RUNS, layout=LAYOUT)
    assert abs(report.mu_hat - report.mu_canary) < Z_BOUND * _standard_error(report.mu_canary)
    assert report.mu_hat < report.mu_claimed + Z_BOUND * _standard_error(report.mu_claimed)
    assert report.epsilon_claimed == pytest.approx(epsilon_of_gdp(report.mu_claimed, 1e-5))


def test_halved_noise_is_caught(pair):
    plan, canary = pair
    bug = ScaledNoise(secure_noise(), 0.5)
    report = audit_pair(plan, canary, noise=bug, runs=RUNS, layout=LAYOUT, label="sigma halved")
    assert report.mu_hat > report.mu_canary + Z_BOUND * _standard_error(report.mu_canary)


def test_noise_off_gives_a_large_clopper_pearson_lower_bound(pair):
    plan, canary = pair
    report = audit_pair(
        plan, canary, noise=ScaledNoise(secure_noise(), 0.0), runs=RUNS, layout=LAYOUT
    )
    # 0 errors in 300 trials per rate: CP upper limit 1 - 0.0125^(1/300) ~ 0.0145 -> eps ~ 4.2.
    assert report.epsilon_lower_cp > 4.0
    assert report.violates_claim


def test_skipped_clipping_is_caught_by_the_audit(setting, monkeypatch):
    # Arrange: the planted bug — clipping in the production extraction path does nothing.
    loaded, dataset, neighbour = setting
    monkeypatch.setattr(
        client.activations.extraction,
        "clip_per_layer",
        lambda rows, **_: np.asarray(rows, dtype=np.float64),
    )
    plan = _plan(loaded, clip_norm=0.005)  # far below the activations' norms
    # Act
    unclipped = make_canary_pair(loaded, dataset, neighbour, plan, chunk_seed=CHUNK_SEED)
    report = audit_pair(plan, unclipped, noise=secure_noise(), runs=RUNS, layout=LAYOUT)
    # Assert: the distance exceeds the bound, and the noisy outputs show it.
    assert unclipped.distance > unclipped.sensitivity
    assert report.mu_hat > report.mu_claimed + Z_BOUND * _standard_error(report.mu_claimed)


def test_distributed_noise_shows_the_mu_its_calibration_implies(setting, pair):
    # Arrange: the clipped sums do not depend on the noise mode, so the pair is reused
    loaded = setting[0]
    _, canary = pair
    plan = _distributed_plan(loaded, clip_norm=0.05)
    # Act
    report = audit_pair(plan, canary, noise=secure_noise(), runs=DISTRIBUTED_RUNS, layout=LAYOUT)
    # Assert: two honest shares, the accounting's claim, and the noise it implies
    error = _standard_error(report.mu_canary, DISTRIBUTED_RUNS)
    assert (report.noise_mode, report.honest_shares) == ("distributed", 2)
    calibration = plan_distributed_calibration(plan)
    assert report.mu_claimed == pytest.approx(1 / calibration.activation_noise_multiplier)
    assert report.epsilon_claimed == pytest.approx(plan.epsilon, rel=1e-4)
    assert abs(report.mu_hat - report.mu_canary) < Z_BOUND * error
    assert report.mu_hat < report.mu_claimed + Z_BOUND * _standard_error(
        report.mu_claimed, DISTRIBUTED_RUNS
    )


def test_distributed_halved_noise_is_caught(setting, pair):
    loaded = setting[0]
    _, canary = pair
    plan = _distributed_plan(loaded, clip_norm=0.05)
    bug = ScaledNoise(secure_noise(), 0.5)  # every site's share halved
    report = audit_pair(plan, canary, noise=bug, runs=DISTRIBUTED_RUNS, layout=LAYOUT)
    error = _standard_error(report.mu_canary, DISTRIBUTED_RUNS)
    assert report.mu_hat > report.mu_canary + Z_BOUND * error


@pytest.fixture(scope="module")
def unclipped(setting) -> CanaryPair:
    """The pair with clipping skipped in the production extraction path (a planted bug)."""
    loaded, dataset, neighbour = setting
    plan = _distributed_plan(loaded, clip_norm=0.025, max_chunks_per_site=50)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            client.activations.extraction,
            "clip_per_layer",
            lambda rows, **_: np.asarray(rows, dtype=np.float64),
        )
        return make_canary_pair(loaded, dataset, neighbour, plan, chunk_seed=CHUNK_SEED)


def test_distributed_skipped_clipping_is_caught(setting, unclipped):
    # Arrange: a cap of 50 chunks lets the unclipped sum (coordinates up to ~1.2) onto the
    # grid (|x| <= 50*C = 1.25), while its layers are 17-33 times C
    plan = _distributed_plan(setting[0], clip_norm=0.025, max_chunks_per_site=50)
    # Act
    report = audit_pair(plan, unclipped, noise=secure_noise(), runs=DISTRIBUTED_RUNS, layout=LAYOUT)
    # Assert
    error = _standard_error(report.mu_claimed, DISTRIBUTED_RUNS)
    assert unclipped.distance > unclipped.sensitivity
    assert report.mu_hat > report.mu_claimed + Z_BOUND * error


def test_distributed_encoder_refuses_an_unclipped_sum_beyond_its_grid(setting, unclipped):
    # The plan's own cap (5 chunks) bounds a site's coordinates by 5*C = 0.125: the production
    # encoder refuses the unclipped sum before any share is drawn, so nothing is released.
    plan = _distributed_plan(setting[0], clip_norm=0.025, max_chunks_per_site=5)
    with pytest.raises(ConfigError, match="max_abs_site_coordinate"):
        audit_pair(plan, unclipped, noise=secure_noise(), runs=DISTRIBUTED_RUNS, layout=LAYOUT)

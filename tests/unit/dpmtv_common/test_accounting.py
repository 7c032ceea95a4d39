import pytest

from dpmtv_common.errors import CalibrationError, ConfigError
from dpmtv_common.privacy.accounting import (
    analytic_noise_multiplier,
    calibrate_noise_multiplier,
    epsilon_per_pick_from_share,
)
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent

# Golden values measured once with dp-accounting 0.6.0 apart from this code (analytic
# Gaussian, RDP and PLD compositions).


def test_analytic_sigma_matches_golden_value():
    # Act
    z = analytic_noise_multiplier(epsilon=1.0, delta=1e-5)
    # Assert: the classical formula would give 4.8448; this must not.
    assert z == pytest.approx(3.73063, abs=1e-5)


def test_lone_gaussian_bound_round_trips_to_target_epsilon():
    z = analytic_noise_multiplier(epsilon=1.0, delta=1e-5)
    bound = epsilon_bound([ReleaseEvent(z)], delta=1e-5)
    assert bound.epsilon == pytest.approx(1.0, abs=1e-6)


def test_rdp_composition_of_gaussian_and_picks_matches_golden_value():
    bound = epsilon_bound([ReleaseEvent(5.0, picks=8, epsilon_per_pick=0.1)], delta=1e-5)
    assert bound.by_accountant["rdp"] == pytest.approx(0.99005, abs=1e-5)
    assert bound.by_accountant["pld"] == pytest.approx(1.2346, abs=1e-3)
    assert bound.accountant == "rdp"
    assert bound.epsilon == bound.by_accountant["rdp"]


def test_pld_wins_with_few_picks():
    bound = epsilon_bound([ReleaseEvent(4.0, picks=1, epsilon_per_pick=0.1)], delta=1e-5)
    assert bound.accountant == "pld"
    assert bound.epsilon < bound.by_accountant["rdp"]


@pytest.mark.parametrize(
    ("picks", "epsilon_per_pick", "golden_z"),
    [(8, 0.05, 4.2218), (1, 0.10, 3.9504), (16, 0.05, 4.4235), (32, 0.02, 4.1099)],
)
def test_calibration_matches_golden_values(picks, epsilon_per_pick, golden_z):
    calibration = calibrate_noise_multiplier(
        epsilon=1.0, delta=1e-5, picks=picks, epsilon_per_pick=epsilon_per_pick
    )
    assert calibration.noise_multiplier == pytest.approx(golden_z, abs=2e-4)


def test_calibration_errs_towards_privacy():
    # Arrange / Act
    calibration = calibrate_noise_multiplier(
        epsilon=1.0, delta=1e-5, picks=8, epsilon_per_pick=0.05
    )
    # Assert: the reported bound never exceeds the target (Opacus' overshoot test).
    assert calibration.bound.epsilon <= 1.0
    slightly_less = ReleaseEvent(calibration.noise_multiplier * 0.999, 8, 0.05)
    assert epsilon_bound([slightly_less], delta=1e-5).epsilon > 1.0


def test_epsilon_falls_as_noise_rises_and_rises_with_picks():
    eps = [
        epsilon_bound([ReleaseEvent(z, picks=4, epsilon_per_pick=0.1)], delta=1e-5).epsilon
        for z in (2.0, 4.0, 8.0)
    ]
    assert eps[0] > eps[1] > eps[2]
    by_picks = [
        epsilon_bound([ReleaseEvent(4.0, picks=k, epsilon_per_pick=0.1)], delta=1e-5).epsilon
        for k in (1, 4, 16)
    ]
    assert by_picks[0] < by_picks[1] < by_picks[2]


def test_two_releases_cost_more_than_one():
    one = epsilon_bound([ReleaseEvent(5.0, 8, 0.1)], delta=1e-5).epsilon
    two = epsilon_bound([ReleaseEvent(5.0, 8, 0.1)] * 2, delta=1e-5).epsilon
    assert one < two < 2 * one


def test_calibration_refuses_when_selection_alone_spends_the_budget():
    with pytest.raises(CalibrationError, match="already spends"):
        calibrate_noise_multiplier(epsilon=0.5, delta=1e-5, picks=100, epsilon_per_pick=0.5)


def test_share_split_gives_golden_epsilon_per_pick():
    assert epsilon_per_pick_from_share(epsilon=1.0, share=0.4, picks=8) == pytest.approx(0.05)


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1, 2.0])
def test_share_outside_open_unit_interval_is_refused(share):
    with pytest.raises(ConfigError, match="share"):
        epsilon_per_pick_from_share(epsilon=1.0, share=share, picks=8)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5])
def test_invalid_delta_is_refused_with_the_value(delta):
    with pytest.raises(ConfigError, match=repr(delta)):
        epsilon_bound([ReleaseEvent(5.0)], delta=delta)


def test_empty_event_list_is_refused():
    with pytest.raises(ConfigError, match="empty"):
        epsilon_bound([], delta=1e-5)


def test_a_remembered_bound_is_the_computed_one_and_each_caller_gets_its_own() -> None:
    # Arrange: the same plan checked by two sites of one process
    from dpmtv_common.privacy import accounting

    events = [ReleaseEvent(noise_multiplier=1.3, picks=4, epsilon_per_pick=0.05)]
    accounting._remembered_bound.cache_clear()

    # Act
    first = accounting.central_epsilon_bound(events, delta=1e-5)
    first.by_accountant["rdp"] = -1.0  # a caller scribbling on its copy
    second = accounting.central_epsilon_bound(list(events), delta=1e-5)
    accounting._remembered_bound.cache_clear()
    fresh = accounting.central_epsilon_bound(events, delta=1e-5)

    # Assert
    assert second == fresh
    assert second.by_accountant["rdp"] > 0


def test_the_central_accountant_refuses_a_distributed_sum_and_the_ledger_entry_point_takes_it():
    # Arrange: one central release and one with a distributed-noise sum
    from dpmtv_common.privacy import accounting
    from dpmtv_common.privacy.distributed import release_events_epsilon_bound

    central = ReleaseEvent(noise_multiplier=4.0, picks=2, epsilon_per_pick=0.1)
    distributed = ReleaseEvent(None, distributed_rho=0.02, overflow_probability=1e-9)

    # Act
    with pytest.raises(ConfigError, match="distributed"):
        accounting.central_epsilon_bound([central, distributed], delta=1e-5)
    mixed = epsilon_bound([central, distributed], delta=1e-5)
    alone = epsilon_bound([central], delta=1e-5)

    # Assert: RDP with the overflow for the mixed ledger; the central bound otherwise
    assert mixed == release_events_epsilon_bound([central, distributed], delta=1e-5)
    assert mixed.accountant == "rdp"
    assert alone == accounting.central_epsilon_bound([central], delta=1e-5)
    assert mixed.epsilon > alone.epsilon

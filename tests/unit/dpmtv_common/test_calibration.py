import pytest

from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.calibration import ReleaseCalibration


def test_private_selection_split_matches_golden_calibration():
    # share 0.4 of eps=1 over k=8 picks gives eps0 = 0.05, hence z = 4.2218.
    calibration = ReleaseCalibration.for_budget(
        epsilon=1.0, delta=1e-5, private_picks=8, selection_share=0.4
    )
    assert calibration.epsilon_per_pick == pytest.approx(0.05)
    assert calibration.noise_multiplier == pytest.approx(4.2218, abs=2e-4)
    assert calibration.bound.epsilon <= 1.0
    assert calibration.event.picks == 8


def test_no_private_selection_is_the_analytic_gaussian():
    calibration = ReleaseCalibration.for_budget(
        epsilon=1.0, delta=1e-5, private_picks=0, selection_share=0.4
    )
    assert calibration.noise_multiplier == pytest.approx(3.73063, abs=1e-5)
    assert calibration.epsilon_per_pick == 0.0
    with pytest.raises(ConfigError, match="no private selection"):
        calibration.gumbel()


def test_gaussian_sensitivity_follows_the_released_layers():
    calibration = ReleaseCalibration.for_budget(
        epsilon=1.0, delta=1e-5, private_picks=0, selection_share=0.5
    )
    heads = HeadSet.of([(0, 1), (0, 2), (3, 0), (5, 7)])
    mechanism = calibration.gaussian(clip_norm=0.5, heads=heads)
    assert mechanism.num_layers_in_scope == 3
    assert mechanism.noise_std == pytest.approx(calibration.noise_multiplier * 2 * 0.5 * 3**0.5)


def test_negative_picks_are_refused():
    with pytest.raises(ConfigError, match="private_picks"):
        ReleaseCalibration.for_budget(
            epsilon=1.0, delta=1e-5, private_picks=-1, selection_share=0.5
        )

import numpy as np
import pytest

from dpmtv_common.errors import ConfigError, InsecureRandomnessError
from dpmtv_common.privacy.noise import NoiseSource, require_cryptographic, secure_noise
from dpmtv_common.privacy.testing import SeededNoise


def test_secure_noise_is_cryptographic_and_accepted():
    noise = secure_noise()
    assert isinstance(noise, NoiseSource)
    require_cryptographic(noise)


def test_seeded_noise_is_refused_by_production_paths():
    with pytest.raises(InsecureRandomnessError, match="SeededNoise"):
        require_cryptographic(SeededNoise(0))


def test_a_source_that_only_claims_truthiness_is_refused():
    class Liar(SeededNoise):
        @property
        def is_cryptographic(self):
            return 1  # truthy but not True

    with pytest.raises(InsecureRandomnessError):
        require_cryptographic(Liar(0))


def test_secure_gaussian_keeps_shape_and_changes_values():
    values = np.zeros((3, 4))
    noisy = secure_noise().add_gaussian(values, noise_std=1.0)
    assert noisy.shape == (3, 4)
    assert noisy.dtype == np.float64
    assert np.any(noisy != 0.0)


def test_secure_gaussian_of_empty_array_is_empty():
    assert secure_noise().add_gaussian(np.zeros((0, 2)), noise_std=1.0).shape == (0, 2)


def test_secure_discrete_gaussian_returns_integers():
    draws = secure_noise().discrete_gaussian(100, noise_std=3.0)
    assert draws.dtype == np.int64
    assert draws.shape == (100,)


@pytest.mark.parametrize("noise", [secure_noise(), SeededNoise(0)])
def test_invalid_noise_std_is_refused(noise):
    with pytest.raises(ConfigError, match="noise_std"):
        noise.add_gaussian(np.zeros(2), noise_std=0.0)


@pytest.mark.parametrize("noise", [secure_noise(), SeededNoise(0)])
def test_non_finite_values_are_refused(noise):
    with pytest.raises(ConfigError, match="finite"):
        noise.add_gaussian(np.array([np.nan]), noise_std=1.0)


@pytest.mark.parametrize("noise", [secure_noise(), SeededNoise(0)])
@pytest.mark.parametrize("k", [0, 4])
def test_top_k_outside_range_is_refused(noise, k):
    with pytest.raises(ConfigError, match="k must"):
        noise.gumbel_top_k(np.zeros(3), k=k, scale=1.0)


def test_seeded_noise_is_reproducible():
    first = SeededNoise(7).add_gaussian(np.zeros(5), noise_std=1.0)
    second = SeededNoise(7).add_gaussian(np.zeros(5), noise_std=1.0)
    np.testing.assert_array_equal(first, second)

from __future__ import annotations

import numpy as np
import pytest

from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet


def _centre(seed: int = 0, shape: tuple[int, int, int] = (3, 4, 2)) -> ActivationCentre:
    return ActivationCentre.from_array(np.random.default_rng(seed).normal(size=shape))


def test_digest_is_a_function_of_the_values_and_the_shape():
    # Arrange
    centre = _centre()
    same = ActivationCentre.from_array(centre.values.copy())
    moved = centre.values.copy()
    moved[2, 3, 1] = np.nextafter(moved[2, 3, 1], np.inf)  # one ulp
    reshaped = ActivationCentre.from_array(centre.values.reshape(4, 3, 2))

    # Act / Assert
    assert centre.digest() == same.digest()
    assert ActivationCentre.from_array(moved).digest() != centre.digest()
    assert reshaped.digest() != centre.digest()
    assert len(centre.digest()) == 64


def test_values_are_a_read_only_copy():
    # Arrange
    source = np.ones((2, 2, 2))
    centre = ActivationCentre.from_array(source)

    # Act
    source[0, 0, 0] = 5.0

    # Assert
    assert centre.values[0, 0, 0] == 1.0
    with pytest.raises(ValueError, match="read-only"):
        centre.values[0, 0, 0] = 2.0


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (np.ones((2, 2)), "layers, heads, head_dim"),
        (np.ones((0, 2, 2)), "non-empty"),
        (np.full((1, 1, 2), np.nan), "finite"),
        (np.full((1, 1, 2), np.inf), "finite"),
    ],
)
def test_from_array_refuses_what_cannot_be_a_centre(values, match):
    with pytest.raises(ConfigError, match=match):
        ActivationCentre.from_array(values)


def test_flat_round_trips_for_the_same_shape_and_refuses_another():
    # Arrange
    centre = _centre()

    # Act
    back = ActivationCentre.from_flat(centre.flat(), shape=(3, 4, 2))

    # Assert
    assert back.digest() == centre.digest()
    with pytest.raises(ConfigError, match="L\\*H\\*D = 30"):
        ActivationCentre.from_flat(centre.flat(), shape=(3, 5, 2))


def test_rows_follow_the_head_set_order_and_refuse_heads_outside():
    # Arrange
    centre = _centre()
    heads = HeadSet.of([(2, 3), (0, 1)])

    # Act
    rows = centre.rows(heads)

    # Assert
    np.testing.assert_array_equal(rows, centre.values[[0, 2], [1, 3]])
    with pytest.raises(ConfigError, match="inside the centre"):
        centre.rows(HeadSet.of([(3, 0)]))


def test_save_and_load_keep_the_digest(tmp_path):
    # Arrange
    centre = _centre(seed=4)
    path = tmp_path / "centre.safetensors"

    # Act
    centre.save(path)
    loaded = ActivationCentre.load(path)

    # Assert
    assert loaded.digest() == centre.digest()


def test_load_refuses_a_file_that_is_not_a_centre(tmp_path):
    # Arrange
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")

    # Act / Assert
    with pytest.raises(ConfigError, match="safetensors"):
        ActivationCentre.load(junk)
    with pytest.raises(ConfigError, match="safetensors"):
        ActivationCentre.load(tmp_path / "missing.safetensors")

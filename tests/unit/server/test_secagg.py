from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dpmtv_common.errors import ConfigError
from server.secagg import SecureSumSettings

VALID: dict[str, Any] = {
    "clipping_range": 1.0,
    "quantization_range": 2**30,
    "modulus_range": 2**40,
    "timeout": 30.0,
    "max_sites": 10,
}


@pytest.mark.parametrize(
    ("max_abs_coordinate", "clipping_range"),
    [(3.0, 4.0), (4.0, 4.0), (4.000001, 8.0), (0.3, 0.5), (1.0, 1.0), (700.0, 1024.0)],
)
def test_for_plan_rounds_the_bound_up_to_a_power_of_two(max_abs_coordinate, clipping_range):
    settings = SecureSumSettings.for_plan(
        max_abs_coordinate=max_abs_coordinate, max_sites=3, timeout=5.0
    )

    assert settings.clipping_range == clipping_range
    assert settings.clipping_range >= max_abs_coordinate


@pytest.mark.parametrize(
    ("max_sites", "modulus_range", "quantization_range"),
    [
        (2, 2**32, 2**30),
        (3, 2**32, 2**30),
        (4, 2**40, 2**30),
        (1023, 2**40, 2**30),
        (1024, 2**40, 2**29),
        (5000, 2**40, 2**27),
    ],
)
def test_for_plan_takes_the_finest_grid_that_cannot_wrap(
    max_sites, modulus_range, quantization_range
):
    settings = SecureSumSettings.for_plan(max_abs_coordinate=1.0, max_sites=max_sites, timeout=5)

    assert settings.modulus_range == modulus_range
    assert settings.quantization_range == quantization_range
    assert settings.quantization_range * max_sites < settings.modulus_range


def test_quantisation_error_bound_is_n_grid_steps():
    settings = SecureSumSettings(**{**VALID, "clipping_range": 64.0})

    assert settings.quantization_error_bound(10) == pytest.approx(10 * 128 / 2**30)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("clipping_range", 0.0, "clipping_range must be a finite number > 0, got 0.0"),
        ("clipping_range", float("inf"), "clipping_range must be a finite number > 0"),
        ("timeout", None, "timeout must be a finite number > 0, got None"),
        ("timeout", float("inf"), "timeout must be a finite number > 0, got inf"),
        ("quantization_range", 2**31, "quantization_range must be a power of two in"),
        ("quantization_range", 1000, "quantization_range must be a power of two in"),
        ("modulus_range", 2**63, "modulus_range must be a power of two in"),
        ("modulus_range", 2**30, "modulus_range must be > quantization_range"),
        ("max_sites", 1, "max_sites must be an int >= 2, got 1"),
        ("num_shares", 2, "num_shares as an int must be >= 3, got 2"),
        ("num_shares", 1.5, "num_shares must be an int >= 3 or a float in"),
        ("reconstruction_threshold", 0.0, "reconstruction_threshold must be an int >= 2"),
        ("max_sites", 2000, "quantization_range \\* max_sites must be < modulus_range"),
    ],
)
def test_invalid_settings_are_refused_with_name_and_value(field, value, message):
    with pytest.raises(ConfigError, match=message):
        SecureSumSettings(**{**VALID, field: value})


def test_an_int_threshold_must_stay_below_an_int_share_count():
    with pytest.raises(ConfigError, match="reconstruction_threshold must be < num_shares=3"):
        SecureSumSettings(**VALID, num_shares=3, reconstruction_threshold=3)


def test_settings_are_frozen():
    settings = SecureSumSettings(**VALID)

    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.timeout = 1.0  # type: ignore[misc]


def test_settings_that_could_wrap_around_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"1073741824 \* 4 = 4294967296 >= 4294967296") as info:
        SecureSumSettings(
            clipping_range=1.0,
            quantization_range=2**30,
            modulus_range=2**32,
            timeout=10.0,
            max_sites=4,
        )
    assert "Lower quantization_range to 536870912" in str(info.value)
    assert "raise modulus_range to 8589934592" in str(info.value)


def test_even_integer_neighbourhood_is_refused_with_the_odd_fix() -> None:
    # flwr 1.42 widens even neighbourhoods on the coordinator only; every site would fail.
    with pytest.raises(ConfigError, match=r"must be odd.*Use 17"):
        SecureSumSettings(**VALID, num_shares=16, reconstruction_threshold=10)


def test_install_puts_the_vectorised_reconstruction_in_flowers_unmask_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Arrange: restore Flower's own names afterwards
    from flwr.server.workflow.secure_aggregation import secaggplus_workflow

    from dpmtv_common.crypto import shamir
    from server.secagg import install_secure_mask_prg

    names = vars(secaggplus_workflow)
    for name in ("combine_shares", "pseudo_rand_gen"):
        monkeypatch.setitem(names, name, names[name])

    # Act
    install_secure_mask_prg()

    # Assert
    assert names["combine_shares"] is shamir.combine_shares

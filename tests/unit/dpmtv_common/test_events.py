import pytest

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.events import ReleaseEvent


def test_event_json_round_trip():
    event = ReleaseEvent(4.2, picks=8, epsilon_per_pick=0.05)
    assert ReleaseEvent.from_json(event.to_json()) == event


def test_selection_rho_is_k_eps0_squared_over_eight():
    assert ReleaseEvent(None, picks=8, epsilon_per_pick=0.1).selection_rho == pytest.approx(
        8 * 0.01 / 8
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "picks": -1}, "picks"),
        ({"noise_multiplier": 1.0, "picks": 2, "epsilon_per_pick": 0.0}, "epsilon_per_pick"),
        ({"noise_multiplier": None}, "a Gaussian draw, a pick or a distributed sum"),
        ({"noise_multiplier": None, "distributed_rho": 0.1}, "overflow_probability must be > 0"),
        ({"noise_multiplier": 1.0, "distributed_rho": -1.0}, "distributed_rho must be finite"),
    ],
)
def test_invalid_events_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ReleaseEvent(**kwargs)


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"noise_multiplier": 1.0}'])
def test_malformed_event_json_is_refused(text):
    with pytest.raises(ConfigError):
        ReleaseEvent.from_json(text)


def test_a_distributed_event_round_trips_and_a_central_one_keeps_its_three_keys() -> None:
    distributed = ReleaseEvent(
        None, distributed_rho=0.05, distributed_xi=1e-12, overflow_probability=2e-12
    )
    central = ReleaseEvent(3.0, picks=2, epsilon_per_pick=0.1)

    assert ReleaseEvent.from_json(distributed.to_json()) == distributed
    assert sorted(central.to_dict()) == ["epsilon_per_pick", "noise_multiplier", "picks"]

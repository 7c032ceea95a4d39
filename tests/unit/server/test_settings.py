import pytest

from dpmtv_common.errors import ConfigError
from server.settings import CoordinatorSettings, RunConfig

VALID = {"model-fingerprint": "sha256:x", "clip-norm": 1.0}


def test_run_config_refuses_a_federation_of_one():
    with pytest.raises(ConfigError, match="min-sites"):
        RunConfig.from_context({**VALID, "min-sites": 1})


def test_run_config_refuses_unknown_keys_and_lists_the_known_ones():
    with pytest.raises(ConfigError, match="among"):
        RunConfig.from_context({**VALID, "epsilom": 1.0})


def test_run_config_needs_the_model_fingerprint():
    with pytest.raises(ConfigError, match="model-fingerprint"):
        RunConfig.from_context({"clip-norm": 1.0, "model-fingerprint": ""})


def test_candidate_heads_parse_reach_the_plan_and_refuse_garbage():
    config = RunConfig.from_context({**VALID, "candidate-heads": "1:2,0:3,2:0"})
    candidates = config.candidates()
    assert candidates is not None
    assert set(candidates.heads) == {(0, 3), (1, 2), (2, 0)}
    assert RunConfig.from_context(VALID).candidates() is None
    with pytest.raises(ConfigError, match="candidate-heads"):
        RunConfig.from_context({**VALID, "candidate-heads": "a:b"}).candidates()


def test_public_heads_parse_and_refuse_garbage():
    config = RunConfig.from_context({**VALID, "public-heads": "1:2,0:3"})
    heads = config.heads()
    assert heads is not None
    assert heads.heads == ((0, 3), (1, 2))
    with pytest.raises(ConfigError, match="public-heads"):
        RunConfig.from_context({**VALID, "public-heads": "one:two"}).heads()


def test_coordinator_signing_key_must_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("DPMTV_SERVER_SIGNING_KEY", str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match="signing_key"):
        CoordinatorSettings()


@pytest.mark.parametrize(("given", "planned"), [(0, None), (1, 1), (6, 6)])
def test_max_image_crops_reaches_the_plan_and_zero_means_as_shipped(given, planned):
    from server.coordinator import build_plan

    run = RunConfig.from_context({**VALID, "model-fingerprint": "sha256:" + "ab" * 32,
                                  "max-image-crops": given})  # fmt: skip

    assert build_plan(run).max_image_crops == planned


def test_max_image_crops_refuses_a_negative_value_and_the_plan_bounds_it():
    from pydantic import ValidationError

    from server.coordinator import build_plan

    with pytest.raises(ConfigError, match="max-image-crops"):
        RunConfig.from_context({**VALID, "max-image-crops": -1})
    with pytest.raises(ValidationError, match="max_image_crops"):
        build_plan(RunConfig.from_context({**VALID, "max-image-crops": 65}))


def test_candidate_heads_ride_in_the_plan_the_coordinator_builds():
    from server.coordinator import build_plan

    two = {**VALID, "num-selected-heads": 2}
    plan = build_plan(RunConfig.from_context({**two, "candidate-heads": "0:1,2:3,1:0,4:4"}))
    assert plan.candidate_heads == ((0, 1), (1, 0), (2, 3), (4, 4))
    with pytest.raises(ValueError, match="at least num_selected_heads"):
        build_plan(RunConfig.from_context({**two, "candidate-heads": "0:1"}))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"selection": "private"}, "release-first"),
        ({"selection": "public", "public-heads": "0:1,2:3"}, "select-first"),
        ({"selection": "all"}, "select-first"),
        ({"selection": "public", "public-heads": "0:1", "order": "release-first"}, "release-first"),
        ({"selection": "private", "order": "select-first"}, "select-first"),
    ],
)
def test_an_unnamed_order_is_the_selections_default_and_a_named_one_is_kept(config, expected):
    # Public heads select first by default: release-first would noise every layer for them.
    from server.coordinator import build_plan

    run = RunConfig.from_context({**VALID, "model-fingerprint": "sha256:" + "ab" * 32, **config})
    assert build_plan(run).order.value == expected


def test_public_heads_named_release_first_are_warned_in_the_coordinators_log(caplog):
    from server.coordinator import build_plan

    base = {**VALID, "model-fingerprint": "sha256:" + "ab" * 32, "selection": "public",
            "public-heads": "0:1"}  # fmt: skip
    with caplog.at_level("WARNING", logger="server.coordinator"):
        build_plan(RunConfig.from_context(base))
        assert not caplog.records
        build_plan(RunConfig.from_context({**base, "order": "release-first"}))
    assert "release-first with public heads noises every layer" in caplog.text

from pathlib import Path

import pytest

from client.settings import SiteSettings
from dpmtv_common.errors import ConfigError


def test_explicit_values_win_over_environment(monkeypatch):
    # pydantic-settings' default source order: init > env > dotenv > secrets.
    monkeypatch.setenv("DPMTV_CLIENT_NAME", "from-env")
    monkeypatch.setenv("DPMTV_CLIENT_BATCH_SIZE", "7")
    settings = SiteSettings(name="from-init")
    assert settings.name == "from-init"
    assert settings.batch_size == 7


def test_node_config_uses_kebab_keys_and_fills_the_partition(monkeypatch):
    monkeypatch.setenv("DPMTV_CLIENT_DATA_PATH", "/data/site-{partition-id}")
    settings = SiteSettings.from_node_config(
        {
            "partition-id": 2,
            "num-partitions": 3,
            "name": "site-{partition-id}",
            "ledger-path": "/ledgers/site-{partition-id}.sqlite",
            "trusted-keys": "/keys/a.pub, /keys/b.pub",
            "budget-epsilon": 4.0,
        }
    )
    assert settings.name == "site-2"
    assert settings.data_path == Path("/data/site-2")
    assert settings.ledger_path == Path("/ledgers/site-2.sqlite")
    assert settings.trusted_keys == (Path("/keys/a.pub"), Path("/keys/b.pub"))
    assert settings.budget.epsilon == 4.0


def test_trusted_keys_from_the_environment_are_comma_separated(monkeypatch):
    monkeypatch.setenv("DPMTV_CLIENT_TRUSTED_KEYS", "/k/one.pub,/k/two.pub")
    assert SiteSettings().trusted_keys == (Path("/k/one.pub"), Path("/k/two.pub"))


def test_invalid_node_config_is_a_config_error_that_names_the_field():
    with pytest.raises(ConfigError, match="budget_epsilon"):
        SiteSettings.from_node_config({"budget-epsilon": -1.0})


def test_a_dotenv_in_the_working_directory_is_never_read(monkeypatch, tmp_path):
    # Arrange: a .env where the command runs, loosening the site's policy.
    for name in (
        "DPMTV_CLIENT_BUDGET_EPSILON",
        "DPMTV_CLIENT_MIN_SITES",
        "DPMTV_CLIENT_CONFIG_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".env").write_text(
        "DPMTV_CLIENT_BUDGET_EPSILON=1000000\nDPMTV_CLIENT_MIN_SITES=2\n"
        "DPMTV_CLIENT_TRUSTED_KEYS=/tmp/attacker.pub\n"
    )
    monkeypatch.chdir(tmp_path)
    # Act
    settings = SiteSettings()
    # Assert: the defaults, not the file.
    assert settings.budget_epsilon == 10.0
    assert settings.min_sites == 3
    assert settings.trusted_keys == ()


def test_no_settings_source_names_an_implicit_file():
    # Both guards: no env_file in the model config, and no dotenv source in the order.
    assert SiteSettings.model_config.get("env_file") is None


def test_an_explicit_config_file_sits_below_flags_and_environment(monkeypatch, tmp_path):
    # Arrange
    monkeypatch.delenv("DPMTV_CLIENT_CONFIG_FILE", raising=False)
    monkeypatch.delenv("DPMTV_CLIENT_NAME", raising=False)
    config = tmp_path / "conf" / "site.toml"
    config.parent.mkdir()
    config.write_text(
        'name = "from-file"\nbudget-epsilon = 4.0\nbatch_size = 2\n'
        'state-dir = "state"\ntrusted-keys = ["keys/a.pub", "/k/b.pub"]\n'
    )
    monkeypatch.setenv("DPMTV_CLIENT_BATCH_SIZE", "7")
    # Act
    settings = SiteSettings(config_file=config, budget_epsilon=5.0)
    # Assert: flag > environment > file > default; relative paths are the file's.
    assert settings.budget_epsilon == 5.0
    assert settings.batch_size == 7
    assert settings.name == "from-file"
    assert settings.state_dir == tmp_path / "conf" / "state"
    assert settings.trusted_keys == (tmp_path / "conf" / "keys" / "a.pub", Path("/k/b.pub"))


def test_answer_end_sets_come_comma_separated_or_as_a_list_relative_to_the_file(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("DPMTV_CLIENT_CONFIG_FILE", raising=False)
    monkeypatch.setenv("DPMTV_CLIENT_ANSWER_END_FROM", "/p/count,/p/shape")
    assert SiteSettings().answer_end_from == (Path("/p/count"), Path("/p/shape"))
    monkeypatch.delenv("DPMTV_CLIENT_ANSWER_END_FROM")
    config = tmp_path / "site.toml"
    config.write_text('answer-end-from = ["public/count", "/p/shape"]\n')
    assert SiteSettings(config_file=config).answer_end_from == (
        tmp_path / "public" / "count",
        Path("/p/shape"),
    )


def test_the_config_file_may_be_named_by_the_environment(monkeypatch, tmp_path):
    config = tmp_path / "site.toml"
    config.write_text("min-sites = 5\n")
    monkeypatch.setenv("DPMTV_CLIENT_CONFIG_FILE", str(config))
    assert SiteSettings().min_sites == 5


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("budget-epsilo = 4.0\n", "unknown \\['budget_epsilo'\\]"),  # a typo is no silence
        ("config-file = 'other.toml'\n", "unknown \\['config_file'\\]"),
        ("budget-epsilon = \n", "readable TOML"),
    ],
)
def test_a_config_file_with_unknown_keys_or_bad_toml_is_refused(tmp_path, text, match):
    config = tmp_path / "site.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=match):
        SiteSettings(config_file=config)


def test_a_missing_config_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="config_file must be a readable TOML file"):
        SiteSettings(config_file=tmp_path / "absent.toml")


def test_the_service_commands_read_the_config_file_they_are_given(tmp_path, capsys):
    from client.cli.main import main

    config = tmp_path / "site.toml"
    config.write_text('socket-path = "elsewhere.sock"\n')
    assert main(["service-status", "--config", str(config)]) != 0
    assert str(tmp_path / "elsewhere.sock") in capsys.readouterr().err

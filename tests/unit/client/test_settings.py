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

"""In-process sites without a roster get throwaway identity keys that do not outlive them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from client.service.inprocess import InProcessSites, in_process_sites, open_in_process_sites
from client.settings import SiteSettings
from dpmtv_common.errors import ConfigError


def _settings(tmp_path: Path, count: int = 3, **fields) -> list[SiteSettings]:
    return [
        SiteSettings(name=f"site-{i}", state_dir=tmp_path / f"site-{i}", device="cpu", **fields)
        for i in range(count)
    ]


def _keys_folder(sites: InProcessSites) -> Path:
    roster: Path | None = sites.services[0].settings.roster
    assert roster is not None
    return roster.parent


def test_the_keys_folder_holds_a_roster_and_private_keys_until_the_sites_close(tmp_path):
    with in_process_sites(_settings(tmp_path)) as sites:
        folder = _keys_folder(sites)
        names = sorted(p.name for p in folder.iterdir())
        assert names == ["roster.toml"] + [f"site-{i}.identity.key" for i in range(3)]
        assert folder.stat().st_mode & 0o077 == 0  # signing keys: the owner's alone
    assert not folder.exists()


def test_the_keys_folder_stays_while_a_relay_is_held_and_goes_when_none_is(tmp_path):
    sites = open_in_process_sites(_settings(tmp_path))
    folder, relays = _keys_folder(sites), list(sites.relays)
    del sites
    gc.collect()
    assert folder.exists()  # the relays may still be called: their sites read the keys
    del relays
    gc.collect()
    assert not folder.exists()


def test_sites_that_name_their_own_roster_get_no_keys_folder(tmp_path):
    with in_process_sites(_settings(tmp_path)) as first:
        given = first.services[0].settings
        named = _settings(tmp_path / "again", roster=given.roster, identity_key=given.identity_key)
        with in_process_sites(named[:1]) as sites:
            assert sites.keys is None
            assert sites.services[0].settings.roster == given.roster


def test_some_sites_naming_a_roster_and_others_not_is_refused(tmp_path):
    mixed = _settings(tmp_path, count=2)
    mixed[0] = mixed[0].model_copy(
        update={"roster": tmp_path / "r.toml", "identity_key": tmp_path / "k"}
    )
    with pytest.raises(ConfigError, match="all name a roster and identity key, or none"):
        open_in_process_sites(mixed)

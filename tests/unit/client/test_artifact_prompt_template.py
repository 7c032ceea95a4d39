"""Inference applies an artifact only to the model it fits, through every entry point.

Under the chat template its prompts were rendered with, and only with heads the model has
and finite values of its head width: the CLI (``artifact_patch``) and the site service
(``verified_artifact``) ask one function, and both refuse the same artifacts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import client.release.site
from client.activations.hooks import PatchPolicy
from client.cli._artifact import artifact_patch
from client.models import LoadedModel, build_tiny_model, get_adapter, prompt_template_digest
from client.release.site import Site
from client.service.inference import verified_artifact
from client.settings import SiteSettings
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError
from tests.unit.client.signed_artifact import write_signed_artifact

KEY = SigningKey.generate()


@pytest.fixture(scope="module")
def tiny_llava() -> LoadedModel:
    model, processor = build_tiny_model("llava", seed=0)
    return LoadedModel(model, processor, get_adapter("llava"), "sha256:test-llava")


def write(folder: Path, loaded: LoadedModel, template_sha256: str | None) -> Path:
    return write_signed_artifact(
        folder,
        release_id="r-template",
        model_fingerprint=loaded.fingerprint,
        signing_key=KEY,
        protocol_version="4.0",
        prompt_template_sha256=template_sha256,
    )


def apply_with_cli(path: Path, loaded: LoadedModel, tmp_path: Path, monkeypatch) -> object:
    return artifact_patch(
        path,
        loaded=loaded,
        keys=TrustedKeys([KEY.verify_key]),
        policy=PatchPolicy.PROMPT_LAST_TOKEN,
        instruction=None,
    )


def apply_with_service(path: Path, loaded: LoadedModel, tmp_path: Path, monkeypatch) -> object:
    KEY.verify_key.save(tmp_path / "site.pub", overwrite=True)
    monkeypatch.setattr(client.release.site, "cached_model", lambda settings: loaded)
    site = Site(SiteSettings(state_dir=tmp_path / "state", trusted_keys=(tmp_path / "site.pub",)))
    return verified_artifact(site, path)


APPLY = {"cli": apply_with_cli, "service": apply_with_service}


@pytest.mark.parametrize("entry", sorted(APPLY))
def test_an_artifact_of_another_template_is_refused(tiny_llava, tmp_path, monkeypatch, entry):
    path = write(tmp_path, tiny_llava, "0" * 64)

    with pytest.raises(ConfigError, match=r"chat template must be .*sha256 0{64}"):
        APPLY[entry](path, tiny_llava, tmp_path, monkeypatch)


@pytest.mark.parametrize("entry", sorted(APPLY))
@pytest.mark.parametrize("recorded", ["own", None], ids=["own-digest", "made-before-the-field"])
def test_an_artifact_of_the_model_s_template_or_of_none_applies(
    tiny_llava, tmp_path, monkeypatch, entry, recorded
):
    digest = prompt_template_digest(tiny_llava) if recorded == "own" else None
    path = write(tmp_path, tiny_llava, digest)

    assert APPLY[entry](path, tiny_llava, tmp_path, monkeypatch) is not None


@pytest.mark.parametrize("entry", sorted(APPLY))
@pytest.mark.parametrize(
    ("heads", "width", "match"),
    [
        (((0, 1), (40, 0)), 16, r"heads must exist in the model's layers .* got \(40, 0\)"),
        (((0, 1), (1, 99)), 16, r"heads must exist .* got \(1, 99\)"),
        (((0, 1), (1, 2)), 8, r"values must have shape \(2, 16\), got \(2, 8\)"),
    ],
    ids=["no-such-layer", "no-such-head", "another-head-width"],
)
def test_an_artifact_the_model_cannot_hold_is_refused(
    tiny_llava, tmp_path, monkeypatch, entry, heads, width, match
):
    path = write_signed_artifact(
        tmp_path,
        release_id="r-heads",
        model_fingerprint=tiny_llava.fingerprint,
        signing_key=KEY,
        protocol_version="4.0",
        heads=heads,
        values=np.full((len(heads), width), 0.1, dtype=np.float32),
    )

    with pytest.raises(ConfigError, match=match):
        APPLY[entry](path, tiny_llava, tmp_path, monkeypatch)

"""``dpmtv-site ask``: the service prompts queries under the stored artifact's crop cap."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import client.service.inference as service_inference
import client.site
from client.models import LoadedModel
from client.service.inference import InferRequest, answer_queries
from client.settings import SiteSettings
from client.site import Site
from dpmtv_common.artifact import ReleaseDescription, write_artifact
from dpmtv_common.crypto import SigningKey
from dpmtv_common.heads import HeadSet
from tests.unit.client.test_image_crops import _idefics_tiles, splitting_model


def store_artifact(site: Site, loaded: LoadedModel, key: SigningKey, cap: int | None) -> None:
    plan = {"shots": 2} if cap is None else {"shots": 2, "max_image_crops": cap}
    release = ReleaseDescription(
        protocol_version="1.0",
        release_id="r-ask",
        model_fingerprint=loaded.fingerprint,
        task="shapes",
        plan=plan,
        epsilon=1.0,
        delta=1e-5,
        accountant="rdp",
        accountant_parameters={},
        num_chunks=4,
        shots=2,
        clip_norm=1.0,
        noise_std=1.0,
    )
    heads = HeadSet.of([(0, 1), (1, 2)])
    write_artifact(
        site.settings.artifacts_folder / "r-ask",
        heads=heads,
        values=np.full((2, 16), 0.1, dtype=np.float32),
        release=release,
        signing_key=key,
    )


@pytest.mark.parametrize("cap", [None, 1, 5])
def test_ask_prompts_queries_under_the_artifact_s_cap(tmp_path, monkeypatch, cap):
    # Arrange: a site whose model splits images as SmolVLM ships (17 crops)
    key = SigningKey.generate()
    key.verify_key.save(tmp_path / "site.pub")
    loaded = splitting_model("smolvlm", _idefics_tiles)
    monkeypatch.setattr(client.site, "cached_model", lambda settings: loaded)
    site = Site(SiteSettings(state_dir=tmp_path / "state", trusted_keys=(tmp_path / "site.pub",)))
    store_artifact(site, loaded, key, cap)
    seen: list[LoadedModel] = []
    from client.inference import generate_answers as generate

    def spy(model: LoadedModel, prompts, **kwargs):
        seen.append(model)
        return generate(model, prompts, **kwargs)

    monkeypatch.setattr(service_inference, "generate_answers", spy)
    png = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(png, format="PNG")

    # Act
    answers = answer_queries(
        site,
        InferRequest(
            release_id="r-ask",
            questions=("What colour?",),
            images=(png.getvalue(),),
            max_new_tokens=2,
        ),
    )

    # Assert
    (model,) = seen
    assert len(answers.answers) == 1
    assert model.max_image_crops == cap
    assert (model is loaded) == (cap is None)

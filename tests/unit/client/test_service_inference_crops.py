"""``dpmtv-site ask``: the service prompts queries under the stored artifact's crop cap."""

from __future__ import annotations

import io

import pytest
from PIL import Image

import client.release.site
import client.service.inference as service_inference
from client.models import LoadedModel
from client.release.site import Site
from client.service.inference import InferRequest, answer_queries
from client.settings import SiteSettings
from dpmtv_common.crypto import SigningKey
from tests.unit.client.signed_artifact import write_signed_artifact
from tests.unit.client.test_image_crops import _idefics_tiles, splitting_model


def store_artifact(site: Site, loaded: LoadedModel, key: SigningKey, cap: int | None) -> None:
    write_signed_artifact(
        site.settings.artifacts_folder,
        release_id="r-ask",
        model_fingerprint=loaded.fingerprint,
        signing_key=key,
        protocol_version="1.0",
        plan={"shots": 2} if cap is None else {"shots": 2, "max_image_crops": cap},
    )


@pytest.mark.parametrize("cap", [None, 1, 5])
def test_ask_prompts_queries_under_the_artifact_s_cap(tmp_path, monkeypatch, cap):
    # Arrange: a site whose model splits images as SmolVLM ships (17 crops)
    key = SigningKey.generate()
    key.verify_key.save(tmp_path / "site.pub")
    loaded = splitting_model("smolvlm", _idefics_tiles)
    monkeypatch.setattr(client.release.site, "cached_model", lambda settings: loaded)
    site = Site(SiteSettings(state_dir=tmp_path / "state", trusted_keys=(tmp_path / "site.pub",)))
    store_artifact(site, loaded, key, cap)
    seen: list[LoadedModel] = []
    from client.inference.answers import generate_answers as generate

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

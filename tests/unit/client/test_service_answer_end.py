"""The service's answer's end: learnt once from the site's public sets, the same at every entry.

Three entries patch a stored artifact: the CLI (``artifact_patch``), the service's ``ask``
(``answer_queries``) and its HTTP endpoint (``ReleaseCatalogue.patch``).
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

import client.release.site
import client.service.answer_ends as answer_ends_module
import client.service.inference as service_inference
from client.activations.hooks import PatchPolicy
from client.cli._artifact import artifact_patch
from client.data.records import load_dataset, write_jsonl_dataset
from client.inference.answer_end import learn_answer_end
from client.models import LoadedModel, build_tiny_model, get_adapter
from client.release.site import Site
from client.service.answer_ends import AnswerEnds
from client.service.inference import InferRequest, answer_queries
from client.service.releases import ReleaseCatalogue
from client.settings import SiteSettings
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from tests.unit.client.signed_artifact import write_signed_artifact

KEY = SigningKey.generate()
RELEASE = "r-answer-end"
HEADS = ((0, 1), (1, 2))


def letters_set(root: Path, count: int) -> Path:
    """A labelled public set of another task: each image answered by one letter."""
    root.mkdir(parents=True)
    rows = []
    for i in range(count):
        Image.new("RGB", (56, 56), (20 * i, 120, 200)).save(root / f"{i:02d}.png")
        rows.append({"id": f"l{i}", "image": f"{i:02d}.png", "question": "Which letter?",
                     "answer": "abcdef"[i % 6]})  # fmt: skip
    return write_jsonl_dataset(root, rows, task="letters")


@pytest.fixture(scope="module")
def tiny_llava() -> LoadedModel:
    model, processor = build_tiny_model("llava", seed=0)
    return LoadedModel(model, processor, get_adapter("llava"), "sha256:test-llava")


@pytest.fixture
def public(tmp_path: Path) -> Path:
    return letters_set(tmp_path / "public-letters", 9)


def make_site(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loaded: LoadedModel, **settings: Any
) -> Site:
    tmp_path.mkdir(parents=True, exist_ok=True)
    KEY.verify_key.save(tmp_path / "site.pub", overwrite=True)
    monkeypatch.setattr(client.release.site, "cached_model", lambda _: loaded)
    site = Site(
        SiteSettings(
            state_dir=tmp_path / "state", trusted_keys=(tmp_path / "site.pub",), **settings
        )
    )
    write_signed_artifact(site.settings.artifacts_folder, release_id=RELEASE,
                          model_fingerprint=loaded.fingerprint, signing_key=KEY,
                          protocol_version="1.0", heads=HEADS)  # fmt: skip
    return site


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(out, format="PNG")
    return out.getvalue()


def asked_patch(site: Site, monkeypatch: pytest.MonkeyPatch, policy: str) -> Any:
    """The patch ``ask`` answers with (generation itself is not run)."""
    seen: list[Any] = []

    def spy(loaded: LoadedModel, prompts: Any, **kwargs: Any) -> list[str]:
        seen.append(kwargs["patch"])
        return ["a"] * len(prompts)

    monkeypatch.setattr(service_inference, "generate_answers", spy)
    request = InferRequest(
        release_id=RELEASE, questions=("Which?",), images=(png(),), policy=policy
    )
    answer_queries(site, request, AnswerEnds(site.settings))
    return seen[0]


def test_every_entry_patches_the_answer_end_learnt_from_the_public_sets(
    tmp_path, monkeypatch, tiny_llava, public
):
    # Arrange
    site = make_site(tmp_path, monkeypatch, tiny_llava, answer_end_from=(public,))
    expected = learn_answer_end(
        tiny_llava, [load_dataset(public)], HeadSet.of(list(HEADS)), shots=2
    ).values
    # Act
    cli = artifact_patch(
        site.settings.artifacts_folder / RELEASE, loaded=tiny_llava,
        keys=TrustedKeys.from_files(site.settings.trusted_keys),
        policy=PatchPolicy.PROMPT_LAST_TOKEN, instruction=None, answer_end_from=(public,),
    )  # fmt: skip
    ask = asked_patch(site, monkeypatch, "prompt-last-token")
    catalogue = ReleaseCatalogue(site, answer_ends=AnswerEnds(site.settings))
    http, _ = catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=None)
    # Assert
    assert http is not None
    for patch in (cli, ask, http):
        assert patch.answer_end is not None
        assert torch.equal(patch.answer_end, expected)


def test_every_call_requests_and_a_site_without_public_sets_take_no_answer_end(
    tmp_path, monkeypatch, tiny_llava, public
):
    with_sets = make_site(tmp_path / "a", monkeypatch, tiny_llava, answer_end_from=(public,))
    without = make_site(tmp_path / "b", monkeypatch, tiny_llava)

    every_call, _ = ReleaseCatalogue(with_sets, answer_ends=AnswerEnds(with_sets.settings)).patch(
        RELEASE, PatchPolicy.EVERY_CALL, instruction=None
    )
    none_named, _ = ReleaseCatalogue(without, answer_ends=AnswerEnds(without.settings)).patch(
        RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=None
    )

    assert every_call is not None
    assert every_call.answer_end is None
    assert none_named is not None
    assert none_named.answer_end is None
    assert asked_patch(with_sets, monkeypatch, "every-call").answer_end is None


def test_the_answer_end_is_learnt_once_per_release(tmp_path, monkeypatch, tiny_llava, public):
    site = make_site(tmp_path, monkeypatch, tiny_llava, answer_end_from=(public,))
    calls: list[object] = []
    learn = learn_answer_end

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return learn(*args, **kwargs)

    monkeypatch.setattr(answer_ends_module, "learn_answer_end", counted)
    catalogue = ReleaseCatalogue(site, answer_ends=AnswerEnds(site.settings))

    for _ in range(3):
        catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=None)

    assert len(calls) == 1


def test_a_service_refuses_its_private_data_named_as_answer_end_public_data(tmp_path, public):
    settings = SiteSettings(state_dir=tmp_path, data_path=public, answer_end_from=(public,))

    with pytest.raises(ConfigError, match="must be PUBLIC data, got the site's private data"):
        AnswerEnds(settings)


def test_a_learnt_answer_end_is_read_while_the_model_is_busy(
    tmp_path, monkeypatch, tiny_llava, public
):
    # Arrange: the end learnt once, then the model lock held (a forward pass under way)
    site = make_site(tmp_path, monkeypatch, tiny_llava, answer_end_from=(public,))
    model_lock = threading.Lock()
    answer_ends = AnswerEnds(site.settings)
    catalogue = ReleaseCatalogue(site, model_lock=model_lock, answer_ends=answer_ends)
    catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=None)
    done = threading.Event()

    def prepare() -> None:
        catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=None)
        done.set()

    # Act
    with model_lock:
        worker = threading.Thread(target=prepare, daemon=True)
        worker.start()
        # Assert: a request's preparation does not wait for the model
        assert done.wait(30)

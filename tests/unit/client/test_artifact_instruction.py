"""Inference applies an artifact only to queries that carry the instruction its prompts did.

Three entries: the CLI (``infer`` and ``evaluate`` go through ``artifact_patch``), the
service's ``ask`` (``answer_queries``) and its HTTP endpoint (``ReleaseCatalogue.patch``).
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import client.release.site
import client.service.inference as service_inference
import client.service.releases as releases
from client.activations.hooks import PatchPolicy
from client.cli._artifact import artifact_patch
from client.models import LoadedModel, build_tiny_model, get_adapter, instruction_digest
from client.release.site import Site
from client.service.inference import InferRequest, answer_queries
from client.service.releases import RECHECK_S, ReleaseCatalogue, UnknownModelError
from client.settings import SiteSettings
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError
from tests.unit.client.signed_artifact import write_signed_artifact

KEY = SigningKey.generate()
RELEASE = "r-instruction"
INSTRUCTION = "Answer with one word."


class FakeClock:
    """Monotonic seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny_llava() -> LoadedModel:
    model, processor = build_tiny_model("llava", seed=0)
    return LoadedModel(model, processor, get_adapter("llava"), "sha256:test-llava")


@pytest.fixture
def site(tiny_llava: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Site:
    KEY.verify_key.save(tmp_path / "site.pub", overwrite=True)
    monkeypatch.setattr(client.release.site, "cached_model", lambda settings: tiny_llava)
    return Site(SiteSettings(state_dir=tmp_path / "state", trusted_keys=(tmp_path / "site.pub",)))


def store(site: Site, instruction_sha256: str | None) -> Path:
    """A signed artifact in the site's folder whose manifest records ``instruction_sha256``."""
    return write_signed_artifact(
        site.settings.artifacts_folder,
        release_id=RELEASE,
        model_fingerprint=site.model().fingerprint,
        signing_key=KEY,
        protocol_version="5.0",
        instruction_sha256=instruction_sha256,
    )


def apply_with_cli(site: Site, path: Path, instruction: str | None) -> object:
    keys = TrustedKeys([KEY.verify_key])
    policy = PatchPolicy.PROMPT_LAST_TOKEN
    return artifact_patch(
        path, loaded=site.model(), keys=keys, policy=policy, instruction=instruction
    )


def apply_with_ask(site: Site, path: Path, instruction: str | None) -> object:
    png = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(png, format="PNG")
    request = InferRequest(
        release_id=RELEASE,
        questions=("What colour?",),
        images=(png.getvalue(),),
        instruction=instruction,
        max_new_tokens=1,
    )
    return answer_queries(site, request)


def apply_with_http(site: Site, path: Path, instruction: str | None) -> object:
    catalogue = ReleaseCatalogue(site)
    return catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=instruction)


APPLY: dict[str, Callable[[Site, Path, str | None], object]] = {
    "cli": apply_with_cli,
    "ask": apply_with_ask,
    "http": apply_with_http,
}


@pytest.fixture
def generated(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments ``ask`` generates with (no generation runs)."""
    calls: list[dict[str, Any]] = []

    def spy(loaded: LoadedModel, prompts: Any, **kwargs: Any) -> list[str]:
        calls.append(kwargs)
        return ["red"] * len(prompts)

    monkeypatch.setattr(service_inference, "generate_answers", spy)
    return calls


@pytest.mark.parametrize("entry", sorted(APPLY))
@pytest.mark.parametrize(
    ("made_with", "queried_with"),
    [(INSTRUCTION, None), (None, INSTRUCTION), (INSTRUCTION, INSTRUCTION + " ")],
    ids=["queries-without-it", "queries-with-one-it-lacked", "another-text"],
)
def test_an_artifact_of_another_instruction_is_refused_naming_both_digests(
    site, generated, entry, made_with, queried_with
):
    # Arrange
    expected, found = instruction_digest(made_with), instruction_digest(queried_with)
    path = store(site, expected)

    # Act / Assert
    with pytest.raises(ConfigError, match="instruction must be the one") as info:
        APPLY[entry](site, path, queried_with)
    assert f"sha256 {expected}" in str(info.value)
    assert f"sha256 {found}" in str(info.value)
    assert not generated


@pytest.mark.parametrize("entry", sorted(APPLY))
@pytest.mark.parametrize(
    ("recorded", "queried_with"),
    [("own", INSTRUCTION), ("own", None), ("own", ""), (None, INSTRUCTION)],
    ids=["same-text", "none", "empty-as-none", "made-before-the-field"],
)
def test_an_artifact_of_the_queries_instruction_or_of_none_applies(
    site, generated, entry, recorded, queried_with
):
    digest = instruction_digest(queried_with) if recorded == "own" else None
    path = store(site, digest)

    assert APPLY[entry](site, path, queried_with) is not None


def test_ask_prompts_its_queries_with_the_instruction_it_was_given(site, generated):
    path = store(site, instruction_digest(INSTRUCTION))

    apply_with_ask(site, path, INSTRUCTION)

    assert [call["instruction"] for call in generated] == [INSTRUCTION]


def test_the_plain_model_is_served_under_any_instruction(site):
    store(site, instruction_digest(INSTRUCTION))

    patch, crops = ReleaseCatalogue(site).patch(
        "dpmtv/plain", PatchPolicy.PROMPT_LAST_TOKEN, instruction="Anything."
    )

    assert (patch, crops) == (None, None)


@pytest.mark.parametrize("change", ["mtime", "size"])
def test_an_artifact_rewritten_in_place_after_it_was_served_is_verified_again(
    site, tmp_path, change
):
    # Arrange: a release served once (and kept verified), then its files rewritten under the
    # same names: another instruction's (same sizes, a later mtime), or one byte more in one
    # file with its old mtime put back (a tampered artifact)
    folder = store(site, instruction_digest(INSTRUCTION))
    clock = FakeClock()
    catalogue = ReleaseCatalogue(site, clock=clock)
    assert catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    times = {p: p.stat().st_mtime_ns for p in files}
    if change == "mtime":
        other = write_signed_artifact(
            tmp_path / "other", release_id=RELEASE, model_fingerprint=site.model().fingerprint,
            signing_key=KEY, protocol_version="5.0",
            instruction_sha256=instruction_digest(INSTRUCTION + " "),
        )  # fmt: skip
        for path in files:
            path.write_bytes((other / path.name).read_bytes())
            os.utime(path, ns=(times[path] + 10**9, times[path] + 10**9))
        expected: type[Exception] = ConfigError  # the new manifest's instruction
    else:
        with files[0].open("ab") as handle:
            handle.write(b"\0")
        os.utime(files[0], ns=(times[files[0]], times[files[0]]))
        expected = UnknownModelError  # no longer verifies

    # Act / Assert: once the recheck interval has passed, the change is seen, not the
    # verified copy served
    clock.now += RECHECK_S
    with pytest.raises(expected):
        catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)


def tamper(folder: Path) -> None:
    """One byte more in one of the artifact's files, its modification time kept."""
    first = sorted(p for p in folder.iterdir() if p.is_file())[0]
    mtime = first.stat().st_mtime_ns
    with first.open("ab") as handle:
        handle.write(b"\0")
    os.utime(first, ns=(mtime, mtime))


def test_a_verified_artifact_is_looked_at_once_a_recheck_interval_not_every_request(
    site, monkeypatch
):
    # Arrange: a release served once, then tampered with; every look at its files counted
    folder = store(site, instruction_digest(INSTRUCTION))
    clock = FakeClock()
    catalogue = ReleaseCatalogue(site, clock=clock)
    assert catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    looks: list[Path] = []
    stamp = releases._stamp

    def looking(path: Path) -> Any:
        looks.append(path)
        return stamp(path)

    monkeypatch.setattr(releases, "_stamp", looking)
    tamper(folder)

    # Act / Assert: within the interval, requests get the copy verified before and the disk
    # is not touched; the first request after it looks, sees the change and refuses
    for _ in range(5):
        clock.now += RECHECK_S / 10
        assert catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    assert looks == []
    clock.now += RECHECK_S / 2
    with pytest.raises(UnknownModelError):
        catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    assert looks == [folder]


def test_an_unchanged_artifact_is_not_verified_again_after_a_recheck(site, monkeypatch):
    # Arrange: a release served once; its verification counted from then on
    store(site, instruction_digest(INSTRUCTION))
    clock = FakeClock()
    catalogue = ReleaseCatalogue(site, clock=clock)
    assert catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    loads: list[str] = []
    load = releases._load_patch

    def loading(site: Site, folder: Path, release: str) -> Any:
        loads.append(release)
        return load(site, folder, release)

    monkeypatch.setattr(releases, "_load_patch", loading)

    # Act: requests across three recheck intervals, files unchanged
    for _ in range(6):
        clock.now += RECHECK_S / 2
        assert catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)

    # Assert: the files were looked at, the artifact not verified again
    assert loads == []


def test_a_removed_release_is_refused_once_the_recheck_interval_has_passed(site):
    # Arrange: a release served once, then its folder removed
    folder = store(site, instruction_digest(INSTRUCTION))
    clock = FakeClock()
    catalogue = ReleaseCatalogue(site, clock=clock)
    assert catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    shutil.rmtree(folder)

    # Act / Assert: refused after the interval, and listed no more
    clock.now += RECHECK_S
    with pytest.raises(UnknownModelError):
        catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    assert RELEASE not in catalogue.model_ids()


def test_a_recheck_interval_of_zero_looks_at_the_files_at_every_request(site):
    folder = store(site, instruction_digest(INSTRUCTION))
    catalogue = ReleaseCatalogue(site, recheck_s=0, clock=FakeClock())
    assert catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)
    tamper(folder)
    with pytest.raises(UnknownModelError):
        catalogue.patch(RELEASE, PatchPolicy.PROMPT_LAST_TOKEN, instruction=INSTRUCTION)


@pytest.mark.parametrize("recheck_s", [-1.0, float("nan")])
def test_a_recheck_interval_below_zero_is_refused(site, recheck_s):
    with pytest.raises(ConfigError, match="recheck_s must be at least 0 seconds"):
        ReleaseCatalogue(site, recheck_s=recheck_s)

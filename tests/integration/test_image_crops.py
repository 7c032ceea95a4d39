"""A crop cap end to end on a tiny SmolVLM that splits as shipped: check, select, release, infer.

SmolVLM's processor, as shipped, upscales a small image and cuts it into 4 x 4 tiles plus a
global view (17 crops). The cap travels select-heads -> heads file -> release plan -> signed
artifact -> infer, and each step prompts under it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from client.cli import main
from client.models import Example, LoadedModel, Prompt, build_tiny_model
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys, VerifyKey
from tests.integration.test_site_cli import clean_site_env, run_ok, write_shapes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@dataclass(frozen=True)
class Space:
    root: Path
    model: Path
    key: Path
    public_key: Path
    private: Path
    public: Path

    def model_args(self) -> list[str]:
        return ["--model", str(self.model), "--device", "cpu", "--batch-size", "2"]


def save_splitting_smolvlm(directory: Path) -> None:
    model, processor = build_tiny_model("smolvlm", seed=0)
    processor.image_processor.do_image_splitting = True  # as SmolVLM ships
    processor.image_processor.size = {"longest_edge": 4 * 56}
    model.save_pretrained(directory)
    processor.save_pretrained(directory)


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Space]:
    root = tmp_path_factory.mktemp("crops")
    with pytest.MonkeyPatch.context() as mp:
        clean_site_env(mp, root)
        save_splitting_smolvlm(root / "model")
        run_ok(["keygen", "--out-dir", str(root / "keys"), "--name", "site"])
        yield Space(
            root,
            root / "model",
            root / "keys" / "site.key",
            root / "keys" / "site.pub",
            write_shapes(root / "private", 9),
            write_shapes(root / "public", 6, offset=100),
        )


@pytest.fixture(autouse=True)
def site_env(space: Space, monkeypatch: pytest.MonkeyPatch) -> None:
    clean_site_env(monkeypatch, space.root)


def zero_shot_tokens(printed: str) -> int:
    match = re.search(r"zero-shot prompt: (\d+) tokens", printed)
    assert match is not None, printed
    return int(match.group(1))


def test_data_check_reports_prompt_lengths_under_the_cap(space, capsys):
    # Act
    run_ok(["data", "check", str(space.private), *space.model_args(), "--shots", "2"])
    shipped = capsys.readouterr().out
    run_ok(
        ["data", "check", str(space.private), *space.model_args(), "--shots", "2",
         "--max-image-crops", "1"]
    )  # fmt: skip
    capped = capsys.readouterr().out

    # Assert: 17 crops of 4 image tokens (plus markers) against one crop
    assert "image crops: as the processor ships" in shipped
    assert "image crops: at most 1 an image" in capped
    assert zero_shot_tokens(shipped) > zero_shot_tokens(capped) + 16 * 4


def test_the_cap_goes_from_select_heads_through_the_release_into_infer(space, capsys, monkeypatch):
    # Arrange
    heads_file, artifact = space.root / "heads.json", space.root / "artifact"
    common = [*space.model_args(), "--shots", "2", "--quiet"]
    release = [
        "release", *common, "--data", str(space.private), "--out", str(artifact),
        "--selection", "public", "--public-heads", str(heads_file),
        "--ledger", str(space.root / "ledger.sqlite"), "--signing-key", str(space.key),
    ]  # fmt: skip

    # Act: public heads under a cap of 1, then a release that forgets the cap
    run_ok(
        ["select-heads", *space.model_args(), "--data", str(space.public), "--out",
         str(heads_file), "--k", "2", "--shots", "2", "--queries", "2", "--max-image-crops", "1"]
    )  # fmt: skip
    forgot = main(release)
    refusal = capsys.readouterr().err
    run_ok([*release, "--max-image-crops", "1"])

    # Assert: the heads file states its cap; a release under another cap is refused
    assert json.loads(heads_file.read_text())["max_image_crops"] == 1
    assert forgot == 2
    assert "--max-image-crops must be the cap the public heads were selected under" in refusal
    manifest = load_artifact(
        artifact,
        trusted_keys=TrustedKeys([VerifyKey.load(space.public_key)]),
        expected_model_fingerprint=None,
    ).manifest
    assert manifest.max_image_crops == 1
    assert manifest.plan["max_image_crops"] == 1

    # Act: infer with the artifact; record the model each query is prompted with
    import client.inference.answers

    seen: list[LoadedModel] = []
    generate = client.inference.answers.generate_answers

    def spy(loaded: LoadedModel, prompts, **kwargs):
        seen.append(loaded)
        return generate(loaded, prompts, **kwargs)

    monkeypatch.setattr(client.inference.answers, "generate_answers", spy)
    image = next(space.private.glob("*.png"))
    run_ok(
        ["infer", *space.model_args(), "--artifact", str(artifact), "--trusted-key",
         str(space.public_key), "--image", str(image), "--question", "What colour?"]
    )  # fmt: skip

    # Assert: the query was prompted under the artifact's cap: one crop, not 17
    (loaded,) = seen
    assert loaded.max_image_crops == 1
    from client.data.records import read_rgb

    inputs = loaded.adapter.build_batch_inputs(
        loaded.processor, [Prompt.of([], Example(read_rgb(image), "What colour?"))]
    )
    assert inputs["pixel_values"].shape[1] == 1


def test_evaluate_refuses_a_cap_other_than_the_artifact_s(space, capsys):
    # Arrange: an artifact made without a cap (the processor as shipped)
    artifact = space.root / "uncapped"
    run_ok(
        ["release", *space.model_args(), "--data", str(space.private), "--out", str(artifact),
         "--shots", "2", "--selection", "all", "--clip-norm", "1.0", "--quiet",
         "--ledger", str(space.root / "ledger2.sqlite"), "--signing-key", str(space.key)]
    )  # fmt: skip

    # Act
    code = main(
        ["evaluate", *space.model_args(), "--data", str(space.public), "--mode", "artifact",
         "--artifact", str(artifact), "--trusted-key", str(space.public_key), "--limit", "1",
         "--max-image-crops", "2"]
    )  # fmt: skip

    # Assert
    assert code == 2
    assert "--max-image-crops must be the artifact's None" in capsys.readouterr().err

"""``dpmtv-site`` end to end on a tiny model: public selection, two releases, use, ledger."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from client.cli import main
from client.data.records import write_jsonl_dataset
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys, VerifyKey
from dpmtv_common.heads import HeadSet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
COLOURS = ("red", "blue", "green", "yellow", "purple")
SHAPES = ("circle", "square")
QUESTION = "What colour is the shape?"


@dataclass(frozen=True)
class Workspace:
    root: Path
    model: Path
    other_model: Path
    signing_key: Path
    public_key: Path
    stranger_key: Path
    private: Path
    public: Path
    test: Path
    artifact: Path  # a release made by the fixture, for the error cases

    def model_args(self, model: Path | None = None) -> list[str]:
        return ["--model", str(model or self.model), "--device", "cpu", "--batch-size", "4"]


def write_shapes(root: Path, count: int, *, offset: int = 0) -> Path:
    """``count`` drawn coloured shapes answered by their colour."""
    root.mkdir(parents=True)
    rows = []
    for i in range(offset, offset + count):
        colour, shape = COLOURS[i % len(COLOURS)], SHAPES[(i // len(COLOURS)) % 2]
        image = Image.new("RGB", (56 + 4 * (i % 3), 56), "white")
        box = (6, 8, 44, 46)
        canvas = ImageDraw.Draw(image)
        (canvas.ellipse if shape == "circle" else canvas.rectangle)(box, fill=colour)
        image.save(root / f"{i:03d}.png")
        rows.append(
            {"id": f"x{i}", "image": f"{i:03d}.png", "question": QUESTION, "answer": colour}
        )
    return write_jsonl_dataset(root, rows, task="shapes")


def clean_site_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    """Offline, no DPMTV_CLIENT_* from the caller's shell, no stray .env: only our flags count."""
    mp.setenv("HF_HUB_OFFLINE", "1")
    for name in list(os.environ):
        if name.startswith("DPMTV_CLIENT_"):
            mp.delenv(name)
    mp.chdir(root)


def run_ok(argv: list[str]) -> None:
    assert main(argv) == 0, f"dpmtv-site {' '.join(argv)} failed"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    root = tmp_path_factory.mktemp("site")
    with pytest.MonkeyPatch.context() as mp:
        clean_site_env(mp, root)
        run_ok(["make-tiny-model", "llava", str(root / "model"), "--seed", "0"])
        run_ok(["make-tiny-model", "llava", str(root / "other-model"), "--seed", "1"])
        run_ok(["keygen", "--out-dir", str(root / "keys"), "--name", "site"])
        run_ok(["keygen", "--out-dir", str(root / "keys"), "--name", "stranger"])
        space = Workspace(
            root=root,
            model=root / "model",
            other_model=root / "other-model",
            signing_key=root / "keys" / "site.key",
            public_key=root / "keys" / "site.pub",
            stranger_key=root / "keys" / "stranger.pub",
            private=write_shapes(root / "private", 30),
            public=write_shapes(root / "public", 15, offset=100),
            test=write_shapes(root / "test", 6, offset=200),
            artifact=root / "fixture-artifact",
        )
        run_ok(
            [
                "release",
                *space.model_args(),
                "--data", str(space.private),
                "--out", str(space.artifact),
                "--selection", "all",
                "--clip-norm", "1.0",
                "--shots", "2",
                "--ledger", str(root / "fixture-ledger.sqlite"),
                "--signing-key", str(space.signing_key),
                "--quiet",
            ]
        )  # fmt: skip
        yield space


@pytest.fixture(autouse=True)
def site_env(workspace: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    clean_site_env(monkeypatch, workspace.root)


def number_after(label: str, text: str) -> float:
    match = re.search(rf"{re.escape(label)}\s*([-+0-9.eE]+)", text)
    assert match is not None, f"{label!r} not in {text!r}"
    return float(match.group(1))


def test_select_heads_for_a_planned_release_scores_every_bound_with_its_noise(workspace, capsys):
    # Arrange
    ws, heads_file = workspace, workspace.root / "planned-heads.json"

    # Act
    code = main(
        [
            "select-heads", *ws.model_args(), "--data", str(ws.public), "--out", str(heads_file),
            "--k", "3", "--shots", "2", "--queries", "4",
            "--for-epsilon", "1", "--for-chunks", "40",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert: every factor was tried (no early stop); the smallest near the best was chosen
    assert code == 0
    selected = json.loads(heads_file.read_text())
    accuracy = selected["clip_norm_public_accuracy"]
    tried = {float(key[:-1]): value for key, value in accuracy.items() if key.endswith("x")}
    assert list(tried) == [1.0, 2.0, 4.0, 8.0, 16.0]
    near_best = accuracy["zero_shot"] + 0.9 * (max(tried.values()) - accuracy["zero_shot"])
    factor = round(selected["clip_norm_suggestion"] / selected["clip_norm_median"], 6)
    assert tried[factor] >= near_best
    assert all(value < near_best for f, value in tried.items() if f < factor)
    assert "m = 40" in selected["clip_norm_rule"]
    assert "planned release's noise: m = 40" in printed


def test_site_commands_select_release_infer_evaluate_and_show_the_ledger(workspace, capsys):
    # Arrange
    ws, out = workspace, workspace.root / "run"
    ledger = out / "ledger.sqlite"
    heads_file = out / "heads.json"
    out.mkdir()

    # Act: select heads on the public set
    code = main(
        [
            "select-heads", *ws.model_args(),
            "--data", str(ws.public), "--out", str(heads_file),
            "--k", "3", "--shots", "2", "--queries", "4",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert
    assert code == 0
    selected = json.loads(heads_file.read_text())
    clip = selected["clip_norm_suggestion"]
    assert len(selected["heads"]) == 3
    assert selected["public_chunks"] == 5
    assert clip > 0
    assert (
        f"3 heads over {HeadSet.of(map(tuple, selected['heads'])).num_layers_in_scope}" in printed
    )
    assert number_after("suggested clip norm C =", printed) == pytest.approx(clip, rel=1e-3)
    # the model's own public gain is reported, and called too small exactly when it is
    gain = number_after("unclipped mean", printed) - number_after("zero-shot", printed)
    assert ("this model does not do this task" in printed) == (gain < 0.2), printed

    # Act: a private, select-first release with the suggested clip norm
    common = ["--data", str(ws.private), "--shots", "2", "--epsilon", "0.5", "--quiet"]
    keys = ["--ledger", str(ledger), "--signing-key", str(ws.signing_key)]
    private_artifact, public_artifact = out / "private-artifact", out / "public-artifact"
    code = main(
        [
            "release", *ws.model_args(), *common, *keys,
            "--out", str(private_artifact), "--release-id", "private-1",
            "--selection", "private", "--order", "select-first", "--heads", "3",
            "--clip-norm", f"{clip:.6g}",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert: 30 records in chunks of 3 give m = 10
    assert code == 0
    assert (private_artifact / "manifest.json").is_file()
    assert "released 3 heads" in printed
    assert "m=10 chunks (K=2" in printed
    assert "0 records unused" in printed
    assert 0.4 < number_after("epsilon=", printed) <= 0.5 * (1 + 1e-6)
    assert str(private_artifact) in printed

    # Act: a public release with the selected heads (C from the heads file), in the order
    # the file was chosen for: public heads' default, select-first
    assert selected["release_order"] == "select-first"
    code = main(
        [
            "release", *ws.model_args(), *common, *keys,
            "--out", str(public_artifact), "--release-id", "public-1",
            "--selection", "public", "--public-heads", str(heads_file),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert
    assert code == 0
    assert "released 3 heads" in printed
    assert f"C={clip:g}" in printed
    released = load_artifact(
        public_artifact,
        trusted_keys=TrustedKeys([VerifyKey.load(ws.public_key)]),
        expected_model_fingerprint=None,
    )
    assert [list(h) for h in released.heads.heads] == selected["heads"]
    assert released.manifest.num_chunks == 10
    assert released.manifest.plan["order"] == "select-first"  # only the 3 heads were noised

    # Act: answer one query with the private artifact
    trust = ["--trusted-key", str(ws.public_key), "--max-new-tokens", "4"]
    image = ws.test / "200.png"
    code = main(
        [
            "infer", *ws.model_args(), *trust, "--artifact", str(private_artifact),
            "--image", str(image), "--question", QUESTION,
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert: one answer line
    assert code == 0
    assert printed.count("\n") == 1

    # Act: answer a batch file with the public artifact
    batch = ws.test / "queries.jsonl"
    batch.write_text(
        "".join(json.dumps({"image": f"{i}.png", "question": QUESTION}) + "\n" for i in (201, 202))
    )
    code = main(
        [
            "infer",
            *ws.model_args(),
            *trust,
            "--artifact",
            str(public_artifact),
            "--batch",
            str(batch),
        ]
    )
    printed = capsys.readouterr().out

    # Assert: one JSON line a query, in order
    assert code == 0
    answers = [json.loads(line) for line in printed.splitlines()]
    assert [Path(a["image"]).name for a in answers] == ["201.png", "202.png"]
    assert all(a["question"] == QUESTION and isinstance(a["answer"], str) for a in answers)

    # Act: evaluate zero-shot, ICL and the artifact on the test set
    evaluate = ["evaluate", *ws.model_args(), "--data", str(ws.test), "--max-new-tokens", "4"]
    results = {}
    for mode, extra in [
        ("zero-shot", []),
        ("icl", ["--support", str(ws.public), "--shots", "2", "--limit", "3"]),
        ("artifact", ["--artifact", str(public_artifact), "--trusted-key", str(ws.public_key)]),
    ]:
        code = main([*evaluate, "--mode", mode, *extra])
        results[mode] = (code, capsys.readouterr().out)

    # Assert
    for mode, queries in [("zero-shot", 6), ("icl", 3), ("artifact", 6)]:
        code, printed = results[mode]
        assert code == 0
        assert f"over {queries} queries" in printed
        assert 0.0 <= number_after(f"{mode}: accuracy", printed) <= 1.0

    # Act: show the ledger
    code = main(["ledger", "--ledger", str(ledger)])
    printed = capsys.readouterr().out

    # Assert: both releases committed; two releases of epsilon 0.5 compose to at most 1
    assert code == 0
    lines = printed.splitlines()
    assert lines[0] == f"ledger: {ledger} (named)"
    assert [line.split()[:2] for line in lines[1:3]] == [
        ["private-1", "committed"],
        ["public-1", "committed"],
    ]
    assert 0.5 < number_after("spent: epsilon=", printed) <= 1.0 + 1e-6


def infer_argv(ws: Workspace, *, model: Path | None = None, key: Path | None = None) -> list[str]:
    return [
        "infer", *ws.model_args(model), "--artifact", str(ws.artifact),
        "--trusted-key", str(key or ws.public_key),
        "--image", str(ws.test / "200.png"), "--question", QUESTION, "--max-new-tokens", "2",
    ]  # fmt: skip


def test_infer_with_an_artifact_made_for_another_model_exits_2(workspace, capsys):
    # Act
    code = main(infer_argv(workspace, model=workspace.other_model))

    # Assert
    captured = capsys.readouterr()
    assert code == 2
    assert "model_fingerprint" in captured.err
    assert "another model" in captured.err
    assert captured.out == ""


def test_infer_with_an_untrusted_signer_exits_2(workspace, capsys):
    # Act
    code = main(infer_argv(workspace, key=workspace.stranger_key))

    # Assert
    captured = capsys.readouterr()
    assert code == 2
    assert "trusted keys" in captured.err
    assert captured.out == ""


def test_a_private_release_without_clip_norm_exits_2_and_says_how_to_choose_it(workspace, capsys):
    # Arrange
    out = workspace.root / "no-clip"
    ledger = workspace.root / "no-clip.sqlite"

    # Act
    code = main(
        [
            "release", *workspace.model_args(), "--data", str(workspace.private),
            "--out", str(out), "--shots", "2", "--selection", "private",
            "--ledger", str(ledger), "--signing-key", str(workspace.signing_key), "--quiet",
        ]
    )  # fmt: skip

    # Assert
    captured = capsys.readouterr()
    assert code == 2
    assert "--clip-norm is required" in captured.err
    assert "public data" in captured.err
    assert not out.exists()
    assert not ledger.exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--help"],
            ["keygen", "make-tiny-model", "select-heads", "release", "infer", "evaluate", "ledger"],
        ),
        (["release", "--help"], ["--clip-norm", "--selection", "--order", "--ledger", "--quiet"]),
    ],
    ids=["top", "release"],
)
def test_help_runs_as_a_real_process_and_lists_what_there_is(argv, expected):
    # Arrange
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    # Act
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Assert
    assert done.returncode == 0, done.stderr
    assert "usage: dpmtv-site" in done.stdout
    for word in expected:
        assert word in done.stdout


def test_ledger_command_resolves_a_reservation_left_by_a_lost_run(tmp_path, capsys):
    # Arrange: a site reservation owned by a federated run that never finished.
    from dpmtv_common.privacy.budget import PrivacyBudget
    from dpmtv_common.privacy.events import ReleaseEvent
    from dpmtv_common.privacy.ledger import PrivacyLedger

    path = tmp_path / "site.sqlite"
    with PrivacyLedger.open(path, PrivacyBudget(10.0, 1e-5)) as ledger:
        for release_id in ("lost-1", "lost-2"):
            ledger.reserve(
                release_id=release_id,
                plan_hash="h",
                event=ReleaseEvent(4.0),
                epsilon=1.0,
                delta=1e-5,
                accountant="analytic",
                owned_by_run=True,
            )
    # Act
    code = main(["ledger", "--ledger", str(path), "--abort", "lost-1", "--reason", "no noise"])
    code2 = main(["ledger", "--ledger", str(path), "--commit", "lost-2"])
    # Assert
    out = capsys.readouterr().out
    assert (code, code2) == (0, 0)
    assert "lost-1: aborted" in out
    assert "lost-2: committed" in out
    with PrivacyLedger.open(path, PrivacyBudget(10.0, 1e-5)) as ledger:
        states = {e.release_id: e.state.value for e in ledger.releases()}
    assert states == {"lost-1": "aborted", "lost-2": "committed"}


def test_release_draws_its_noise_from_the_cryptographic_source_only(workspace, monkeypatch):
    # Arrange: watch the noise source the command hands to the release flow.
    import client.release.single_holder
    from dpmtv_common.privacy.noise import SecureNoise

    sources = []
    real = client.release.single_holder.run_single_holder_release

    def spy(plan, **kwargs):
        sources.append(kwargs["noise"])
        return real(plan, **kwargs)

    monkeypatch.setattr(client.release.single_holder, "run_single_holder_release", spy)
    out = workspace.root / "noise-source"
    # Act
    code = main(
        [
            "release", *workspace.model_args(), "--data", str(workspace.private),
            "--out", str(out), "--selection", "all", "--clip-norm", "1.0", "--shots", "2",
            "--ledger", str(workspace.root / "noise-source.sqlite"),
            "--signing-key", str(workspace.signing_key), "--quiet",
        ]
    )  # fmt: skip
    # Assert
    assert code == 0
    (source,) = sources
    assert isinstance(source, SecureNoise)
    assert source.is_cryptographic is True


def write_grouped_shapes(root: Path, groups: int, per_group: int) -> Path:
    """Drawn shapes owned by ``groups`` patients: a group-level dataset."""
    plain = write_shapes(root, groups * per_group, offset=300)
    rows = [json.loads(line) for line in (plain / "manifest.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["group"] = f"patient-{i // per_group}"
    return write_jsonl_dataset(root, rows, task="shapes", privacy_unit="group")


def test_a_group_level_release_states_group_as_its_privacy_unit(workspace, capsys):
    # Arrange: 9 patients of 4 records each; each group is one chunk, so m = 9
    ws = workspace
    data = write_grouped_shapes(ws.root / "grouped", groups=9, per_group=4)
    out = ws.root / "grouped-artifact"

    # Act
    code = main(
        [
            "release", *ws.model_args(), "--data", str(data), "--out", str(out),
            "--selection", "all", "--clip-norm", "1.0", "--shots", "2", "--quiet",
            "--ledger", str(ws.root / "grouped-ledger.sqlite"),
            "--signing-key", str(ws.signing_key),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert: the plan, the manifest and the printed line all say group, not example
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan"]["privacy_unit"] == "group"
    assert manifest["accountant_parameters"]["privacy_unit"] == "group"
    assert manifest["num_chunks"] == 9
    assert "per group" in printed
    # ... and so does the ledger, entry and total
    assert main(["ledger", "--ledger", str(ws.root / "grouped-ledger.sqlite")]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"eps=[0-9.]+ delta=1e-05 per group", shown), shown
    assert re.search(r"counted against the budget: epsilon=[0-9.]+ per group", shown), shown


def write_unsupported_model(folder: Path) -> Path:
    """A config only (no weights): a text model no adapter serves."""
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "command",
    [
        ["select-heads", "--out", "heads.json"],
        ["release", "--out", "never", "--selection", "all", "--clip-norm", "1", "--quiet"],
        ["evaluate", "--mode", "zero-shot"],
        ["audit", "--selection", "all", "--clip-norm", "1", "--runs", "2"],
    ],
    ids=lambda command: command[0],
)
def test_an_unsupported_model_is_refused_in_one_line_before_any_data_is_read(
    workspace, tmp_path, capsys, command
):
    # Arrange: data whose images do not exist, so reading it first would fail differently
    ws = workspace
    model = write_unsupported_model(tmp_path / "bert")
    data = tmp_path / "data"
    write_jsonl_dataset(
        data, [{"image": "missing.png", "question": "q?", "answer": "a"}] * 3, task="t"
    )
    extra = []
    if command[0] == "release":
        extra = ["--ledger", str(tmp_path / "l.sqlite"), "--signing-key", str(ws.signing_key)]

    # Act
    code = main([*command, *ws.model_args(model), "--data", str(data), *extra])

    # Assert
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "model_type must be one of" in err
    assert "'bert'" in err
    assert "image" not in err


def test_data_check_refuses_an_unsupported_model_before_decoding_the_data(
    workspace, tmp_path, capsys
):
    model = write_unsupported_model(tmp_path / "bert")
    data = tmp_path / "data"
    write_jsonl_dataset(
        data, [{"image": "missing.png", "question": "q?", "answer": "a"}] * 3, task="t"
    )

    code = main(["data", "check", str(data), "--model", str(model), "--device", "cpu"])

    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "model_type must be one of" in err


def test_third_party_bars_are_quiet_and_evaluate_shows_its_own_progress(workspace):
    # Arrange: a shell without the variables dpmtv sets by default
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPMTV_CLIENT_", "HF_HUB_D"))}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = [
        "evaluate",
        "--mode",
        "zero-shot",
        *workspace.model_args(),
        "--data",
        str(workspace.test),
    ]

    # Act
    result = subprocess.run(
        [sys.executable, "-m", "client.cli", *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )

    # Assert: no "Loading weights" bar from transformers; our own bar, with its rate
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Loading weights" not in result.stderr
    assert "answer: 100%" in result.stderr
    assert "zero-shot: accuracy" in result.stdout


def test_select_heads_and_data_check_state_the_same_out_of_vocabulary_share(
    workspace, capsys, caplog
):
    # Arrange: half the answers are words the embedded model has, half are not; select-heads
    # scores one query only, so a share over its queries would read 0 % or 100 %, not 50 %
    from client.models.embedded import EMBEDDED_MODEL_DIR

    rows = [
        {"id": f"v{i}", "image": f"{i:03d}.png", "question": QUESTION, "answer": answer}
        for i, answer in enumerate(["red"] * 15 + ["pneumonia"] * 15)
    ]
    data = workspace.root / "half-known"
    write_shapes(data, 30)  # the images
    write_jsonl_dataset(data, rows, task="half-known")
    model = ["--model", str(EMBEDDED_MODEL_DIR), "--device", "cpu"]

    # Act
    assert main(["data", "check", str(data), *model, "--shots", "2"]) == 0
    checked = capsys.readouterr().out
    with caplog.at_level("WARNING", logger="client.activations.scoring"):
        code = main(
            [
                "select-heads", *model, "--data", str(data), "--shots", "2",
                "--queries", "1", "--k", "2", "--out", str(workspace.root / "half.json"),
            ]
        )  # fmt: skip

    # Assert
    assert code == 0
    assert "out of vocabulary: 50% first" in checked
    assert "50% of answers start with the unknown token" in caplog.text
    # and its own progress: the public chunks, then the queries scored, each with a bar
    progress = capsys.readouterr().err
    assert "public: 100%" in progress
    assert "attribution: 100%" in progress


def test_a_private_release_picks_only_among_public_candidate_heads(workspace, capsys, tmp_path):
    # Arrange: 4 candidate heads from public data; the release picks 2 of them privately
    ws, candidates = workspace, tmp_path / "candidates.json"
    select = ["select-heads", *ws.model_args(), "--data", str(ws.public), "--out"]
    select += [str(candidates), "--k", "4", "--shots", "2", "--queries", "2"]
    assert main(select) == 0
    listed = {tuple(h) for h in json.loads(candidates.read_text())["heads"]}
    capsys.readouterr()
    # Act
    code = main(
        [
            "release", *ws.model_args(), "--data", str(ws.private), "--shots", "2", "--quiet",
            "--selection", "private", "--heads", "2", "--candidate-heads", str(candidates),
            "--clip-norm", "1", "--out", str(tmp_path / "artifact"),
            "--ledger", str(tmp_path / "ledger.sqlite"), "--signing-key", str(ws.signing_key),
        ]
    )  # fmt: skip
    # Assert
    assert code == 0, capsys.readouterr().err
    released = load_artifact(
        tmp_path / "artifact",
        trusted_keys=TrustedKeys([VerifyKey.load(ws.public_key)]),
        expected_model_fingerprint=None,
    )
    assert len(released.heads) == 2
    assert set(released.heads.heads) <= listed
    # A candidate list with a public plan is refused before anything is reserved
    refused = main(
        [
            "release", *ws.model_args(), "--data", str(ws.private), "--selection", "public",
            "--public-heads", str(candidates), "--candidate-heads", str(candidates),
            "--out", str(tmp_path / "other"), "--signing-key", str(ws.signing_key),
            "--ledger", str(tmp_path / "other.sqlite"),
        ]
    )  # fmt: skip
    assert refused == 2
    assert "--candidate-heads needs --selection private" in capsys.readouterr().err


def test_a_candidate_file_whose_c_was_chosen_for_every_head_lends_no_c(workspace, capsys, tmp_path):
    # Arrange: a public head list chosen for a release-first plan: its C' bounds every
    # carried head's layers, not the listed heads'
    ws, listed = workspace, tmp_path / "every-head.json"
    select = ["select-heads", *ws.model_args(), "--data", str(ws.public), "--out", str(listed),
              "--k", "4", "--shots", "2", "--queries", "2",
              "--for-order", "release-first"]  # fmt: skip
    assert main(select) == 0
    assert json.loads(listed.read_text())["clip_scope"] == "every carried head"
    capsys.readouterr()
    release = [
        "release", *ws.model_args(), "--data", str(ws.private), "--shots", "2", "--quiet",
        "--selection", "private", "--heads", "2", "--candidate-heads", str(listed),
        "--order", "release-first", "--out", str(tmp_path / "artifact"),
        "--ledger", str(tmp_path / "ledger.sqlite"), "--signing-key", str(ws.signing_key),
    ]  # fmt: skip

    # Act: as candidates, taking C' from the file
    code = main(release)

    # Assert: refused before anything is reserved, saying what to do
    err = capsys.readouterr().err
    assert code == 2
    assert "--clip-norm must be given" in err
    assert "every carried head's layers" in err
    assert not (tmp_path / "ledger.sqlite").exists()
    assert not (tmp_path / "artifact").exists()

    # Act / Assert: with a C' of its own, the file's heads are candidates as any list
    assert main([*release, "--clip-norm", "1"]) == 0

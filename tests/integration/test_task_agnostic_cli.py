"""``select-heads --public-task`` and ``release --centre``: a task-agnostic, centred release.

A tiny random LLaVA (accuracies are noise; the plumbing is what is checked): public sets of
three tasks of the synthetic shapes domain, none the private task; the heads file and centre
file they give; a single-holder release that must use that very centre.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from client.cli.main import main
from client.data.synthetic import write_task_datasets
from dpmtv_common.artifact import load_artifact
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadLayout, HeadSet
from protocol import ReleaseOrder, ReleasePlan, plan_calibration

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("agnostic")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        assert main(["make-tiny-model", "llava", str(root / "model"), "--seed", "0"]) == 0
        assert main(["keygen", "--out-dir", str(root / "keys"), "--name", "site"]) == 0
    for seed, task in enumerate(("shape", "count", "position"), start=1):
        write_task_datasets(
            root / task, task=task, sites=0, per_site=1, public=12, test=0, seed=seed
        )
    write_task_datasets(root / "private", task="colour", sites=1, per_site=15, public=0, test=0,
                        seed=9)  # fmt: skip
    return root


def _model(root: Path) -> list[str]:
    return ["--model", str(root / "model"), "--device", "cpu", "--batch-size", "4"]


def _select(root: Path, *extra: str) -> list[str]:
    return [
        "select-heads", *_model(root), "--out", str(root / "heads.json"), "--k", "2",
        "--shots", "2", "--max-chunks", "4", "--queries", "4", "--task", "colour", *extra,
    ]  # fmt: skip


def _public(root: Path, *tasks: str) -> list[str]:
    return [arg for task in tasks for arg in ("--public-task", str(root / task / "public"))]


@pytest.fixture(scope="module")
def selected(world: Path) -> tuple[dict[str, Any], str]:
    """One task-agnostic select-heads run: its heads file and what it printed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(
                _select(world, *_public(world, "shape", "count", "position"), "--for-epsilon",
                        "1", "--for-chunks", "60")
            )  # fmt: skip
    assert code == 0
    return json.loads((world / "heads.json").read_text()), printed.getvalue()


def test_select_heads_writes_a_centred_choice_that_names_its_setting(selected):
    # Arrange / Act: the module's one run
    record, printed = selected

    # Assert
    centre = ActivationCentre.load(Path(record["centre_file"]))
    assert record["centre_sha256"] == centre.digest()
    assert record["setting"] == "task-agnostic"
    assert record["public_tasks"] == ["shape", "count", "position"]
    assert record["heads_mode"] in ("public", "private")
    assert set(record["held_out_by_option"]) == {
        "public heads, select-first", "private heads, select-first",
        "private heads, release-first", "private heads, release-first among every head",
    }  # fmt: skip
    assert record["held_out_chosen"] == max(record["held_out_by_option"].values())
    assert set(record["held_out_by_chunks"]) == {"60", "180", "600"}
    assert record["clip_norm_suggestion"] > 0
    assert "setting: task-agnostic" in printed
    assert f"--centre {record['centre_file']}" in printed
    # the order of the option chosen, recorded and said
    assert record["release_order"] in ("select-first", "release-first")
    assert f"--order {record['release_order']}" in printed
    assert "held-out public accuracy of each option" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--public-task", "shape"], "at least two distinct PUBLIC datasets"),
        (["--public-task", "shape", "--public-task", "count"], "--for-epsilon and --for-chunks"),
        (["--public-task", "shape", "--public-task", "shape", "--for-epsilon", "1",
          "--for-chunks", "9"], "at least two distinct"),
        (["--public-task", "shape", "--public-task", "count", "--data", "count"],
         "must not be given together"),
    ],
    ids=["one-task", "no-plan", "repeat", "with-data"],
)  # fmt: skip
def test_select_heads_refuses_what_cannot_make_a_task_agnostic_choice(
    world, capsys, extra, message
):
    argv = _select(world, *[str(world / a / "public") if a in ("shape", "count") else a
                            for a in extra])  # fmt: skip

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_forced_heads_mode_compares_only_its_own_options(world, tmp_path):
    # Arrange / Act: private selection only
    out = tmp_path / "private.json"
    argv = [*_select(world, *_public(world, "shape", "count"), "--for-epsilon", "1",
                     "--for-chunks", "60", "--heads-mode", "private")]  # fmt: skip
    argv[argv.index("--out") + 1] = str(out)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        assert main(argv) == 0

    # Assert
    record = json.loads(out.read_text())
    assert record["heads_mode"] == "private"
    assert set(record["held_out_by_option"]) == {
        "private heads, select-first", "private heads, release-first",
        "private heads, release-first among every head",
    }  # fmt: skip


def test_a_heads_mode_without_public_tasks_is_refused(world, capsys):
    argv = _select(world, "--data", str(world / "shape" / "public"), "--heads-mode", "public")
    assert main(argv) == 2
    assert "--heads-mode needs --public-task" in capsys.readouterr().err


def test_a_public_task_that_is_the_private_data_is_refused(world, capsys, monkeypatch):
    # Arrange: the site's private data setting names the folder given as "public"
    private = world / "private" / "site-0"
    monkeypatch.setenv("DPMTV_CLIENT_DATA_PATH", str(private))

    # Act
    code = main(
        _select(world, "--public-task", str(private), *_public(world, "shape"), "--for-epsilon",
                "1", "--for-chunks", "9")
    )  # fmt: skip

    # Assert
    assert code == 2
    assert "private data folder" in capsys.readouterr().err


def _release(world: Path, out: str, *extra: str) -> list[str]:
    return [
        "release", *_model(world), "--data", str(world / "private" / "site-0"), "--out",
        str(world / out), "--selection", "public", "--public-heads", str(world / "heads.json"),
        "--shots", "2", "--signing-key", str(world / "keys" / "site.key"), "--ledger",
        str(world / "ledger.sqlite"), "--quiet", *extra,
    ]  # fmt: skip


def _private_release(world: Path, tmp_path: Path, *options: str) -> list[str]:
    """A private release of the private site's data into ``tmp_path``, with ``options``."""
    return [
        "release", *_model(world), "--data", str(world / "private" / "site-0"), "--out",
        str(tmp_path / "artifact"), *options, "--shots", "2",
        "--signing-key", str(world / "keys" / "site.key"), "--ledger",
        str(tmp_path / "ledger.sqlite"), "--quiet",
    ]  # fmt: skip


def _signed(world: Path, tmp_path: Path) -> tuple[Any, ReleasePlan]:
    """The artifact ``_private_release`` wrote, verified, and its signed plan."""
    artifact = load_artifact(
        tmp_path / "artifact",
        trusted_keys=TrustedKeys.from_files([world / "keys" / "site.pub"]),
        expected_model_fingerprint=fingerprint_model_dir(world / "model"),
    )
    return artifact, ReleasePlan.model_validate_json(json.dumps(artifact.manifest.plan))


def test_release_uses_the_centre_its_heads_were_chosen_with_or_refuses(
    world, selected, capsys, tmp_path
):
    # Arrange: the heads file's heads released as public heads, with another centre at hand
    record, _ = selected
    other = tmp_path / "other.safetensors"
    ActivationCentre.from_array(ActivationCentre.load(Path(record["centre_file"])).values + 1).save(
        other
    )
    capsys.readouterr()

    # Act / Assert: without the centre, or with another, nothing is spent
    assert main(_release(world, "no-centre")) == 2
    assert "--centre must be given" in capsys.readouterr().err
    assert main(_release(world, "other-centre", "--centre", str(other))) == 2
    assert "--centre must be the centre the heads file was chosen with" in capsys.readouterr().err
    recorded = record["release_order"]
    other = "select-first" if recorded == "release-first" else "release-first"
    centre = ("--centre", record["centre_file"], "--order", recorded)
    assert main(_release(world, "other-order", *centre[:2], "--order", other)) == 2
    assert f"--order must be {recorded!r}" in capsys.readouterr().err
    assert not (world / "ledger.sqlite").exists()

    # Act: with it, and no --order, the artifact's signed plan pins the centre, in the
    # order the heads file was chosen for
    assert main(_release(world, "centred", *centre[:2])) == 0
    artifact = load_artifact(
        world / "centred",
        trusted_keys=TrustedKeys.from_files([world / "keys" / "site.pub"]),
        expected_model_fingerprint=fingerprint_model_dir(world / "model"),
    )
    assert artifact.manifest.plan["centre_sha256"] == record["centre_sha256"]
    assert artifact.manifest.plan["order"] == recorded


def test_a_private_release_first_choice_releases_among_its_candidates_as_printed(
    world, tmp_path, capsys
):
    # Arrange: private selection in release-first order among the candidates only; the
    # release options printed
    out = tmp_path / "private-rf.json"
    argv = [*_select(world, *_public(world, "shape", "count"), "--for-epsilon", "1",
                     "--for-chunks", "60", "--heads-mode", "private", "--for-order",
                     "release-first", "--picks-among", "candidates")]  # fmt: skip
    argv[argv.index("--out") + 1] = str(out)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        assert main(argv) == 0
    record = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert record["release_order"] == "release-first"
    assert f"--candidate-heads {out}" in printed
    candidates = [tuple(head) for head in record["heads"]]
    assert len(candidates) == 2 * record["heads_k"]

    # Act: the release the file describes
    options = ["--selection", "private", "--heads", str(record["heads_k"]),
               "--candidate-heads", str(out), "--centre", record["centre_file"]]  # fmt: skip
    assert main(_private_release(world, tmp_path, *options)) == 0

    # Assert: the signed plan runs release-first among the file's candidates, with its C';
    # the picks are candidates; σ is the one of a Gaussian over the candidates' layers
    artifact, plan = _signed(world, tmp_path)
    assert plan.order is ReleaseOrder.RELEASE_FIRST
    assert [tuple(h) for h in plan.candidate_heads or ()] == candidates
    assert plan.clip_norm == pytest.approx(record["clip_norm_suggestion"])
    assert set(artifact.heads.heads) <= set(candidates)
    scope = HeadSet(tuple(candidates))
    sigma = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=scope).noise_std
    assert artifact.manifest.noise_std == pytest.approx(sigma)


def test_private_picks_among_every_head_release_first_as_printed(world, tmp_path, capsys):
    # Arrange: private picks among every carried head; the release options printed
    out = tmp_path / "private-every.json"
    argv = [*_select(world, *_public(world, "shape", "count"), "--for-epsilon", "1",
                     "--for-chunks", "60", "--heads-mode", "private", "--picks-among",
                     "every-head")]  # fmt: skip
    argv[argv.index("--out") + 1] = str(out)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        assert main(argv) == 0
    record = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert record["held_out_by_option"].keys() == {"private heads, release-first among every head"}
    assert record["private_picks_among"] == "every carried head"
    assert "--candidate-heads" not in printed
    options = next(line for line in printed.splitlines() if "--selection private" in line)

    # Act: the release exactly as printed
    assert main(_private_release(world, tmp_path, *options.split())) == 0

    # Assert: release-first without candidates, C' as suggested, σ over every carried layer
    artifact, plan = _signed(world, tmp_path)
    assert plan.order is ReleaseOrder.RELEASE_FIRST
    assert plan.candidate_heads is None
    assert plan.clip_norm == pytest.approx(record["clip_norm_suggestion"], rel=1e-5)
    assert artifact.manifest.plan["centre_sha256"] == record["centre_sha256"]
    every = HeadLayout(num_layers=2, num_heads=4).all_heads()  # the tiny LLaVA's text model
    sigma = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=every).noise_std
    assert artifact.manifest.noise_std == pytest.approx(sigma)


def test_picks_among_needs_public_tasks(world, capsys):
    argv = _select(world, "--data", str(world / "shape" / "public"), "--picks-among", "every-head")
    assert main(argv) == 2
    assert "--picks-among needs --public-task" in capsys.readouterr().err


class _Stop(Exception):
    """Ends a run once what it would do is seen."""


@pytest.mark.parametrize(("given", "expected"), [([], 40), (["--queries", "7"], 7)])
def test_public_tasks_keep_the_benchmarks_query_count_unless_told(
    world: Path, monkeypatch: pytest.MonkeyPatch, given: list[str], expected: int
) -> None:
    # Arrange: each public task's preparation recorded, then the run stopped
    import client.public.tasks as tasks

    asked: list[int] = []

    def recorded(*args: Any, max_queries: int, **kwargs: Any) -> Any:
        asked.append(max_queries)
        raise _Stop

    monkeypatch.setattr(tasks, "public_task", recorded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    command = _select(world)
    at = command.index("--queries")
    command = command[:at] + command[at + 2 :] + given

    # Act: the run ends at the first public task (an error the command line reports)
    code = main([*command, *_public(world, "shape", "count"), "--for-epsilon", "1",
                 "--for-chunks", "60"])  # fmt: skip

    # Assert: 40 a task (client.public.defaults.MAX_PUBLIC_QUERIES), or what --queries says
    assert code != 0
    assert asked == [expected]

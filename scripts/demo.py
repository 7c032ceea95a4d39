"""The README's main job: a simulated consortium makes one DP release, a site then uses it.

1. Writes three sites' private data of one task, a test set, and public labelled sets of the
   domain's OTHER tasks only (client.data.synthetic): no public example carries the private task's
   answers.
2. Prepares the model every site runs, the coordinator's signing key and each site's settings,
   and makes every public choice on the public sets alone (scripts/demo_choices.py, as
   `dpmtv-site select-heads --public-task` makes them): the centre, the heads, C'.
3. Runs the real ServerApp logic against three real sites in one process
   (server.simulation.InProcessGrid): each site is a site service behind a relay, as deployed;
   plan, SecAgg+ secure sums with ChaCha20 masks, a centred release (each site clips its shift
   from the public centre), head selection, one Gaussian draw (or, with --noise-mode
   distributed, each site's own share), signed broadcast, ledgers.
4. Site 0 verifies the artifact and answers test queries with it (no further privacy cost),
   next to what it has without the release: zero-shot, K-shot ICL with its own examples, and
   the public data alone (the centre patched into the same heads).

Usage: scripts/demo [--workdir DIR] [--epsilon 1.0] [--sites 3] ...   (see --help)
       scripts/demo --model MY_MODEL --data MY_DATA --sites 3   (your own model and data)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bars
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import torch

from client.activations.chunking import planned_num_chunks
from client.activations.extraction import zero_shot_prompt
from client.activations.hooks import PatchPolicy
from client.cli._artifact import artifact_patch
from client.data.records import load_dataset
from client.data.synthetic import TASKS, TRAINED_TASKS, write_task_datasets
from client.evaluation import EvaluationMode, evaluate
from client.evaluation.first_token import QuerySet
from client.inference.answers import TaskVectorPatch
from client.models import load_model, save_tiny_model
from client.models.embedded import EMBEDDED_MODEL_DIR
from client.public.clip import PlannedNoise
from client.public.scope import HeadsMode, PlannedRelease
from client.service.inprocess import in_process_sites, site_settings_for_partition
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import DataError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
from protocol import plan_gumbel_scale, plan_noise_multiplier
from server.coordinator import build_plan, run_coordinated_release
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import InProcessGrid, make_server_context

sys.path.insert(0, str(REPO / "scripts"))
from demo_choices import public_task_folders, single_set_choice, task_agnostic_choice
from demo_progress import Heartbeat, StepHandler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=REPO / "demo-run")
    parser.add_argument("--task", choices=TASKS, default="colour")
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--per-site", type=int, default=400)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--heads-mode",
        choices=("public", "private"),
        help="with task-agnostic public data: release public heads, or select privately "
        "(default: whichever the held-out public simulation scores best; private selection "
        "adds a secure sum of every chunk's votes, minutes on a pretrained decoder)",
    )
    parser.add_argument(
        "--clip-norm",
        type=float,
        help="default: what `dpmtv-site select-heads` suggests on the public data",
    )
    parser.add_argument(
        "--public-per-task",
        type=int,
        default=60,
        help="examples in each public set of another task (the task-agnostic public data)",
    )
    parser.add_argument(
        "--tiny-random-model", action="store_true", help="use a tiny random LLaVA instead"
    )
    parser.add_argument("--test", type=int, default=40)
    parser.add_argument(
        "--model", type=Path, help="your own model directory (default: the embedded one)"
    )
    parser.add_argument(
        "--data",
        type=Path,
        help="your own data: a folder with site-0 ... site-{N-1} and test datasets, and public "
        "sets of two or more OTHER tasks as public-<task> folders (or one public set of the "
        "task as public); docs/data.md; default: synthetic shapes",
    )
    parser.add_argument(
        "--noise-mode",
        choices=("central", "distributed"),
        default="central",
        help="distributed: every site adds its own noise share (the coordinator is not trusted)",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=20.0,
        help="seconds between progress lines while a phase runs (default 20)",
    )
    return parser.parse_args()


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    work = args.workdir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    data = work / "data"
    if args.data is None:
        write_synthetic_data(data, args)
    else:
        data.symlink_to(args.data.resolve(), target_is_directory=True)
        missing = [f"site-{i}" for i in range(args.sites) if not (data / f"site-{i}").is_dir()]
        missing += [name for name in ("test",) if not (data / name).is_dir()]
        if len(public_task_folders(data)) < 2 and not (data / "public").is_dir():
            missing.append("public-<task> folders of two other tasks (or one public)")
        if missing:
            raise SystemExit(f"--data must hold {missing} (docs/data.md), got {args.data}.")
    model = args.model.resolve() if args.model else EMBEDDED_MODEL_DIR
    if args.tiny_random_model:
        model = work / "model"
        save_tiny_model("llava", model, seed=0)
    key = SigningKey.generate()
    key.save(work / "coordinator.key")
    key.verify_key.save(work / "coordinator.pub")
    site = "site-{partition-id}"
    os.environ.update(
        {
            "DPMTV_CLIENT_NAME": site,
            "DPMTV_CLIENT_MODEL_PATH": str(model),
            "DPMTV_CLIENT_DATA_PATH": str(work / "data" / site),
            "DPMTV_CLIENT_STATE_DIR": str(work / f"{site}-state"),  # each site's own state
            "DPMTV_CLIENT_LEDGER_PATH": str(work / f"{site}-ledger.sqlite"),
            "DPMTV_CLIENT_ARTIFACTS_DIR": str(work / f"{site}-artifacts"),
            "DPMTV_CLIENT_TRUSTED_KEYS": str(work / "coordinator.pub"),
            "DPMTV_CLIENT_MIN_SITES": str(min(args.sites, 3)),
            "DPMTV_CLIENT_NOISE_MODE": args.noise_mode,
            "DPMTV_SERVER_SIGNING_KEY": str(work / "coordinator.key"),
            "DPMTV_SERVER_LEDGER_PATH": str(work / "consortium-ledger.sqlite"),
            "DPMTV_SERVER_ARTIFACTS_DIR": str(work / "coordinator-artifacts"),
        }
    )
    return work, model


def write_synthetic_data(data: Path, args: argparse.Namespace) -> None:
    """The private task's sites and test set; public sets of the family's OTHER tasks only."""
    write_task_datasets(
        data, task=args.task, sites=args.sites, per_site=args.per_site, public=0,
        test=args.test, seed=0,
    )  # fmt: skip
    for offset, other in enumerate(public_family(args.task), start=1):
        scratch = data / f".scratch-{other}"
        write_task_datasets(
            scratch, task=other, sites=0, per_site=1, public=args.public_per_task, test=0,
            seed=100 * offset,
        )  # fmt: skip
        (scratch / "public").rename(data / f"public-{other}")
        scratch.rmdir()


def public_family(task: str) -> tuple[str, ...]:
    """The public tasks of the synthetic domain: the trained tasks other than ``task``."""
    return tuple(t for t in TRAINED_TASKS if t != task)


def public_choices(work: Path, model: Path, args: argparse.Namespace, beat: Heartbeat) -> None:
    """Every choice the run config takes from PUBLIC data, as `select-heads` makes it."""
    beat.step("loading the model")
    loaded = load_model(model)
    folders = public_task_folders(work / "data")
    if len(folders) >= 2:
        args.choice = task_agnostic_choice(
            loaded, folders, args, planned=planned_releases(args, model), work=work,
            step=beat.step,
        )  # fmt: skip
        return

    def planned(top: HeadSet) -> PlannedNoise:
        plan = build_plan(RunConfig.from_context(run_config(args, model)))
        return PlannedNoise.for_plan(
            plan, num_chunks=sum(site_chunks(args)), layers_in_scope=top.num_layers_in_scope
        )  # C scales the noise; z, m and L do not depend on it

    args.choice = single_set_choice(
        loaded, work / "data" / "public", args, planned_noise=planned, step=beat.step
    )


def planned_releases(args: argparse.Namespace, model: Path) -> dict[HeadsMode, PlannedRelease]:
    """The release this demo will make, in each heads mode: its z and its m (public numbers)."""
    out = {}
    for mode, config in (
        (HeadsMode.PUBLIC, {"selection": "public", "public-heads": "0:0"}),
        (HeadsMode.PRIVATE, {"selection": "private"}),
    ):
        base = run_config(args, model) | config
        plan = build_plan(RunConfig.from_context(base))
        out[mode] = PlannedRelease(
            plan_noise_multiplier(plan), sum(site_chunks(args)),
            gumbel_scale=plan_gumbel_scale(plan),
        )  # fmt: skip
    return out


def site_chunks(args: argparse.Namespace) -> list[int]:
    """The chunks each site cuts (public counts: they size the noise and the grid)."""
    data = args.workdir / "data"
    return [
        planned_num_chunks(load_dataset(data / f"site-{i}"), args.shots, None)
        for i in range(args.sites)
    ]


def run_config(args: argparse.Namespace, model: Path) -> dict:
    """The coordinator's run config for this release (public choices merged once made)."""
    config: dict[str, object] = {
        "task": args.task,
        "model-fingerprint": fingerprint_model_dir(model),
        "epsilon": args.epsilon,
        "shots": args.shots,
        "clip-norm": 1.0,
        "num-selected-heads": args.heads,
        "expected-sites": args.sites,
        "min-sites": min(args.sites, 3),
        "noise-mode": args.noise_mode,
        # every site's data states its unit; the plan must say the same (sites check it)
        "privacy-unit": load_dataset(
            args.workdir / "data" / "site-0", check_images=False
        ).privacy_unit,
    }
    choice = getattr(args, "choice", None)
    if choice is not None:
        config |= choice.config
    if args.clip_norm is not None:  # given on the command line: it wins
        config["clip-norm"] = args.clip_norm
    if args.noise_mode == "distributed":  # bounds every site's sum on SecAgg+'s grid
        config["max-chunks-per-site"] = max(site_chunks(args))
    return config


def federated_release(args: argparse.Namespace, model: Path):
    config = run_config(args, model)
    noise = secure_noise()
    require_cryptographic(noise)
    # Every site is a real site service behind a real relay, in this process.
    settings = [site_settings_for_partition(i) for i in range(args.sites)]
    with in_process_sites(settings) as sites:
        grid = InProcessGrid(sites.relays, num_nodes=args.sites, run_config=config)
        return run_coordinated_release(
            grid,
            make_server_context(config),
            RunConfig.from_context(config),
            CoordinatorSettings(),
            noise,
        )


def site_zero_inference(
    work: Path, model: Path, report, args: argparse.Namespace, beat: Heartbeat
) -> None:
    beat.step("loading the model and verifying the artifact")
    loaded = load_model(model)
    keys = TrustedKeys.from_files([work / "coordinator.pub"])
    artifact = work / "site-0-artifacts" / report.plan.release_id
    patch = artifact_patch(
        artifact, loaded=loaded, keys=keys, policy=PatchPolicy.PROMPT_LAST_TOKEN, instruction=None
    )
    test = load_dataset(work / "data" / "test").records
    own = load_dataset(work / "data" / "site-0").records  # what site 0 has without the release
    rows: list[tuple[str, EvaluationMode, dict]] = [
        ("zero-shot", EvaluationMode.ZERO_SHOT, {}),
        (f"alone: {args.shots}-shot ICL, own data", EvaluationMode.ICL,
         {"support": own, "shots": args.shots}),
    ]  # fmt: skip
    scope = args.choice.scope
    if scope is not None:  # the public data alone: the centre patched into the same heads
        heads = patch.heads
        centre = torch.as_tensor(scope.centre.rows(heads), dtype=torch.float32)
        public_only = TaskVectorPatch(heads, centre, PatchPolicy.PROMPT_LAST_TOKEN)
        rows.append(("public only (centre)", EvaluationMode.ARTIFACT, {"patch": public_only}))
    rows.append(("private release", EvaluationMode.ARTIFACT, {"patch": patch}))
    ended = _with_answer_end(work, loaded, keys, artifact, beat)
    if ended is not None:
        rows.append(("release + public answer's end", EvaluationMode.ARTIFACT, {"patch": ended}))
    first_tokens = QuerySet.build(
        loaded, [zero_shot_prompt(record) for record in test], [r.answer for r in test]
    )
    for label, mode, kwargs in rows:
        beat.step(f"{label} on {len(test)} test queries")
        result = evaluate(loaded, test, mode=mode, **kwargs)
        line = f"  site-0 {label:32}: accuracy {result.accuracy:.3f} on {len(test)} test queries"
        if mode is EvaluationMode.ARTIFACT:
            # The answer's first token alone (what the benchmarks score): above the accuracy
            # when the patched model names the answer and then goes on talking.
            applied = (kwargs["patch"].heads, kwargs["patch"].values)
            line += f" (first token right: {first_tokens.accuracy(loaded, applied):.3f})"
        print(line)
    first = test[0]
    asked = ended or patch
    answer = evaluate(loaded, test[:1], mode=EvaluationMode.ARTIFACT, patch=asked).predictions[0]
    print(f"  site-0 asks {first.question!r} about {first.image_path.name}: {answer!r}")


def _with_answer_end(
    work: Path, loaded, keys: TrustedKeys, artifact: Path, beat: Heartbeat
) -> TaskVectorPatch | None:
    """The release with the answer's end learnt from the demo's public sets, if it has any."""
    public = sorted((work / "data").glob("public-*"))
    if not public:
        return None
    beat.step("learning the answer's end from the public sets")
    try:
        return artifact_patch(
            artifact, loaded=loaded, keys=keys, policy=PatchPolicy.PROMPT_LAST_TOKEN,
            instruction=None, answer_end_from=public,
        )  # fmt: skip
    except DataError as exc:  # public answers of several tokens: nothing to learn from
        print(f"  no answer's end: {exc}")
        return None


def _log_steps(beat: Heartbeat) -> None:
    """Warnings to the terminal; the sites' and coordinator's INFO lines to the heartbeat."""
    logging.basicConfig(level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # SecAgg+ logs every stage at DEBUG
    for name in ("client.release.site", "server.coordinator"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(StepHandler(beat))


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a line as it comes
    args = parse_args()
    beat = Heartbeat(every=args.progress_every)
    _log_steps(beat)
    started = time.monotonic()
    print("[1/3] preparing data, model and keys; every choice from public data ...", flush=True)
    with beat.phase("[1/3]"):
        beat.step("writing data, model and keys")
        work, model = prepare(args)
        public_choices(work, model, args, beat)
    print(f"[1/3] data, model and keys ready in {work} ({time.monotonic() - started:.1f} s)")
    if args.tiny_random_model:
        print("      model: a TINY RANDOM LLaVA: accuracies show the pipeline, not utility.")
    elif args.model is not None:
        print(f"      model: {model}; data: {args.data or 'synthetic shapes'};")
    else:
        print(f"      model: the embedded shapes VLM ({model}); task {args.task!r};")
    print(f"      public choices: {args.choice.summary}")
    print(
        f"[2/3] federated release over {args.sites} site services: plan, SecAgg+ secure sums, "
        "one noise draw, head selection, signed artifact ... (the longest phase: tens of "
        "seconds on 2 idle cores)",
        flush=True,
    )
    with beat.phase("[2/3]"):
        report = federated_release(args, model)
    outcome = report.outcome
    bound = outcome.bound
    stages = ", ".join(f"{name} {seconds:.1f}" for name, seconds in report.stage_seconds.items())
    print(
        f"[2/3] federated release {report.plan.release_id}: {len(outcome.heads)} heads over "
        f"{outcome.heads.num_layers_in_scope} layers, m={outcome.num_chunks} chunks from "
        f"{len(report.acknowledged)} sites\n"
        f"      epsilon={bound.epsilon:.3f} ({bound.accountant}), delta={report.plan.delta:g} "
        f"per {report.plan.privacy_unit.value}, "
        f"noise std={outcome.noise_std:.3f}, signal/noise~{outcome.signal_to_noise:.2f}\n"
        f"      stages (s): {stages}"
    )
    print("[3/3] local inference at site 0 with the verified artifact:", flush=True)
    with beat.phase("[3/3]"):
        site_zero_inference(work, model, report, args, beat)
    print(f"done in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``select-heads --public-task DIR ...``: a centred release chosen task-agnostically.

Each ``--public-task`` is a labelled PUBLIC dataset of another task of the private task's
domain (same kind of images and question, other answers). From them alone
(``client.public.tasks``, ``client.public.scope``): the centre, the heads mode (public heads,
or private selection among public candidates or every carried head), k and C', by
leave-one-public-task-out under the planned release's noise; then what that choice gives on
held-out public tasks at the planned m and at 3 and 10 times as many chunks. Writes the heads
file and the centre file, and prints the ``release`` options that use them.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from client.cli._choices import DEFAULT_SELECTION_SHARE, MIN_MODEL_GAIN
from client.cli._common import (
    CLIP_SCOPE_EVERY_HEAD,
    CLIP_SCOPE_LISTED,
    check_site_model,
    load_site_model,
    public_data_folder,
    settings_from,
    write_heads_file,
)
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    from client.models import LoadedModel
    from client.public.scope import ComparedOption, HeadsMode, PlannedRelease, ScopeChoice
    from client.public.tasks import PublicTask

__all__ = ["public_task_folders", "run_task_agnostic"]


def public_task_folders(args: argparse.Namespace) -> list[Path]:
    """Every ``--public-task`` folder, each checked as public data (never the private one).

    Raises:
        ConfigError: Fewer than two, a repeat, or one is the site's private data folder.
    """
    given: list[Path] = list(args.public_task or [])
    if len(given) < 2 or len({p.resolve() for p in given}) != len(given):
        raise ConfigError(
            "--public-task must name at least two distinct PUBLIC datasets of other tasks of "
            f"the domain, got {[str(p) for p in given]}."
        )
    for folder in given:
        public_data_folder(argparse.Namespace(**{**vars(args), "public_task": folder}),
                           option="--public-task")  # fmt: skip
    return given


def _planned(args: argparse.Namespace) -> list[tuple[HeadsMode, PlannedRelease]]:
    """The planned central releases to compare (public heads spend no ε on picks).

    Without ``--for-order``: public heads select-first (release-first only adds noise to the
    same heads), and private selection select-first and release-first (among the candidates,
    and among every carried head), each simulated as it would run (``client.public.scope``);
    the best on held-out public tasks is suggested. With it: each heads mode in that order
    (private release-first both ways). In release-first order the Gaussian covers the
    candidates, or every carried head (public heads, or private picks without candidates),
    and C' and the noise scale to those heads' layers.
    """
    from client.public.scope import HeadsMode, PlannedRelease, compared_options
    from dpmtv_common.privacy import ReleaseCalibration

    def planned(mode: HeadsMode, every_head: bool, among_every_head: bool) -> PlannedRelease:
        picks = args.k if mode is HeadsMode.PRIVATE else 0
        calibration = ReleaseCalibration.for_budget(
            epsilon=args.for_epsilon, delta=args.for_delta, private_picks=picks,
            selection_share=DEFAULT_SELECTION_SHARE,
        )  # fmt: skip
        scale = calibration.gumbel().gumbel_scale if picks else None
        draws = {} if args.simulated_draws is None else {"draws": args.simulated_draws}
        return PlannedRelease(
            calibration.noise_multiplier, args.for_chunks, every_head=every_head,
            gumbel_scale=scale, among_every_head=among_every_head, **draws,
        )  # fmt: skip

    release_first = None if args.for_order is None else args.for_order == "release-first"
    options = [option for option in compared_options(release_first) if _kept(option, args)]
    if not options:
        raise ConfigError(
            f"--heads-mode {args.heads_mode} --for-order {args.for_order} --picks-among "
            f"{args.picks_among} leave no option to compare: private picks among every head "
            "are released first (--for-order release-first)."
        )
    return [(option.mode, planned(*option)) for option in options]


def _kept(option: ComparedOption, args: argparse.Namespace) -> bool:
    """Whether ``--heads-mode`` and ``--picks-among`` keep this option.

    ``--picks-among`` binds private picks only: public heads pick nothing.
    """
    from client.public.scope import HeadsMode

    if args.heads_mode is not None and option.mode is not HeadsMode(args.heads_mode):
        return False
    if args.picks_among is None or option.mode is HeadsMode.PUBLIC:
        return True
    return option.among_every_head is (args.picks_among == "every-head")


def _model_gains(loaded: LoadedModel, tasks: list[PublicTask], k: int) -> dict[str, float]:
    """Each public task's own plain mean in its own top-k heads, gain over zero-shot."""
    from client.public.tasks import rank_heads

    gains = {}
    for task in tasks:
        heads = rank_heads(loaded, [task], k=k)
        index = heads.to_array()
        values = task.mean[index[:, 0], index[:, 1]]
        gains[task.name] = task.queries.accuracy(loaded, (heads, values)) - task.queries.accuracy(
            loaded
        )
    return gains


def _say_setting(args: argparse.Namespace, names: list[str]) -> str:
    if args.task is not None and args.task in names:
        print(
            f"setting: LABELLED: a public set of the private task {args.task!r} is among them; "
            "its plain mean may already answer the task, so measure the release against it."
        )
        return "labelled (a public set of the private task among them)"
    print(
        f"setting: task-agnostic: public tasks {names}"
        + (f", none of them the private task {args.task!r}" if args.task else "")
        + " (pass --task NAME to have this checked)."
    )
    return "task-agnostic"


def _say_model(gains: dict[str, float]) -> None:
    shown = ", ".join(f"{name} +{gain:.2f}" for name, gain in gains.items())
    print(f"the model's own non-private gain on each public task (plain mean, own heads): {shown}")
    if max(gains.values()) < MIN_MODEL_GAIN:
        print(
            f"warning: this model gains less than {MIN_MODEL_GAIN} on every public task even "
            "without noise: it does not learn these tasks in context, and no release can fix "
            "that. Bring a model that does (docs/gpu.md lists the supported checkpoints)."
        )


def _say_choice(choice: ScopeChoice, expected: dict[int, float]) -> None:
    print(
        "held-out public accuracy of each option at its chosen k and C': "
        + ", ".join(f"{name} {acc:.2f}" for name, acc in choice.options_tried)
    )
    print(
        f"chosen: {choice.option} (transfer across public tasks "
        f"{choice.transfer:.2f}); k = {choice.k}; C' = {choice.factor:g} x {choice.scale:.4g} = "
        f"{choice.clip_norm:.4g}"
    )
    best_name, best = max(choice.options_tried, key=lambda option: option[1])
    if choice.held_out < best:
        print(
            f"({choice.option} keeps --clip-keep of {best_name}'s gain over the centre alone: "
            "private picks follow the private task's own heads, public heads cannot)"
        )
    print(f"held-out public accuracy of the centre alone: {choice.public_only:.2f}")
    print(
        "held-out public accuracy of this release: "
        + ", ".join(f"m = {m}: {acc:.2f}" for m, acc in expected.items())
    )


def _release_options(args: argparse.Namespace, choice: ScopeChoice, centre_file: Path) -> str:
    """The ``release`` options of this choice: its order, heads, C' and centre.

    Private picks among every carried head name no candidates: C' is given as a number (the
    heads file, not passed, keeps the evidence).
    """
    from client.public.scope import HeadsMode

    common = f"--order {choice.order} --centre {centre_file}"
    if choice.mode is HeadsMode.PUBLIC:
        return f"--selection public --public-heads {args.out} {common}"
    if choice.among_every_head:
        return f"--selection private --heads {choice.k} --clip-norm {choice.clip_norm:.6g} {common}"
    return f"--selection private --heads {choice.k} --candidate-heads {args.out} {common}"


def run_task_agnostic(args: argparse.Namespace) -> int:
    """Choose, write and explain a centred release's public choices (module docstring)."""
    folders = public_task_folders(args)
    if args.for_epsilon is None or args.for_chunks is None:
        raise ConfigError(
            "--for-epsilon and --for-chunks must be given with --public-task: C' is chosen "
            "under the noise of the planned release (epsilon, and chunks of all sites together)."
        )
    settings = settings_from(args)
    centre_file = args.centre_out or args.out.with_suffix(".centre.safetensors")
    from client.data.records import load_dataset
    from client.public.scope import HeadsMode, choose_scope, held_out_accuracy_by_chunks
    from client.public.tasks import MAX_PUBLIC_QUERIES, public_task

    check_site_model(settings)
    loaded = load_site_model(settings).with_image_crops(args.max_image_crops)
    datasets = [load_dataset(folder) for folder in folders]
    setting = _say_setting(args, [d.task for d in datasets])
    queries = MAX_PUBLIC_QUERIES if args.queries is None else args.queries
    tasks = []
    for dataset in datasets:
        tasks.append(
            public_task(loaded, dataset, shots=args.shots, max_chunks=args.max_chunks,
                        max_queries=queries, seed=args.seed, batch_size=settings.batch_size)
        )  # fmt: skip
        print(f"public task {dataset.task!r}: {len(tasks[-1].activations)} chunks", flush=True)
    ks = sorted({max(1, args.k // 2), args.k})
    planned = _planned(args)
    mode = None if args.heads_mode is None else HeadsMode(args.heads_mode)
    choice = choose_scope(loaded, tasks, planned=planned, ks=ks, keep=args.clip_keep, mode=mode,
                          progress=lambda line: print(line, flush=True))  # fmt: skip
    counts = [args.for_chunks * f for f in (1, 3, 10)]
    chosen = next(p for m, p in planned if p.option(m) == choice.option)
    expected = held_out_accuracy_by_chunks(
        loaded, tasks, choice, planned=chosen, chunk_counts=counts
    )
    gains = _model_gains(loaded, tasks, args.k)
    choice.centre.save(centre_file)
    released = choice.heads if choice.candidates is None else choice.candidates
    every_head = choice.every_head and choice.candidates is None  # C' for every head's layers
    write_heads_file(
        args.out, released, clip_norm_suggestion=choice.clip_norm, **choice.as_record(),
        clip_scope=CLIP_SCOPE_EVERY_HEAD if every_head else CLIP_SCOPE_LISTED,
        setting=setting, public_tasks=[t.name for t in tasks], heads_k=choice.k,
        centre_sha256=choice.centre.digest(), centre_file=str(centre_file),
        held_out_by_chunks={str(m): acc for m, acc in expected.items()},
        model_gain_by_task=gains, model_fingerprint=loaded.fingerprint, shots=args.shots,
        max_image_crops=args.max_image_crops,
        method="attribution over task-agnostic public tasks",
    )  # fmt: skip
    _say_model(gains)
    _say_choice(choice, expected)
    print(f"wrote {args.out} and the centre {centre_file}; release with:")
    print(f"  {_release_options(args, choice, centre_file)}")
    if statistics.mean(expected.values()) <= choice.public_only:
        print("warning: on held-out public tasks this release does no better than the centre.")
    return 0

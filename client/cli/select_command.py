"""``dpmtv-site select-heads``: a head list from PUBLIC data (no privacy cost)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli._choices import (
    DEFAULT_SELECTION_SHARE,
    MIN_MODEL_GAIN,
    RELEASE_ORDERS,
    SELECTION_METHODS,
)
from client.cli._common import (
    CLIP_SCOPE_EVERY_HEAD,
    CLIP_SCOPE_LISTED,
    add_image_crops_option,
    add_model_options,
    check_site_model,
    load_site_model,
    public_data_folder,
    settings_from,
    write_heads_file,
)
from client.cli._types import non_negative_int, open_unit_float, positive_float, positive_int
from client.public.defaults import MAX_PUBLIC_QUERIES
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    from client.public.clip import ClipChoice

__all__ = ["register"]

DATA_QUERIES = 64
"""Zero-shot queries of a --data public set that score its heads, unless --queries says."""


def register(sub: Any) -> None:
    """Add the ``select-heads`` sub-command."""
    parser = sub.add_parser(
        "select-heads",
        help="choose heads on PUBLIC data -> heads.json for --selection public",
        description="Never run this on private data: it has no privacy protection. It also "
        "suggests a clip norm C: the smallest of 1, 2, 4, 8 and 16 times the public median "
        "per-layer norm of the chosen heads whose clipped (noise-free) public mean keeps "
        "--clip-keep of the unclipped mean's gain over zero-shot on the public queries. "
        "With --for-epsilon and --for-chunks it instead scores each C with the noise the "
        "planned release will add (a central private select-first release of --k heads) and "
        "suggests the smallest keeping --clip-keep of the best one's gain: few chunks favour "
        "a small C, many a large one. "
        "`release` uses the suggestion when --clip-norm is not given.",
    )
    add_model_options(parser)
    parser.add_argument("--data", type=Path, help="PUBLIC labelled dataset folder")
    parser.add_argument(
        "--public-task",
        type=Path,
        action="append",
        help="a labelled PUBLIC dataset of ANOTHER task of the domain (repeat: two or more). "
        "Chooses a centred release with no example of the private task: centre, heads mode, "
        "k (--k and --k/2) and C' by holding each public task out under the planned noise "
        "(needs --for-epsilon and --for-chunks): of the choices keeping --clip-keep of the "
        "best held-out gain, private selection over public heads, the larger k, the smaller "
        "C'; writes a centre file beside --out",
    )
    parser.add_argument(
        "--task", help="the private task's name: says whether a public set carries its answers"
    )
    parser.add_argument(
        "--centre-out", type=Path, help="centre file (default: --out with .centre.safetensors)"
    )
    parser.add_argument("--out", type=Path, required=True, help="heads file to write (JSON)")
    parser.add_argument("--k", type=positive_int, default=8, help="heads to keep (attribution)")
    parser.add_argument("--shots", type=positive_int, default=4)
    parser.add_argument("--method", choices=SELECTION_METHODS, default="attribution")
    parser.add_argument("--max-chunks", type=positive_int, default=200)
    parser.add_argument(
        "--queries", type=positive_int, default=None,
        help=f"public zero-shot queries used (default: {DATA_QUERIES} of the --data set; with "
        f"--public-task, {MAX_PUBLIC_QUERIES} of each task, what the documented benchmarks "
        "measured)",
    )  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=600, help="REINFORCE (MTV: 600)")
    parser.add_argument("--samples", type=positive_int, default=32, help="REINFORCE (MTV: 32)")
    parser.add_argument(
        "--clip-keep",
        type=open_unit_float,
        default=0.9,
        help="share of the best public gain a suggestion must keep: the smallest C within it "
        "(with --public-task also the larger k, and private selection over public heads) "
        "(default 0.9)",
    )
    parser.add_argument(
        "--for-epsilon",
        type=positive_float,
        help="epsilon of the planned release: score each C with its noise (needs --for-chunks)",
    )
    parser.add_argument(
        "--for-chunks",
        type=positive_int,
        help="chunks the planned release will pool, all sites together (needs --for-epsilon)",
    )
    parser.add_argument(
        "--for-delta", type=open_unit_float, default=1e-5, help="delta of the planned release"
    )
    parser.add_argument(
        "--simulated-draws",
        type=positive_int,
        help="with --public-task: simulated releases each tried (k, C') is scored on, on each "
        "held-out public task (default 8: fewer make the chosen C' differ between runs; the "
        "choice's time grows with it)",
    )
    parser.add_argument(
        "--for-order",
        choices=RELEASE_ORDERS,
        help="order of the release the heads file is for (release refuses the file with another "
        "--order). Default with --public-task: public heads select-first and private selection "
        "in both orders, each simulated on held-out public tasks as it would run, the best "
        "suggested; with --data (a public head list): select-first. A release-first Gaussian "
        "covers every head for public heads (C bounds whole layers), the candidates (or every "
        "carried head, see --picks-among) for private selection",
    )
    parser.add_argument(
        "--picks-among",
        choices=("candidates", "every-head"),
        help="with --public-task: where private picks released first may fall. candidates: "
        "the 2k heads the public tasks rank first (less noise: fewer layers); every-head: "
        "every carried head (the Gaussian covers every layer; picks can reach heads the public "
        "tasks do not rank). Default: both simulated, the better on held-out public tasks "
        "suggested; every-head keeps no private select-first option",
    )
    parser.add_argument(
        "--heads-mode",
        choices=("public", "private"),
        help="with --public-task: only this heads mode's options (default: public heads and "
        "private selection both, the best on held-out public tasks suggested). Public heads "
        "spend nothing on picks and need no vote round; private selection can find the task's "
        "own heads",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    add_image_crops_option(parser, purpose="as the release will (written to the heads file)")
    parser.set_defaults(handler=run)


def _check_out(out: Path) -> None:
    """The heads file must be writable where it is named, checked before any forward pass."""
    if out.is_dir():
        raise ConfigError(f"--out must be a file path, got the directory {str(out)!r}.")
    if not out.parent.is_dir():
        raise ConfigError(
            f"--out must lie in an existing directory, got {str(out)!r} "
            f"({str(out.parent)!r} is not a directory)."
        )


def run(args: argparse.Namespace) -> int:
    """Select heads and write the heads file."""
    if args.public_task:
        if args.data is not None:
            raise ConfigError(
                "--data and --public-task must not be given together: --data is one labelled "
                "public set, --public-task two or more of other tasks (task-agnostic)."
            )
        _check_out(args.out)
        from client.cli.select_agnostic import run_task_agnostic

        return run_task_agnostic(args)
    if args.heads_mode is not None or args.picks_among is not None:
        given = "--heads-mode" if args.heads_mode is not None else "--picks-among"
        value = args.heads_mode if args.heads_mode is not None else args.picks_among
        raise ConfigError(
            f"{given} needs --public-task (task-agnostic public data), got {given} {value} "
            "without it: a --data heads file is a public head list."
        )
    if args.data is None:
        raise ConfigError(
            "select-heads needs PUBLIC data: --data DIR (one labelled public set of the task) or "
            "--public-task DIR twice or more (labelled public sets of other tasks), got neither; "
            "public data is never taken from DPMTV_CLIENT_DATA_PATH or a config file's data-path "
            "(the site's private data)."
        )
    public = public_data_folder(args)  # never the site's private data setting
    settings = settings_from(args)
    _check_out(args.out)
    if (args.for_epsilon is None) != (args.for_chunks is None):
        raise ConfigError(
            "--for-epsilon and --for-chunks must be given together, got "
            f"--for-epsilon {args.for_epsilon} and --for-chunks {args.for_chunks}."
        )
    # Imported here: the data and model side need PIL, torch and transformers.
    from client.activations.chunking import make_chunks
    from client.activations.scoring import check_answer_vocabulary
    from client.data.records import load_dataset
    from client.public.clip import PlannedNoise, choose_clip_norm
    from client.public.selection import (
        ReinforceSettings,
        SelectionMethod,
        public_activations,
        select_heads_attribution,
        select_heads_reinforce,
    )
    from protocol import ReleaseOrder, SelectionMode

    check_site_model(settings)  # an unusable model is refused before any data is read
    dataset = load_dataset(public)
    loaded = load_site_model(settings).with_image_crops(args.max_image_crops)
    layout = loaded.adapter.head_shape(loaded.model).layout()
    carried = len(layout.all_heads())  # a hybrid's headless layers carry none
    if args.k > carried:
        raise ConfigError(
            f"--k must be at most the model's {carried} heads (layers "
            f"{list(layout.carried_layers)} of {layout.num_layers} x {layout.num_heads}), "
            f"got {args.k}."
        )
    chunks = make_chunks(dataset, shots=args.shots, seed=args.seed, max_chunks=args.max_chunks)
    count = DATA_QUERIES if args.queries is None else args.queries
    queries = [chunk.query for chunk in chunks.chunks][:count]
    # Selection scores each query's first answer token: all of them <unk> would select heads
    # for p(<unk>), so that is refused before any forward pass, as a release refuses it. The
    # share is over every record, as `data check` counts it.
    check_answer_vocabulary(loaded, [record.answer for record in dataset.records])
    acts = public_activations(
        loaded, chunks.chunks, batch_size=settings.batch_size, instruction=dataset.instruction
    )
    mean = acts.mean(0)
    if SelectionMethod(args.method) is SelectionMethod.REINFORCE:
        settings_rl = ReinforceSettings(steps=args.steps, samples=args.samples, seed=args.seed)
        heads = select_heads_reinforce(
            loaded, mean, queries, settings=settings_rl, instruction=dataset.instruction
        )
    else:
        heads = select_heads_attribution(
            loaded, mean, queries, k=args.k, instruction=dataset.instruction, progress=True
        )
    # A release-first Gaussian covers every carried head: C then bounds whole layers. By
    # default the list is for public heads, released in their default order.
    order = ReleaseOrder.named_or_default(args.for_order, SelectionMode.PUBLIC).value
    clipped = layout.all_heads() if order == "release-first" else heads
    planned = None
    if args.for_epsilon is not None:
        planned = PlannedNoise(
            _central_noise_multiplier(args), args.for_chunks, clipped.num_layers_in_scope
        )
    choice = choose_clip_norm(
        loaded,
        acts,
        heads,
        queries,
        instruction=dataset.instruction,
        keep=args.clip_keep,
        planned=planned,
        clipped_scope=clipped,
    )
    write_heads_file(
        args.out,
        heads,
        clip_norm_suggestion=choice.clip_norm,
        **choice.as_record(),
        release_order=order,
        clip_scope=CLIP_SCOPE_EVERY_HEAD if order == "release-first" else CLIP_SCOPE_LISTED,
        method=args.method,
        model_fingerprint=loaded.fingerprint,
        public_chunks=len(chunks.chunks),
        shots=args.shots,
        max_image_crops=args.max_image_crops,  # release checks it: heads fit their cap only
    )
    print(f"{len(heads)} heads over {heads.num_layers_in_scope} layers -> {args.out}")
    print(f"chosen for a {order} release: pass release --order {order}")
    _print_clip_choice(choice)
    return 0


def _central_noise_multiplier(args: argparse.Namespace) -> float:
    """Z of a central private select-first release of ``--k`` heads at the planned budget."""
    from dpmtv_common.privacy import ReleaseCalibration

    calibration = ReleaseCalibration.for_budget(
        epsilon=args.for_epsilon,
        delta=args.for_delta,
        private_picks=args.k,
        selection_share=DEFAULT_SELECTION_SHARE,
    )
    return calibration.noise_multiplier


def _print_clip_choice(choice: ClipChoice) -> None:
    tried = ", ".join(f"{c.factor:g}x {c.accuracy:.2f}" for c in choice.candidates)
    print(
        f"public first-token accuracy: zero-shot {choice.zero_shot:.2f}, unclipped mean "
        f"{choice.unclipped:.2f}; clipped at f x median {choice.median:.4g}: {tried}"
    )
    if choice.planned is not None:
        print(
            f"(each with the planned release's noise: m = {choice.planned.num_chunks}, "
            f"z = {choice.planned.noise_multiplier:.3g}, {choice.planned.draws} draws)"
        )
    print(f"suggested clip norm C = {choice.clip_norm:.4g}")
    if choice.unclipped - choice.zero_shot < MIN_MODEL_GAIN:
        print(
            f"warning: the unclipped public mean gains {choice.unclipped - choice.zero_shot:.2f} "
            f"over zero-shot (under {MIN_MODEL_GAIN}) even without noise: this model does not "
            "do this task from a task vector, and no release can fix that. Bring a model that "
            "does (docs/gpu.md lists the supported checkpoints)."
        )
    if not choice.kept_gain:
        print(
            "warning: no C tried keeps the asked share of the unclipped gain; the largest is "
            "suggested. Check the heads (--k) and the public data before a release."
        )

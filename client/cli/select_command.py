"""``dpmtv-site select-heads``: a head list from PUBLIC data (no privacy cost)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli._choices import SELECTION_METHODS
from client.cli._common import (
    add_image_crops_option,
    add_model_options,
    check_site_model,
    load_site_model,
    settings_from,
    write_heads_file,
)
from client.cli._types import non_negative_int, open_unit_float, positive_int
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    from client.clip_choice import ClipChoice

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``select-heads`` sub-command."""
    parser = sub.add_parser(
        "select-heads",
        help="choose heads on PUBLIC data -> heads.json for --selection public",
        description="Never run this on private data: it has no privacy protection. It also "
        "suggests a clip norm C: the smallest of 1, 2, 4, 8 and 16 times the public median "
        "per-layer norm of the chosen heads whose clipped (noise-free) public mean keeps "
        "--clip-keep of the unclipped mean's gain over zero-shot on the public queries. "
        "`release` uses it when --clip-norm is not given.",
    )
    add_model_options(parser)
    parser.add_argument("--data", type=Path, help="PUBLIC labelled dataset folder")
    parser.add_argument("--out", type=Path, required=True, help="heads file to write (JSON)")
    parser.add_argument("--k", type=positive_int, default=8, help="heads to keep (attribution)")
    parser.add_argument("--shots", type=positive_int, default=4)
    parser.add_argument("--method", choices=SELECTION_METHODS, default="attribution")
    parser.add_argument("--max-chunks", type=positive_int, default=200)
    parser.add_argument(
        "--queries", type=positive_int, default=64, help="public zero-shot queries used"
    )
    parser.add_argument("--steps", type=positive_int, default=600, help="REINFORCE (MTV: 600)")
    parser.add_argument("--samples", type=positive_int, default=32, help="REINFORCE (MTV: 32)")
    parser.add_argument(
        "--clip-keep",
        type=open_unit_float,
        default=0.9,
        help="share of the unclipped public gain the suggested C must keep (default 0.9)",
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
    settings = settings_from(args)
    if settings.data_path is None:
        raise ConfigError("select-heads needs --data DIR (a PUBLIC dataset).")
    _check_out(args.out)
    # Imported here: the data and model side need PIL, torch and transformers.
    from client.chunking import make_chunks
    from client.clip_choice import choose_clip_norm
    from client.data import load_dataset
    from client.public_selection import (
        ReinforceSettings,
        SelectionMethod,
        public_activations,
        select_heads_attribution,
        select_heads_reinforce,
    )
    from client.scoring import check_answer_vocabulary

    check_site_model(settings)  # an unusable model is refused before any data is read
    dataset = load_dataset(settings.data_path)
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
    queries = [chunk.query for chunk in chunks.chunks][: args.queries]
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
    choice = choose_clip_norm(
        loaded, acts, heads, queries, instruction=dataset.instruction, keep=args.clip_keep
    )
    write_heads_file(
        args.out,
        heads,
        clip_norm_suggestion=choice.clip_norm,
        **choice.as_record(),
        method=args.method,
        model_fingerprint=loaded.fingerprint,
        public_chunks=len(chunks.chunks),
        shots=args.shots,
        max_image_crops=args.max_image_crops,  # release checks it: heads fit their cap only
    )
    print(f"{len(heads)} heads over {heads.num_layers_in_scope} layers -> {args.out}")
    _print_clip_choice(choice)
    return 0


def _print_clip_choice(choice: ClipChoice) -> None:
    tried = ", ".join(f"{c.factor:g}x {c.accuracy:.2f}" for c in choice.candidates)
    print(
        f"public first-token accuracy: zero-shot {choice.zero_shot:.2f}, unclipped mean "
        f"{choice.unclipped:.2f}; clipped at f x median {choice.median:.4g}: {tried}"
    )
    print(f"suggested clip norm C = {choice.clip_norm:.4g}")
    if not choice.kept_gain:
        print(
            "warning: no C tried keeps the asked share of the unclipped gain; the largest is "
            "suggested. Check the heads (--k) and the public data before a release."
        )

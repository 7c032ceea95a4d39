"""``dpmtv-site data check DIR [--model M]``: look at a dataset before spending anything."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from client.cli._choices import (
    DEFAULT_SELECTION_SHARE,
    ORDER_HELP,
    RELEASE_ORDERS,
    SELECTION_MODES,
)
from client.cli._common import (
    add_image_crops_option,
    add_model_options,
    check_site_model,
    load_site_model,
    settings_from,
)
from client.cli._types import open_unit_float, positive_float, positive_int

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``data`` command group (``data check``)."""
    parser = sub.add_parser(
        "data",
        help="inspect a site dataset (no privacy cost: nothing leaves the site)",
        description="Dataset tools. The format is in docs/data.md.",
    )
    actions = parser.add_subparsers(dest="data_action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="validate a dataset and report what a release would see",
        description="Loads DIR as a release does (every image decoded) and prints n, the "
        "privacy unit and groups, the chunks at --shots, image sizes and modes, and the "
        "answers. With --model it also prints each answer's first token and the share "
        "outside the model's vocabulary (<unk>), and the prompt length of each chunk against "
        "the model's context (the processor runs; the model does not). Exits 1 if a release "
        "would fail (a chunk prompt beyond the context, or no chunk at all).",
    )
    check.add_argument("directory", type=Path, metavar="DIR", help="dataset folder")
    add_model_options(check)
    check.add_argument("--shots", type=positive_int, default=4, help="K a chunk (default 4)")
    check.add_argument(
        "--max-chunks", type=positive_int, default=32, help="chunks to measure (default 32)"
    )
    check.add_argument("--question", help="question of image-folder records (overrides)")
    add_image_crops_option(check, purpose="as a plan's max-image-crops would (with --model)")
    signal = check.add_argument_group(
        "signal (with --model)",
        "the release you plan, for the predicted signal/noise (an upper bound; nothing is spent)",
    )
    signal.add_argument("--epsilon", type=positive_float, default=1.0, help="(default 1)")
    signal.add_argument("--delta", type=open_unit_float, default=1e-5, help="(default 1e-5)")
    signal.add_argument("--selection", choices=SELECTION_MODES, default="private")
    signal.add_argument("--order", choices=RELEASE_ORDERS, help=ORDER_HELP)
    signal.add_argument("--heads", type=positive_int, default=8, help="k heads (default 8)")
    check.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace) -> int:
    """Print the dataset report; 1 when a release with these settings would fail."""
    # Imported here: the data and model side need PIL, torch and transformers.
    from client.checks.dataset import check_dataset, check_with_model, report_lines

    if args.model is not None:  # an unusable model is refused before any data is read
        check_site_model(settings_from(args))
    dataset, data = check_dataset(args.directory, shots=args.shots, question=args.question)
    model = None
    if args.model is not None:
        loaded = load_site_model(settings_from(args)).with_image_crops(args.max_image_crops)
        model = check_with_model(dataset, data, loaded, max_chunks=args.max_chunks)
    lines = report_lines(data, model)
    if args.model is not None and data.num_chunks >= 1:
        lines += _signal_lines(args, data.num_chunks, loaded, data.privacy_unit)
    for line in lines:
        print(line)
    failed = data.num_chunks < 1 or (model is not None and bool(model.errors))
    return 1 if failed else 0


def _signal_lines(args: argparse.Namespace, num_chunks: int, loaded: Any, unit: str) -> list[str]:
    """The predicted signal/noise of the release these options describe, and its warning."""
    from client.checks.signal import signal_report
    from protocol import PROTOCOL_VERSION, PrivacyUnit, ReleaseOrder, ReleasePlan, SelectionMode

    shape = loaded.adapter.head_shape(loaded.model)
    selection = SelectionMode(args.selection)
    public = shape.all_heads().heads[: args.heads] if selection is SelectionMode.PUBLIC else None
    plan = ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id="data-check",
        task="data-check",
        model_fingerprint=loaded.fingerprint,
        epsilon=args.epsilon,
        delta=args.delta,
        shots=args.shots,
        clip_norm=1.0,  # cancels out of the prediction
        selection=selection,
        order=ReleaseOrder.named_or_default(args.order, selection),
        num_selected_heads=min(args.heads, len(shape.all_heads())),
        public_heads=public,
        selection_share=DEFAULT_SELECTION_SHARE,
        score_top_r=min(args.heads, len(shape.all_heads())),
        min_sites=1,
        max_chunks_per_site=None,
        privacy_unit=PrivacyUnit(unit),
        created="1970-01-01T00:00:00+00:00",
    )
    report = signal_report(plan, num_chunks=num_chunks, shape=shape)
    return [*report.lines, *(f"warning: {warning}" for warning in report.warnings)]

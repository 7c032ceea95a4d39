"""``dpmtv-site release``: a single-holder DP release on the site's own private data.

Nothing is spent on a mistake the site could have caught: every check that can fail (option
values, the output path, the signing key, the data, the model, heads and top-r against the
model, the plan) runs before the ledger reserves the release's cost.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from client.cli._choices import (
    DEFAULT_SELECTION_SHARE,
    ORDER_HELP,
    RELEASE_ORDERS,
    SCORE_METHODS,
    SELECTION_MODES,
)
from client.cli._common import (
    CLIP_SCOPE_LISTED,
    add_image_crops_option,
    add_model_options,
    check_site_model,
    heads_file_clip_scope,
    load_heads_file,
    load_site_model,
    settings_from,
)
from client.cli._errors import validation_line
from client.cli._types import open_unit_float, positive_float, positive_int
from client.release.ledgers import check_one_ledger
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    from client.models import HeadShape
    from dpmtv_common.heads import HeadLayout
    from protocol import ReleaseOrder, ReleasePlan

__all__ = ["register"]

# Plan fields and the flag that sets each, for error lines that name what to change.
_PLAN_OPTIONS = {
    "release_id": "--release-id",
    "task": "--task",
    "epsilon": "--epsilon",
    "delta": "--delta",
    "shots": "--shots",
    "clip_norm": "--clip-norm",
    "num_selected_heads": "--heads",
    "public_heads": "--public-heads",
    "candidate_heads": "--candidate-heads",
    "selection_share": "--selection-share",
    "score_top_r": "--top-r",
    "max_chunks_per_site": "--max-chunks",
    "max_image_crops": "--max-image-crops",
    "centre_sha256": "--centre",
}


def register(sub: Any) -> None:
    """Add the ``release`` sub-command."""
    parser = sub.add_parser(
        "release",
        help="single-holder DP release -> signed artifact + ledger entry",
        description="Release a differentially private task vector of YOUR private data. "
        "Chunks of K demonstrations + 1 query are cut with a secret shuffle; each chunk's "
        "head activations are clipped per layer to C; one Gaussian draw calibrated to "
        "(epsilon, delta) is added to their sum; heads are picked privately (Gumbel top-k), "
        "from a public list, or all released. Every input is checked before the cost is "
        "reserved in your ledger.",
    )
    add_model_options(parser)
    parser.add_argument("--data", type=Path, help="private dataset folder")
    parser.add_argument("--out", type=Path, required=True, help="artifact directory to create")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing artifact at --out"
    )
    parser.add_argument("--task", help="task name (default: the dataset's)")
    parser.add_argument("--epsilon", type=positive_float, default=1.0, help="total (default 1)")
    parser.add_argument("--delta", type=open_unit_float, default=1e-5, help="total (default 1e-5)")
    parser.add_argument("--shots", type=positive_int, default=4, help="K demonstrations a chunk")
    parser.add_argument(
        "--clip-norm",
        type=positive_float,
        help="per-layer L2 bound C; take it from PUBLIC data (select-heads suggests one), "
        "never from the private data",
    )
    parser.add_argument("--selection", choices=SELECTION_MODES, default="private")
    parser.add_argument("--order", choices=RELEASE_ORDERS, help=ORDER_HELP)
    parser.add_argument(
        "--heads", type=positive_int, default=8, help="k heads to select privately (default 8)"
    )
    parser.add_argument("--public-heads", type=Path, help="head list from select-heads")
    parser.add_argument(
        "--candidate-heads",
        type=Path,
        help="private selection picks only among these heads, and every chunk votes among "
        "them; in release-first order the noise covers them only: a select-heads file computed "
        "on PUBLIC data, e.g. with --k twice --heads (no privacy cost; fewer candidates, better "
        "picks and less noise on models with many heads)",
    )
    parser.add_argument(
        "--centre",
        type=Path,
        help="a centred release: the PUBLIC centre file select-heads --public-task wrote; each "
        "chunk is clipped as its shift from it (same privacy cost, less clipping bias)",
    )
    parser.add_argument(
        "--selection-share",
        type=open_unit_float,
        default=DEFAULT_SELECTION_SHARE,
        help="share of epsilon spent on private selection, in (0, 1) "
        f"(default {DEFAULT_SELECTION_SHARE})",
    )
    parser.add_argument(
        "--top-r",
        type=positive_int,
        help="heads each chunk votes for, >= 1 (default: k, the number of heads selected)",
    )
    parser.add_argument("--score-method", choices=SCORE_METHODS, default="shift")
    parser.add_argument("--max-chunks", type=positive_int, help="cap on chunks (default: all)")
    add_image_crops_option(parser, purpose="recorded in the plan and the artifact")
    parser.add_argument("--ledger", dest="ledger_path", type=Path, help="SQLite ledger")
    parser.add_argument("--budget-epsilon", type=positive_float, help="ledger budget epsilon")
    parser.add_argument("--budget-delta", type=open_unit_float, help="ledger budget delta")
    parser.add_argument("--signing-key", type=Path, help="Ed25519 private key (keygen)")
    parser.add_argument("--release-id", help="default: a fresh random id")
    parser.add_argument(
        "--min-signal-to-noise",
        type=float,
        default=0.0,
        metavar="R",
        help="refuse, before anything is reserved, a release whose predicted signal/noise "
        "(an upper bound from m, K, the model's heads and epsilon) is below R (default 0: "
        "only warn below 1)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run)


def _check_out(out: Path, *, overwrite: bool) -> None:
    """Refuse an output path the artifact could not be written to, before anything is spent."""
    for folder in out.absolute().parents:
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                raise ConfigError(
                    f"--out must lie in a directory, got {str(out)!r} under the file "
                    f"{str(folder)!r}."
                )
            break
    from dpmtv_common.artifact import check_artifact_target

    check_artifact_target(
        out,
        overwrite=overwrite,
        name="--out",
        remedy="pass --overwrite to replace the artifact there, or choose another --out",
    )


def _clip_norm(args: argparse.Namespace, extras: dict[str, Any]) -> float:
    clip_norm = args.clip_norm or extras.get("clip_norm_suggestion")
    if clip_norm is None:
        raise ConfigError(
            "--clip-norm is required: choose C from public data (select-heads prints a "
            "suggestion); a C computed from the private data would leak it."
        )
    return float(clip_norm)


def _plan(
    args: argparse.Namespace,
    task: str,
    fingerprint: str,
    *,
    privacy_unit: str,
    centre: ActivationCentre | None = None,
) -> ReleasePlan:
    """The plan of these options, for the data's own privacy unit (what the chunks protect)."""
    # Imported here: protocol imports Flower (half a second), which keygen and --help skip.
    from protocol import PROTOCOL_VERSION, PrivacyUnit, ReleasePlan, SelectionMode

    public_heads = None
    extras: dict[str, Any] = {}
    if args.selection == "public":
        if args.public_heads is None:
            raise ConfigError("--selection public needs --public-heads FILE (from select-heads).")
        heads, extras = load_heads_file(args.public_heads)
        public_heads = heads.heads
        _check_heads_file_crops(extras, args.max_image_crops)
    candidate_heads = None
    if args.candidate_heads is not None:
        if args.selection != "private":
            raise ConfigError(
                f"--candidate-heads needs --selection private, got --selection {args.selection}."
            )
        candidates, candidate_extras = load_heads_file(args.candidate_heads)
        candidate_heads = candidates.heads
        _check_heads_file_crops(candidate_extras, args.max_image_crops)
        _check_candidates_clip_scope(candidate_extras, clip_given=args.clip_norm is not None)
        extras = extras or candidate_extras
    _check_heads_file_centre(extras, centre)
    order = _order_of(args, extras)
    _check_heads_file_order(extras, order.value, clip_given=args.clip_norm is not None)
    k = len(public_heads) if public_heads else args.heads
    try:
        return ReleasePlan(
            protocol_version=PROTOCOL_VERSION,
            release_id=args.release_id or f"release-{uuid.uuid4().hex[:12]}",
            task=task,
            model_fingerprint=fingerprint,
            epsilon=args.epsilon,
            delta=args.delta,
            shots=args.shots,
            clip_norm=_clip_norm(args, extras),
            selection=SelectionMode(args.selection),
            order=order,
            num_selected_heads=k,
            public_heads=public_heads,
            candidate_heads=candidate_heads,
            selection_share=args.selection_share,
            # Documented default: each chunk votes for as many heads as are selected.
            score_top_r=args.top_r or k,
            min_sites=1,
            max_chunks_per_site=args.max_chunks,
            max_image_crops=args.max_image_crops,
            privacy_unit=PrivacyUnit(privacy_unit),
            centre_sha256=None if centre is None else centre.digest(),
            created=datetime.now(UTC).isoformat(timespec="seconds"),
        )
    except ValidationError as exc:
        raise ConfigError(validation_line(exc, options=_PLAN_OPTIONS)) from exc


def resolved_order(args: argparse.Namespace) -> ReleaseOrder:
    """``--order``, or the default for ``--selection`` (``ReleaseOrder.default_for``)."""
    from protocol import ReleaseOrder, SelectionMode

    return ReleaseOrder.named_or_default(args.order, SelectionMode(args.selection))


def _order_of(args: argparse.Namespace, extras: dict[str, Any]) -> ReleaseOrder:
    """``--order``; else the order the heads file's choices were made for; else the default.

    ``select-heads --public-task`` picks the order on public data and records it: a release
    given its file runs in that order unless told otherwise.
    """
    from protocol import ReleaseOrder

    recorded = extras.get("release_order")
    if args.order is None and recorded in RELEASE_ORDERS:
        return ReleaseOrder(recorded)
    return resolved_order(args)


def _check_heads_file_crops(extras: dict[str, Any], max_image_crops: int | None) -> None:
    """Public heads (and their clip norm) measured under one crop cap fit only that cap."""
    if "max_image_crops" in extras and extras["max_image_crops"] != max_image_crops:
        raise ConfigError(
            f"--max-image-crops must be the cap the public heads were selected under "
            f"({extras['max_image_crops']!r}, from select-heads), got {max_image_crops!r}."
        )


def _check_heads_file_centre(extras: dict[str, Any], centre: ActivationCentre | None) -> None:
    """Heads (and C') chosen for a centred release are used with that centre, or not at all.

    A C' chosen for the shift from a centre clips raw activations far below their norm: the
    release would carry almost no signal, so the mismatch is refused before anything is spent.
    """
    recorded = extras.get("centre_sha256")
    if recorded is None:
        return
    if centre is None:
        raise ConfigError(
            f"--centre must be given: the heads file was chosen for a centred release (centre "
            f"{str(extras.get('centre_file', 'file'))!r}, sha256 {str(recorded)[:16]}...)."
        )
    if centre.digest() != recorded:
        raise ConfigError(
            f"--centre must be the centre the heads file was chosen with (sha256 "
            f"{str(recorded)[:16]}...), got one with sha256 {centre.digest()[:16]}..."
        )


def _check_heads_file_order(extras: dict[str, Any], order: str, *, clip_given: bool) -> None:
    """A C' taken from a heads file is used in the release order it was chosen for.

    A release-first Gaussian covers every head (public heads) or the candidates (private
    selection), a select-first one the released heads only:
    a C' chosen for one scope clips the other far from its norms (too much signal lost, or
    too much noise), so the mismatch is refused before anything is spent. A release that
    names its own ``--clip-norm`` takes only the heads from the file, which suit either order.
    """
    recorded = extras.get("release_order")
    if recorded is not None and recorded != order and not clip_given:
        raise ConfigError(
            f"--order must be {recorded!r}, the order the heads file's C' was chosen for, got "
            f"{order!r}: pass --order {recorded}, rerun select-heads with --for-order {order}, "
            "or choose --clip-norm for this order yourself (from public data)."
        )


def _check_candidates_clip_scope(extras: dict[str, Any], *, clip_given: bool) -> None:
    """A candidate file's C' is taken only if it was chosen for the candidates' layers.

    With candidates, a private release's Gaussian covers them (release-first) or the heads
    picked among them (select-first), and its C' must bound their layers. A file whose C'
    was chosen for every carried head's layers (a public head list for a release-first
    plan) would clip the candidates at a norm chosen for other layers: the mismatch is
    refused before anything is spent. A release that names its own ``--clip-norm`` takes
    only the heads from the file.
    """
    scope = heads_file_clip_scope(extras)
    if scope != CLIP_SCOPE_LISTED and not clip_given:
        raise ConfigError(
            f"--clip-norm must be given: the --candidate-heads file's C' was chosen for "
            f"{scope}'s layers, and this release's Gaussian covers the candidates (or the heads "
            "picked among them); rerun select-heads --public-task ... --heads-mode private, "
            "or choose --clip-norm for the candidates yourself (from public data)."
        )


def _check_heads(plan: ReleasePlan, args: argparse.Namespace, layout: HeadLayout) -> None:
    """Heads, top-r and a public head list must fit the heads the model carries (before spending).

    A hybrid's headless layers (linear attention, convolution) carry none: a public head there
    is refused as much as one outside the model.
    """
    carried = layout.all_heads()
    where = (
        f"the model's {len(carried)} heads "
        f"(layers {list(layout.carried_layers)} of {layout.num_layers} x {layout.num_heads})"
    )
    if plan.selection == "private" and plan.num_selected_heads > len(carried):
        raise ConfigError(f"--heads must be at most {where}, got {plan.num_selected_heads}.")
    if plan.selection != "all" and plan.score_top_r > len(carried):
        option = "--top-r" if args.top_r else "--top-r (default: --heads)"
        raise ConfigError(f"{option} must be at most {where}, got {plan.score_top_r}.")
    for option, listed in (
        ("--public-heads", plan.public_heads),
        ("--candidate-heads", plan.candidate_heads),
    ):
        outside = [h for h in listed or () if h not in set(carried.heads)]
        if outside:
            raise ConfigError(
                f"{option} must name heads of {where}, got {[list(h) for h in outside]}: "
                "was the list made for another model?"
            )


def _check_signal(
    plan: ReleasePlan, args: argparse.Namespace, *, num_chunks: int, shape: HeadShape
) -> None:
    """Warn (stderr) below SNR 1, refuse below --min-signal-to-noise: before the ledger."""
    from client.checks.signal import signal_report

    report = signal_report(plan, num_chunks=num_chunks, shape=shape)
    predicted = report.estimate.signal_to_noise
    if predicted < args.min_signal_to_noise:
        raise ConfigError(
            f"--min-signal-to-noise must be at most the predicted signal/noise, got "
            f"{args.min_signal_to_noise:g} > {predicted:.3g} (m = {num_chunks}); nothing was "
            f"spent. {report.warning or ''}".strip()
        )
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run the release and print what it spent and produced."""
    settings = settings_from(args)
    if settings.data_path is None or settings.signing_key is None:
        raise ConfigError("release needs --data DIR and --signing-key FILE (see keygen).")
    _check_out(args.out, overwrite=args.overwrite)
    for line in check_one_ledger(settings):  # refused, before the model, if it splits the budget
        print(f"warning: {line}", file=sys.stderr)
    # Imported here: the data and model side need PIL, torch and transformers.
    from client.activations.chunking import make_chunks
    from client.activations.scoring import ScoreMethod
    from client.data.records import load_dataset
    from client.release.single_holder import LocalSums, run_single_holder_release
    from dpmtv_common.crypto import SigningKey
    from dpmtv_common.privacy.ledger import PrivacyLedger
    from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
    from dpmtv_common.rng import secret_seed

    signing_key = SigningKey.load(settings.signing_key)
    noise = secure_noise()
    require_cryptographic(noise)  # production path: no seeded source can reach here
    check_site_model(settings)  # an unusable model is refused before any data is read
    dataset = load_dataset(settings.data_path)
    loaded = load_site_model(settings)
    centre = None if args.centre is None else ActivationCentre.load(args.centre)
    plan = _plan(
        args,
        args.task or dataset.task,
        loaded.fingerprint,
        privacy_unit=dataset.privacy_unit,
        centre=centre,
    )
    shape = loaded.adapter.head_shape(loaded.model)
    _check_heads(plan, args, shape.layout())
    chunks = make_chunks(
        dataset, shots=plan.shots, seed=secret_seed(), max_chunks=plan.max_chunks_per_site
    )
    if not chunks.chunks:
        raise ConfigError(
            f"--data must hold at least --shots + 1 = {plan.shots + 1} records for one chunk, "
            f"got {len(dataset.records)}."
        )
    _check_signal(plan, args, num_chunks=len(chunks.chunks), shape=shape)
    sums = LocalSums(
        loaded,
        chunks.chunks,
        plan,
        score_method=ScoreMethod(args.score_method),
        batch_size=settings.batch_size,
        instruction=dataset.instruction,
        progress=not args.quiet,
        centre=centre,
    )
    with PrivacyLedger.open(settings.ledger_file, settings.budget) as ledger:
        # Replacing stages the new artifact beside the old one and swaps it in only once it
        # is complete: a failed release never destroys the artifact it was meant to replace.
        result = run_single_holder_release(
            plan,
            sums=sums,
            ledger=ledger,
            signing_key=signing_key,
            output=args.out,
            noise=noise,
            overwrite=args.overwrite,
        )
    outcome, manifest = result.outcome, result.manifest
    print(
        f"released {len(outcome.heads)} heads over {outcome.heads.num_layers_in_scope} layers "
        f"from m={outcome.num_chunks} chunks (K={plan.shots}, C={plan.clip_norm:g}, "
        f"{chunks.num_unused} records unused)\n"
        f"privacy: epsilon={manifest.epsilon:.4g}, delta={manifest.delta:g} per "
        f"{plan.privacy_unit.value} ({manifest.accountant}); "
        f"noise std={outcome.noise_std:.4g} on the sum, "
        f"signal/noise~{outcome.signal_to_noise:.3g}\n"
        f"artifact: {result.artifact}"
    )
    return 0

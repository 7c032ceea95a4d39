"""``dpmtv-site release``: a single-holder DP release on the site's own private data."""

from __future__ import annotations

import argparse
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from client.chunking import make_chunks
from client.cli._common import add_model_options, load_heads_file, load_site_model, settings_from
from client.data import load_dataset
from client.release import LocalSums, run_single_holder_release
from client.scoring import ScoreMethod
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
from dpmtv_common.rng import secret_seed
from protocol import PROTOCOL_VERSION, ReleaseOrder, ReleasePlan, SelectionMode

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``release`` sub-command."""
    parser = sub.add_parser(
        "release",
        help="single-holder DP release -> signed artifact + ledger entry",
        description="Release a differentially private task vector of YOUR private data. "
        "Chunks of K demonstrations + 1 query are cut with a secret shuffle; each chunk's "
        "head activations are clipped per layer to C; one Gaussian draw calibrated to "
        "(epsilon, delta) is added to their sum; heads are picked privately (Gumbel top-k), "
        "from a public list, or all released. The cost is reserved in your ledger first.",
    )
    add_model_options(parser)
    parser.add_argument("--data", type=Path, help="private dataset folder")
    parser.add_argument("--out", type=Path, required=True, help="artifact directory to create")
    parser.add_argument("--task", help="task name (default: the dataset's)")
    parser.add_argument("--epsilon", type=float, default=1.0, help="total epsilon (default 1)")
    parser.add_argument("--delta", type=float, default=1e-5, help="total delta (default 1e-5)")
    parser.add_argument("--shots", type=int, default=4, help="K demonstrations a chunk")
    parser.add_argument(
        "--clip-norm",
        type=float,
        help="per-layer L2 bound C; take it from PUBLIC data (select-heads suggests one), "
        "never from the private data",
    )
    parser.add_argument("--selection", choices=[m.value for m in SelectionMode], default="private")
    parser.add_argument(
        "--order",
        choices=[o.value for o in ReleaseOrder],
        default="release-first",
        help="release-first (default; best in docs/benchmarks.md) or select-first",
    )
    parser.add_argument("--heads", type=int, default=8, help="k heads to select privately")
    parser.add_argument("--public-heads", type=Path, help="head list from select-heads")
    parser.add_argument("--selection-share", type=float, default=0.3, help="share of epsilon")
    parser.add_argument("--top-r", type=int, help="heads each chunk votes for (default k)")
    parser.add_argument("--score-method", choices=[m.value for m in ScoreMethod], default="shift")
    parser.add_argument("--max-chunks", type=int, help="cap on chunks (default: all)")
    parser.add_argument("--ledger", dest="ledger_path", type=Path, help="SQLite ledger")
    parser.add_argument("--budget-epsilon", type=float, help="ledger budget epsilon")
    parser.add_argument("--budget-delta", type=float, help="ledger budget delta")
    parser.add_argument("--signing-key", type=Path, help="Ed25519 private key (keygen)")
    parser.add_argument("--release-id", help="default: a fresh random id")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run)


def _plan(args: argparse.Namespace, task: str, fingerprint: str) -> ReleasePlan:
    public_heads = None
    clip_norm = args.clip_norm
    if args.selection == SelectionMode.PUBLIC:
        if args.public_heads is None:
            raise ConfigError("--selection public needs --public-heads FILE (from select-heads).")
        heads, extras = load_heads_file(args.public_heads)
        public_heads = heads.heads
        clip_norm = clip_norm or extras.get("clip_norm_suggestion")
    if clip_norm is None:
        raise ConfigError(
            "--clip-norm is required: choose C from public data (select-heads prints a "
            "suggestion); a C computed from the private data would leak it."
        )
    k = len(public_heads) if public_heads else args.heads
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id=args.release_id or f"release-{uuid.uuid4().hex[:12]}",
        task=task,
        model_fingerprint=fingerprint,
        epsilon=args.epsilon,
        delta=args.delta,
        shots=args.shots,
        clip_norm=float(clip_norm),
        selection=SelectionMode(args.selection),
        order=ReleaseOrder(args.order),
        num_selected_heads=k,
        public_heads=public_heads,
        selection_share=args.selection_share,
        score_top_r=args.top_r or k,
        min_sites=1,
        max_chunks_per_site=args.max_chunks,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def run(args: argparse.Namespace) -> int:
    """Run the release and print what it spent and produced."""
    settings = settings_from(args)
    if settings.data_path is None or settings.signing_key is None:
        raise ConfigError("release needs --data DIR and --signing-key FILE (see keygen).")
    noise = secure_noise()
    require_cryptographic(noise)  # production path: no seeded source can reach here
    loaded = load_site_model(settings)
    dataset = load_dataset(settings.data_path)
    plan = _plan(args, args.task or dataset.task, loaded.fingerprint)
    chunks = make_chunks(
        dataset, shots=plan.shots, seed=secret_seed(), max_chunks=plan.max_chunks_per_site
    )
    sums = LocalSums(
        loaded,
        chunks.chunks,
        plan,
        score_method=ScoreMethod(args.score_method),
        batch_size=settings.batch_size,
        instruction=dataset.instruction,
        progress=not args.quiet,
    )
    with PrivacyLedger.open(settings.ledger_path, settings.budget) as ledger:
        result = run_single_holder_release(
            plan,
            sums=sums,
            ledger=ledger,
            signing_key=SigningKey.load(settings.signing_key),
            output=args.out,
            noise=noise,
        )
    outcome, manifest = result.outcome, result.manifest
    print(
        f"released {len(outcome.heads)} heads over {outcome.heads.num_layers_in_scope} layers "
        f"from m={outcome.num_chunks} chunks (K={plan.shots}, C={plan.clip_norm:g}, "
        f"{chunks.num_unused} records unused)\n"
        f"privacy: epsilon={manifest.epsilon:.4g}, delta={manifest.delta:g} "
        f"({manifest.accountant}); noise std={outcome.noise_std:.4g} on the sum, "
        f"signal/noise~{outcome.signal_to_noise:.3g}\n"
        f"artifact: {result.artifact}"
    )
    return 0

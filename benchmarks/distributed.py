"""What not trusting the coordinator costs: DP-MTV accuracy in `central` and `distributed` noise.

Usage (writes docs/benchmarks/distributed.md; a few minutes on 2 cores):

    .venv/bin/python benchmarks/distributed.py [--task colour] [--draws 20]

The federation curve to a thousand small sites (20 examples, 4 chunks each; writes its own
page):

    .venv/bin/python benchmarks/distributed.py --task colour --per-site 20 \
        --curve-sites 3 10 30 100 300 1000 --no-epsilon-sweep \
        --out docs/benchmarks/federation-curve-colour.md

Each of up to 30 sites holds 100 examples of the embedded model's task (content-disjoint test
scenes, client.data.synthetic); every site's clipped sums and votes come from the production
last-token hooks (per-chunk activations, clipped per layer to C for each head scope) and the
production vote scoring (client.release.single_holder.LocalSums), once. For each release the sites'
contributions are combined the way the federation does: `central` sums them and runs the
production release flow (protocol.run_release: Gumbel picks, one Gaussian draw from the
CSPRNG); `distributed` encodes every site's sum with its own discrete-Gaussian share on the
plan's SecAgg+ grid (dpmtv_common.privacy.distributed.encode_site_share, production sampler),
adds the shares and decodes (SecAgg+'s masked sum is bit-exact on that grid,
tests/statistical/test_distributed_secagg.py, so the masking is not re-run here). Private
selection, select-first order, k heads, δ = 1e-5; accuracy on the content-disjoint test
queries, mean ± sd over `--draws` noise draws.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import numpy as np

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.data.records import load_dataset
from client.data.synthetic import write_task_datasets
from client.evaluation.first_token import QuerySet
from client.models import LoadedModel, load_model
from client.models.embedded import EMBEDDED_MODEL_DIR
from client.public.selection import public_activations
from client.release.single_holder import LocalSums
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.distributed import decode_noisy_sum, encode_site_share
from dpmtv_common.privacy.mechanisms import clip_per_layer
from dpmtv_common.privacy.noise import NoiseSource, secure_noise
from protocol import (
    PROTOCOL_VERSION,
    ActivationSum,
    DistributedRelease,
    NoiseMode,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    VoteSum,
    run_release,
)

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
CURVE_SITES = (3, 10, 30)
DEFAULT_OUT = REPO / "docs" / "benchmarks" / "distributed.md"


@dataclass
class SiteCache:
    """One site's per-chunk activations and plain votes, computed once; clipped per scope."""

    sums: LocalSums
    chunk_activations: np.ndarray | None = None  # (m_i, L, H, D), the production hooks
    activations: dict[HeadSet, ActivationSum] = field(default_factory=dict)
    votes: VoteSum | None = None

    def activation(self, heads: HeadSet) -> ActivationSum:
        """The site's sum over chunks of each chunk's ``heads`` clipped per layer to C."""
        if heads not in self.activations:
            if self.chunk_activations is None:
                acts = public_activations(self.sums.loaded, self.sums.chunks, progress=False)
                self.chunk_activations = acts.double().numpy()
            index = heads.to_array()
            rows = self.chunk_activations[:, index[:, 0], index[:, 1], :]
            clip = self.sums.plan.clip_norm
            total = sum(
                clip_per_layer(chunk, row_layers=index[:, 0], clip_norm=clip) for chunk in rows
            )
            self.activations[heads] = ActivationSum(heads, np.asarray(total), len(rows))
        return self.activations[heads]

    def vote(self) -> VoteSum:
        """The site's top-r vote sum (shift scores)."""
        if self.votes is None:
            self.votes = self.sums.vote_sum(None)
        return self.votes


@dataclass
class ConsortiumSums:
    """``protocol.ReleaseSums`` over sites: plain sums (central) or sums of noisy shares."""

    sites: list[SiteCache]
    plan: ReleasePlan
    grids: DistributedRelease | None
    noise: NoiseSource

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        """Σ of the sites' sums over ``heads`` (each a noisy share in distributed mode)."""
        parts = [site.activation(heads) for site in self.sites]
        chunks = sum(part.num_chunks for part in parts)
        if self.grids is None:
            total = np.sum([part.total for part in parts], axis=0)
            return ActivationSum(heads, total, chunks, len(parts))
        grid = self.grids.activations(heads)
        encoded = [encode_site_share(p.total.ravel(), params=grid, noise=self.noise) for p in parts]
        noisy = decode_noisy_sum(np.sum(encoded, axis=0), params=grid, num_sites=len(parts))
        return ActivationSum(heads, noisy.reshape(parts[0].total.shape), chunks, len(parts))

    def vote_sum(self, reference: np.ndarray | None) -> VoteSum:
        """Σ of the sites' votes (each a noisy share in distributed mode)."""
        if reference is not None:
            raise ValueError("this benchmark runs select-first: votes never need a reference.")
        parts = [site.vote() for site in self.sites]
        chunks = sum(part.num_chunks for part in parts)
        if self.grids is None:
            return VoteSum(np.sum([part.total for part in parts], axis=0), chunks)
        grid = self.grids.votes()
        assert grid is not None  # noqa: S101 (private plans always have a vote grid)
        encoded = [encode_site_share(p.total, params=grid, noise=self.noise) for p in parts]
        return VoteSum(
            decode_noisy_sum(np.sum(encoded, axis=0), params=grid, num_sites=len(parts)), chunks
        )


def make_plan(
    args: argparse.Namespace, fingerprint: str, *, epsilon: float, mode: NoiseMode,
    sites: int, min_honest: int, chunks_per_site: int, clip_norm: float,
) -> ReleasePlan:  # fmt: skip
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id="bench-distributed",
        task=args.task,
        model_fingerprint=fingerprint,
        epsilon=epsilon,
        delta=1e-5,
        shots=args.shots,
        clip_norm=clip_norm,
        selection=SelectionMode.PRIVATE,
        order=ReleaseOrder.SELECT_FIRST,
        num_selected_heads=args.heads,
        public_heads=None,
        selection_share=0.3,
        score_top_r=args.heads,
        min_sites=max(min_honest, 2),
        noise_mode=mode,
        min_honest=min_honest,
        max_sites=sites if mode is NoiseMode.DISTRIBUTED else None,
        max_chunks_per_site=chunks_per_site,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


@dataclass(frozen=True)
class Setting:
    """One row: how many sites, which mode, ε and t."""

    label: str
    mode: NoiseMode
    sites: int
    epsilon: float
    min_honest: int


def accuracy_of(
    setting: Setting,
    caches: list[SiteCache],
    loaded: LoadedModel,
    test: QuerySet,
    args,
    clip: float,
) -> list[float]:
    shape = loaded.adapter.head_shape(loaded.model)
    chunks = caches[0].sums.chunks
    plan = make_plan(
        args, loaded.fingerprint, epsilon=setting.epsilon, mode=setting.mode, sites=setting.sites,
        min_honest=setting.min_honest, chunks_per_site=len(chunks), clip_norm=clip,
    )  # fmt: skip
    grids = None
    if setting.mode is NoiseMode.DISTRIBUTED:
        grids = DistributedRelease(plan, shape.layout().dense_size, shape.head_dim)
    scores = []
    for _ in range(args.draws):
        noise = secure_noise()
        sums = ConsortiumSums(caches[: setting.sites], plan, grids, noise)
        outcome = run_release(
            plan, sums=sums, layout=shape.layout(), noise=noise, on_first_noise=lambda: None,
        )  # fmt: skip
        scores.append(test.accuracy(loaded, (outcome.heads, outcome.values)))
    return scores


def settings_to_run(curve_sites: tuple[int, ...], epsilon_sweep: bool) -> list[Setting]:
    rows = []
    for epsilon in EPSILONS if epsilon_sweep else ():
        rows.append(Setting(f"10 sites, ε={epsilon:g}", NoiseMode.CENTRAL, 10, epsilon, 2))
        rows.append(Setting(f"10 sites, ε={epsilon:g}", NoiseMode.DISTRIBUTED, 10, epsilon, 2))
    for sites in curve_sites:
        rows.append(Setting(f"{sites} sites, ε=1", NoiseMode.CENTRAL, sites, 1.0, 2))
        rows.append(Setting(f"{sites} sites, ε=1", NoiseMode.DISTRIBUTED, sites, 1.0, 2))
        half = math.ceil(sites / 2)
        if half != 2:
            rows.append(Setting(f"{sites} sites, ε=1", NoiseMode.DISTRIBUTED, sites, 1.0, half))
    return rows


def prepare(args) -> tuple[LoadedModel, list[SiteCache], QuerySet, float]:
    root = args.workdir
    write_task_datasets(
        root, task=args.task, sites=max(args.curve_sites), per_site=args.per_site, public=100,
        test=args.test, seed=args.seed,
    )  # fmt: skip
    loaded = load_model(args.model, device="cpu")
    public = make_chunks(load_dataset(root / "public"), shots=args.shots, seed=0).chunks
    clip = float(
        public_activations(loaded, public, progress=False).flatten(2).norm(dim=-1).median()
    )
    caches = []
    for index in range(max(args.curve_sites)):
        dataset = load_dataset(root / f"site-{index}")
        chunks = make_chunks(dataset, shots=args.shots, seed=1000 + index).chunks
        plan = make_plan(
            args, loaded.fingerprint, epsilon=1.0, mode=NoiseMode.CENTRAL, sites=2,
            min_honest=2, chunks_per_site=len(chunks), clip_norm=clip,
        )  # fmt: skip
        caches.append(SiteCache(LocalSums(loaded, chunks, plan, progress=False)))
    records = list(load_dataset(root / "test").records)
    test = QuerySet.build(
        loaded, [zero_shot_prompt(r) for r in records], [r.answer for r in records]
    )
    return loaded, caches, test, clip


def write_report(
    args, rows: list[tuple[Setting, list[float]]], clip: float, seconds: float
) -> None:
    lines = [
        "# Central vs distributed noise (benchmarks/distributed.py)",
        "",
        f"Command: `.venv/bin/python benchmarks/distributed.py {_options(args)}` "
        f"({seconds / 60:.1f} min on 2 cores). Embedded model, task "
        f"`{args.task}`, {args.per_site} examples a site (K = {args.shots}: "
        f"{args.per_site // (args.shots + 1)} chunks), private select-first selection of "
        f"k = {args.heads} heads, δ = 1e-5, C = {clip:.3g} (public data), {len(rows[0][1])} noise "
        f"draws a row, {args.test} content-disjoint test queries.",
        "",
        "`distributed`: each site adds a discrete-Gaussian share sized for t honest sites "
        "(σ_site² = σ²/t); the coordinator only decodes the noisy sum. With all n sites honest "
        "the sum holds n shares, so its noise is √(n/t) times what the guarantee needs: the price "
        "of not trusting the coordinator. `central`: one Gaussian draw by the coordinator.",
        "",
        f"With {args.draws} draws a row, differences of less than about two standard "
        f"deviations of the mean (sd/√{args.draws}) are noise; the selection mechanisms differ "
        "too (central: Gumbel top-k on the votes; distributed: top-k of the vote histogram "
        "with the sites' noise).",
        "",
        "| setting | mode | t | accuracy (mean ± sd) | ratio to central |",
        "|---|---|---:|---:|---:|",
    ]
    base = 0.0
    for setting, scores in rows:
        mean = statistics.mean(scores)
        spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
        if setting.mode is NoiseMode.CENTRAL:  # each group starts with its central row
            base = mean
        ratio = f"{mean / base:.2f}" if base > 0 else "n/a"
        t = "-" if setting.mode is NoiseMode.CENTRAL else str(setting.min_honest)
        cells = [setting.label, setting.mode.value, t, f"{mean:.3f} ± {spread:.3f}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _options(args: argparse.Namespace) -> str:
    """The command-line options that made this page (defaults left out)."""
    options = [f"--task {args.task}", f"--draws {args.draws}"]
    if args.per_site != 100:
        options.append(f"--per-site {args.per_site}")
    if tuple(args.curve_sites) != CURVE_SITES:
        options.append("--curve-sites " + " ".join(map(str, args.curve_sites)))
    if args.no_epsilon_sweep:
        options.append("--no-epsilon-sweep")
    if args.out != DEFAULT_OUT:
        options.append(
            f"--out {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
        )
    return " ".join(options)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=EMBEDDED_MODEL_DIR)
    parser.add_argument("--task", default="colour")
    parser.add_argument("--per-site", type=int, default=100)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--curve-sites",
        type=int,
        nargs="+",
        default=list(CURVE_SITES),
        help="consortium sizes of the federation curve at ε = 1 (default 3 10 30)",
    )
    parser.add_argument(
        "--no-epsilon-sweep",
        action="store_true",
        help="skip the ε sweep at 10 sites (only the federation curve)",
    )
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmark-run" / "distributed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    loaded, caches, test, clip = prepare(args)
    rows = []
    for setting in settings_to_run(tuple(args.curve_sites), not args.no_epsilon_sweep):
        scores = accuracy_of(setting, caches, loaded, test, args, clip)
        rows.append((setting, scores))
        print(f"{setting.label:18} {setting.mode.value:11} t={setting.min_honest:<3} "
              f"{statistics.mean(scores):.3f}", flush=True)  # fmt: skip
    write_report(args, rows, clip, time.monotonic() - started)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

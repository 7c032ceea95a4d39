"""Benchmark the secure sum and a whole in-process federated release.

Part 1 times one secure sum of the protocol (``protocol.secure_sum``: roster-signed keys,
Shamir-shared self-mask seeds in sealed boxes, ChaCha20 masks, every survivor signing the
survivor set, unmasking) over 3, 10, 30 and 100 in-process sites at 1e4 and 1e5 float64
coordinates: the sites' :class:`client.secure_sum.SiteSumSession` and the coordinator's
``server.secure_sum.unmask.unmask_total``, driven directly (no messages, no transport:
the protocol's own CPU), and compares the result with the plain float64 sum of the same
inputs. Part 1b runs one sum of ours and one of Flower's own SecAgg+ (stock workflow and
mod) through the same in-process grid, messages included (``benchmarks.secure_sum_grid``).
Part 2 runs whole releases (3 sites, tiny random LLaVA, production noise) in
selection mode ``all`` and ``private`` select-first, and splits the wall time by stage
(``ReleaseReport.stage_seconds``).

Graphs are ``protocol.sum_graph.graph_shape(n, minimum=3)``: complete with a majority
threshold up to 10 sites, beyond it SecAgg+'s sparse graph (Bell et al. 2020), here a random
regular graph drawn from every site's committed-then-revealed nonce, sized so that whatever
the coordinator can unmask holds 3 honest sites with a tenth of the sites colluding (the
nonce round is part of the timed work). Site inputs are uniform in ±64, as a site's sum of
64 chunks clipped to C = 1.

Usage (from the repository root; about 2-3 minutes on 2 cores)::

    .venv/bin/python -m benchmarks.secure_sum [--repeats 5] [--output docs/benchmarks/secure_sum.md]
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One BLAS thread: the Shamir rebuild's small matrix products (and nothing else here) use BLAS,
# and on shared cores a second OpenBLAS thread waiting for a core made each 50-100x slower
# (109 ms against 1.4 ms a seed at 23 shares, load 9), which measured the machine, not the
# protocol. Flower's SecAgg+ uses no BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import numpy as np

from benchmarks.secure_sum_grid import time_flower_sum, time_our_sum_on_grid
from client.data.synthetic import write_task_datasets
from client.models import save_tiny_model
from client.secure_sum import SiteSumSession
from client.service.inprocess import in_process_sites, site_settings_for_partition
from dpmtv_common.crypto import SigningKey
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
from dpmtv_common.roster import Roster
from protocol.secure_sum import (
    AddressedBox,
    NodeBytes,
    SumRanges,
    SurvivorsRequest,
    UnmaskRequest,
    dequantise,
    ranges_for,
)
from protocol.sum_graph import graph_shape
from server.coordinator import ReleaseReport, run_coordinated_release
from server.secure_sum.unmask import unmask_total
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import InProcessGrid, make_server_context

REPO = Path(__file__).resolve().parents[1]
SITE_COUNTS = (3, 10, 30, 100)
MINIMUM = 3  # honest sites whatever the coordinator unmasks must hold (the plan's min_sites)
DIMENSIONS = (10_000, 100_000)
GRID_DIMENSION = 10_000
SITE_BOUND = 64.0  # |coordinate| of a site's input: its sum of 64 chunks clipped to C = 1
RELEASE_SITES = 3
RELEASE_RECORDS = 60  # per site: 12 chunks at K = 4
RELEASE_SHOTS = 4
COMMAND = ".venv/bin/python -m benchmarks.secure_sum"


@dataclass(frozen=True)
class SumResult:
    """Timing and error of one (sites, floats) configuration."""

    sites: int
    dimension: int
    num_shares: str
    threshold: str
    median_s: float
    min_s: float
    cpu_s: float
    max_abs_error: float
    error_bound: float


@dataclass(frozen=True)
class GridResult:
    """Median seconds of one sum through the in-process grid: ours and Flower's SecAgg+."""

    sites: int
    dimension: int
    ours_s: float
    flower_s: float
    ours_cpu_s: float
    flower_cpu_s: float
    flower_shares: str
    ours_error: float


@dataclass(frozen=True)
class ReleaseResult:
    """Stage timings (medians) and the DP figures of one selection mode."""

    selection: str
    stage_median_s: dict[str, float]
    total_median_s: float
    first_run_s: float
    num_chunks: int
    num_heads: int
    layers_in_scope: int
    clip_norm: float
    noise_std: float
    signal_to_noise: float


def time_secure_sum(sites: int, dimension: int, repeats: int) -> SumResult:
    ranges = ranges_for(SITE_BOUND, sites)
    seconds, cpu, errors = [], [], []
    shape = graph_shape(sites, minimum=MINIMUM)
    for repeat in range(repeats):
        inputs = {
            node: np.random.default_rng([node, repeat, dimension]).uniform(
                -SITE_BOUND, SITE_BOUND, size=dimension
            )
            for node in range(1, sites + 1)
        }
        started, started_cpu = time.perf_counter(), time.process_time()
        total, survivors = _one_sum(inputs, ranges)
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        expected = np.sum([inputs[n] for n in survivors], axis=0, dtype=np.float64)
        errors.append(float(np.max(np.abs(total - expected))))
    return SumResult(
        sites=sites,
        dimension=dimension,
        num_shares=str(shape.degree + 1),
        threshold=str(shape.threshold),
        median_s=statistics.median(seconds),
        min_s=min(seconds),
        cpu_s=statistics.median(cpu),
        max_abs_error=max(errors),
        error_bound=sites * ranges.clipping_range / ranges.quantization_range,
    )


def time_on_grid(sites: int, dimension: int, repeats: int) -> GridResult:
    ours = [time_our_sum_on_grid(sites, dimension, seed) for seed in range(repeats)]
    flower = [time_flower_sum(sites, dimension, seed) for seed in range(repeats)]
    return GridResult(
        sites=sites,
        dimension=dimension,
        ours_s=statistics.median(seconds for seconds, _, _ in ours),
        flower_s=statistics.median(seconds for seconds, _, _ in flower),
        ours_cpu_s=statistics.median(cpu for _, cpu, _ in ours),
        flower_cpu_s=statistics.median(cpu for _, cpu, _ in flower),
        flower_shares=flower[0][2],
        ours_error=max(error for _, _, error in ours),
    )


def _one_sum(inputs: dict[int, np.ndarray], ranges: SumRanges) -> tuple[np.ndarray, list[int]]:
    """Every stage of one sum: keys, shares, masking, signed survivors, unmasking."""
    identities = {node: SigningKey.generate() for node in inputs}
    roster = Roster("bench", {f"s{node}": key.verify_key for node, key in identities.items()})
    sessions = {
        node: SiteSumSession("bench", node, f"s{node}", roster, key, 1, MINIMUM, 0.5)
        for node, key in identities.items()
    }
    adverts = [session.advertise() for session in sessions.values()]
    for session in sessions.values():
        session.join(adverts)
    shape = next(iter(sessions.values())).agreement.shape  # type: ignore[union-attr]
    nonces = (
        []
        if shape.complete
        else [NodeBytes(node_id=node, value=s.reveal_nonce().nonce) for node, s in sessions.items()]
    )
    boxes = {}
    for node, session in sessions.items():
        session.draw_graph(adverts, nonces)
        session.begin_sum(0)
        boxes[node] = session.seal_shares()
    masked = {node: s.mask(inputs[node], ranges) for node, s in sessions.items()}
    survivors = sorted(masked)
    signatures = []
    for node in survivors:
        inbox = [
            AddressedBox(node_id=sender, box=box.box)
            for sender, sent in boxes.items()
            for box in sent
            if box.node_id == node
        ]
        request = SurvivorsRequest(
            release_id="bench", sum_index=0, survivors=survivors, boxes=inbox
        )
        signed = sessions[node].sign_survivors(request)
        signatures.append(NodeBytes(node_id=node, value=signed.signature))
    unmask = UnmaskRequest(
        release_id="bench", sum_index=0, survivors=survivors, signatures=signatures
    )
    replies = {node: sessions[node].reveal(unmask) for node in survivors}
    graph = next(iter(sessions.values())).drawn.graph  # type: ignore[union-attr]
    total = unmask_total(
        masked=masked,
        replies=replies,
        participants=survivors,
        neighbours=graph.neighbours,
        threshold=shape.threshold,
        modulus=ranges.modulus_range,
    )
    return dequantise(total, ranges, len(survivors)), survivors


def prepare_release_world(work: Path) -> str:
    """Write site data, the tiny model and the coordinator key; point the sites at them."""
    write_task_datasets(
        work / "data",
        task="colour",
        sites=RELEASE_SITES,
        per_site=RELEASE_RECORDS,
        public=0,
        test=0,
        seed=0,
    )
    save_tiny_model("llava", work / "model", seed=0)
    key = SigningKey.generate()
    key.save(work / "coordinator.key")
    key.verify_key.save(work / "coordinator.pub")
    site = "site-{partition-id}"
    os.environ.update(
        {
            "DPMTV_CLIENT_NAME": site,
            "DPMTV_CLIENT_MODEL_PATH": str(work / "model"),
            "DPMTV_CLIENT_DATA_PATH": str(work / "data" / site),
            "DPMTV_CLIENT_TRUSTED_KEYS": str(work / "coordinator.pub"),
            "DPMTV_CLIENT_DEVICE": "cpu",
            "DPMTV_CLIENT_BUDGET_EPSILON": "1000",
            "DPMTV_CLIENT_MIN_SITES": "2",
        }
    )
    return fingerprint_model_dir(work / "model")


def run_release_once(work: Path, fingerprint: str, selection: str, run: int) -> ReleaseReport:
    state = work / f"{selection}-{run}"
    state.mkdir()  # ledgers are opened, not their folders created
    site = "site-{partition-id}"
    os.environ["DPMTV_CLIENT_STATE_DIR"] = str(state / f"{site}-state")
    os.environ["DPMTV_CLIENT_LEDGER_PATH"] = str(state / f"{site}-ledger.sqlite")
    os.environ["DPMTV_CLIENT_ARTIFACTS_DIR"] = str(state / f"{site}-artifacts")
    config: dict[str, bool | float | int | str] = {
        "model-fingerprint": fingerprint,
        "release-id": f"bench-{selection}-{run}",
        "selection": selection,
        "order": "select-first",
        "shots": RELEASE_SHOTS,
        "clip-norm": 1.0,
        "num-selected-heads": 2,
        "expected-sites": RELEASE_SITES,
        "min-sites": 2,
    }
    noise = secure_noise()
    require_cryptographic(noise)
    settings = CoordinatorSettings(
        signing_key=work / "coordinator.key",
        ledger_path=state / "consortium-ledger.sqlite",
        budget_epsilon=1000.0,
        artifacts_dir=state / "coordinator-artifacts",
    )
    extra = {"ledger-path": str(state / "site-{partition-id}.sqlite")}
    site_settings = [site_settings_for_partition(i, extra) for i in range(RELEASE_SITES)]
    with in_process_sites(site_settings) as sites:
        grid = InProcessGrid(sites.relays, num_nodes=RELEASE_SITES, run_config=config)
        return run_coordinated_release(
            grid, make_server_context(config), RunConfig.from_context(config), settings, noise
        )


def time_release(work: Path, fingerprint: str, selection: str, repeats: int) -> ReleaseResult:
    reports: list[ReleaseReport] = []
    totals = []
    for run in range(repeats):
        started = time.perf_counter()
        report = run_release_once(work, fingerprint, selection, run)
        totals.append(time.perf_counter() - started)
        reports.append(report)
        print(f"    {selection} run {run + 1}/{repeats}: {totals[-1]:.2f} s", flush=True)
    stages = list(reports[0].stage_seconds)
    outcome = reports[-1].outcome
    return ReleaseResult(
        selection=selection,
        stage_median_s={s: statistics.median(r.stage_seconds[s] for r in reports) for s in stages},
        total_median_s=statistics.median(totals),
        first_run_s=totals[0],
        num_chunks=outcome.num_chunks,
        num_heads=len(outcome.heads),
        layers_in_scope=outcome.gaussian_heads.num_layers_in_scope,
        clip_norm=reports[-1].plan.clip_norm,
        noise_std=outcome.noise_std,
        signal_to_noise=outcome.signal_to_noise,
    )


def machine_facts() -> list[str]:
    nproc = len(os.sched_getaffinity(0))  # what `nproc` prints
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return [
        f"- `nproc`: {nproc} ({cpu})",
        f"- Python {platform.python_version()} on {platform.platform()}",
        f"- flwr {version('flwr')}, numpy {np.__version__}, cryptography "
        f"{version('cryptography')}, opendp {version('opendp')}",
        f"- load average at start (1, 5, 15 min): {load} — other jobs shared the cores",
        f"- OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}: one BLAS thread "
        "(the Shamir rebuild's small products; with a second thread waiting for a shared core "
        "each was 50-100x slower)",
        f"- run on {datetime.now(UTC).isoformat(timespec='seconds')}",
    ]


def render(
    sums: list[SumResult],
    grids: list[GridResult],
    releases: list[ReleaseResult],
    repeats: int,
    facts: list[str],
) -> str:
    lines = [
        "# Secure-sum benchmark",
        "",
        f"Reproduce: `{COMMAND} --repeats {repeats}` (writes this file).",
        "",
        *facts,
        "",
        "## One secure sum (in-process sites, the protocol's own work)",
        "",
        f"Median and fastest wall time, and median CPU time of the process (what other jobs "
        f"on the cores do not inflate), of {repeats} runs of every stage of one sum "
        "(roster-signed keys and their checks, X25519 agreements, Shamir shares in sealed "
        "boxes, ChaCha20 masks, survivor signatures and their checks, unmasking), all sites "
        "and the coordinator in one process, messages neither serialised nor sent. Site "
        f"inputs uniform in ±{SITE_BOUND:g}; the error is the largest |secure - float64 sum| "
        "over all runs and coordinates; the bound is n·c/Q (rounding to nearest).",
        "",
        "| sites | floats | num_shares | threshold | median (s) | min (s) | CPU (s) "
        "| max abs error | error bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.sites} | {r.dimension:,} | {r.num_shares} | {r.threshold} | {r.median_s:.3f} "
        f"| {r.min_s:.3f} | {r.cpu_s:.3f} | {r.max_abs_error:.2e} | {r.error_bound:.2e} |"
        for r in sums
    ]
    stage_names = list(releases[0].stage_median_s)
    lines += ["", share_note(), "", *render_grid(grids, repeats), ""]
    lines += [
        f"## Whole release, {RELEASE_SITES} sites in-process (tiny random LLaVA)",
        "",
        f"Median of {repeats} runs of `server.coordinator.run_coordinated_release` with the "
        f"production noise source, {RELEASE_RECORDS} records a site, K = {RELEASE_SHOTS} "
        "shots, C = 1, ε = 1, δ = 1e-5, select-first; private mode picks k = 2 heads. "
        "`sums+noise` holds the secure sums, the sites' forward passes, the Gumbel picks "
        "and the Gaussian draw; `other` is the untimed rest of the call (total minus the "
        "stages): opening the consortium ledger, the reservation with the plan's "
        "calibration, the commit, and building the grid. The calibration is cached per "
        "process, so only the first run of a mode pays it (and the model load): a real "
        "ServerApp, one process per run, pays it every time.",
        "",
        "| selection | "
        + " | ".join(f"{name} (s)" for name in stage_names)
        + " | other (s) | total (s) | first run (s) | m | heads | L_scope | C | σ | SNR |",
        "|---|" + "---:|" * (len(stage_names) + 9),
    ]
    lines += [
        f"| {r.selection} | "
        + " | ".join(f"{r.stage_median_s[name]:.2f}" for name in stage_names)
        + f" | {r.total_median_s - sum(r.stage_median_s.values()):.2f}"
        f" | {r.total_median_s:.2f} | {r.first_run_s:.2f} | {r.num_chunks} | {r.num_heads}"
        f" | {r.layers_in_scope}"
        f" | {r.clip_norm:g} | {r.noise_std:.3f} | {r.signal_to_noise:.2f} |"
        for r in releases
    ]
    lines += [
        "",
        "The tiny model's weights are random, so the SNR says nothing about utility; it is "
        "listed because every benchmark reports m, |S|, L_scope, C, σ and SNR.",
        "",
    ]
    return "\n".join(lines)


def render_grid(grids: list[GridResult], repeats: int) -> list[str]:
    return [
        "## One secure sum beside Flower's SecAgg+ (in-process grid, messages included)",
        "",
        f"Median of {repeats} sums of each, every message through `server.simulation."
        "InProcessGrid` (copied record by record, no sockets): ours is the coordinator's "
        "`SecureSumSession` against every site's real handlers (the nonce round beyond 10 "
        "sites, roster-checked keys and signatures, the survivor set's checks), plan "
        "acceptance excluded; Flower's is flwr's stock `SecAggPlusWorkflow` (under "
        "`DefaultWorkflow` and `FedAvg`, as flwr 1.42 runs it) against a `ClientApp` with "
        "`secaggplus_mod`: its own key agreement every sum, four round trips, its MT19937 "
        "masks, no consistency check, with our shares and threshold (its ring otherwise). "
        "Site inputs uniform in ±64 (ours; its error is the largest |secure - float64 "
        "sum|) and ±8 (Flower's default clipping range).",
        "",
        "| sites | floats | ours (s) | ours CPU (s) | Flower's SecAgg+ (s) | Flower's CPU (s) "
        "| Flower's shares, threshold | our max abs error |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
        *(
            f"| {g.sites} | {g.dimension:,} | {g.ours_s:.3f} | {g.ours_cpu_s:.3f} "
            f"| {g.flower_s:.3f} | {g.flower_cpu_s:.3f} | {g.flower_shares} "
            f"| {g.ours_error:.2e} |"
            for g in grids
        ),
    ]


def share_note() -> str:
    return (
        "num_shares is the neighbourhood (the site included) and threshold the shares that "
        "rebuild a self-mask seed: everyone is everyone's neighbour up to 10 sites (a "
        "majority rebuilds); beyond, a random regular graph drawn from every site's "
        "committed nonce, sized so that whatever can be unmasked holds 3 honest sites with "
        "a tenth of the sites colluding (`protocol.sum_graph`, docs/design.md threat model). "
        "Beyond 10 sites the time includes the nonce round and the graph's draw."
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--output", type=Path, default=REPO / "docs" / "benchmarks" / "secure_sum.md"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    facts = machine_facts()
    time_secure_sum(3, 1_000, 1)  # warm-up: imports and first-call costs
    sums = []
    for sites in SITE_COUNTS:
        for dimension in DIMENSIONS:
            print(f"secure sum: {sites} sites x {dimension:,} floats ...", flush=True)
            result = time_secure_sum(sites, dimension, args.repeats)
            print(
                f"    median {result.median_s:.3f} s, max abs error {result.max_abs_error:.2e}",
                flush=True,
            )
            sums.append(result)
    grids = []
    for sites in SITE_COUNTS:
        print(f"on the grid, ours and Flower's SecAgg+: {sites} sites ...", flush=True)
        grids.append(time_on_grid(sites, GRID_DIMENSION, args.repeats))
        print(f"    ours {grids[-1].ours_s:.3f} s, Flower's {grids[-1].flower_s:.3f} s", flush=True)
    releases = []
    with tempfile.TemporaryDirectory(prefix="dpmtv-bench-") as tmp:
        work = Path(tmp)
        print("release: writing data and the tiny model ...", flush=True)
        fingerprint = prepare_release_world(work)
        for selection in ("all", "private"):
            print(f"release: selection {selection} ...", flush=True)
            releases.append(time_release(work, fingerprint, selection, args.repeats))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(sums, grids, releases, args.repeats, facts))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

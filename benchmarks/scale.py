"""Benchmark a whole in-process release as the consortium grows: wall, CPU and peak memory.

Each configuration (a number of sites and a noise mode) runs in a fresh process, so its peak
resident memory is its own: the release that ``scripts/demo`` runs (every site a real site
service behind a real relay, SecAgg+ with ChaCha20 masks, one Gaussian draw in central mode
or each site's own share in distributed mode, signed broadcast, ledgers) on a tiny random
LLaVA, each site holding ``--per-site`` synthetic records (4 chunks at K = 4). Reported: the
release's wall time and its split by stage, the process CPU time over the release, the peak
resident set of the whole process, and how many models the process loaded (sites share one,
``client.models.shared``).

Usage (from the repository root)::

    .venv/bin/python benchmarks/scale.py --sites 3 10 30 100 [--modes central distributed]
        [--output docs/benchmarks/scale.md]   # and scale.png beside it

One configuration only (what the parent runs; prints one JSON line)::

    .venv/bin/python benchmarks/scale.py --one 30 central --workdir /tmp/scale-30
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import logging
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

COMMAND = ".venv/bin/python benchmarks/scale.py"
SHOTS = 4
PER_SITE = 20  # records: 4 chunks of K + 1 = 5
MODES = ("central", "distributed")


@dataclass(frozen=True)
class Row:
    """One configuration's measurements."""

    sites: int
    mode: str
    wall_s: float
    cpu_s: float
    peak_mib: float
    models_loaded: int
    stages: dict[str, float]
    acknowledged: int


def run_one(sites: int, mode: str, work: Path, per_site: int) -> Row:
    """Prepare and run one release in this process; measure it."""
    from client.data.synthetic import write_task_datasets
    from client.models import save_tiny_model
    from client.models.shared import check_shared_contents, shared_model_count
    from dpmtv_common.crypto import SigningKey

    work.mkdir(parents=True, exist_ok=True)
    write_task_datasets(
        work / "data", task="colour", sites=sites, per_site=per_site, public=0, test=0, seed=0
    )
    model = work / "model"
    save_tiny_model("llava", model, seed=0)
    key = SigningKey.generate()
    key.save(work / "coordinator.key")
    key.verify_key.save(work / "coordinator.pub")
    _site_environment(work, model, mode, sites)
    cpu, wall = time.process_time(), time.monotonic()
    report = _release(sites, mode, model, per_site)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    check_shared_contents()  # no site wrote to the shared weights
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return Row(
        sites=sites,
        mode=mode,
        wall_s=wall,
        cpu_s=cpu,
        peak_mib=peak_kib / 1024,
        models_loaded=shared_model_count(),
        stages=dict(report.stage_seconds),
        acknowledged=len(report.acknowledged),
    )


def _site_environment(work: Path, model: Path, mode: str, sites: int) -> None:
    site = "site-{partition-id}"
    os.environ.update(
        {
            "DPMTV_CLIENT_NAME": site,
            "DPMTV_CLIENT_MODEL_PATH": str(model),
            "DPMTV_CLIENT_DATA_PATH": str(work / "data" / site),
            "DPMTV_CLIENT_STATE_DIR": str(work / f"{site}-state"),
            "DPMTV_CLIENT_LEDGER_PATH": str(work / f"{site}-ledger.sqlite"),
            "DPMTV_CLIENT_ARTIFACTS_DIR": str(work / f"{site}-artifacts"),
            "DPMTV_CLIENT_TRUSTED_KEYS": str(work / "coordinator.pub"),
            "DPMTV_CLIENT_MIN_SITES": str(min(sites, 3)),
            "DPMTV_CLIENT_NOISE_MODE": mode,
            "DPMTV_CLIENT_DEVICE": "cpu",
            "DPMTV_SERVER_SIGNING_KEY": str(work / "coordinator.key"),
            "DPMTV_SERVER_LEDGER_PATH": str(work / "consortium-ledger.sqlite"),
            "DPMTV_SERVER_ARTIFACTS_DIR": str(work / "coordinator-artifacts"),
        }
    )


def _release(sites: int, mode: str, model: Path, per_site: int):  # -> ReleaseReport
    from client.service.inprocess import in_process_sites, site_settings_for_partition
    from dpmtv_common.fingerprint import fingerprint_model_dir
    from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
    from server.coordinator import run_coordinated_release
    from server.settings import CoordinatorSettings, RunConfig
    from server.simulation import InProcessGrid, make_server_context

    run_config: dict[str, bool | float | int | str] = {
        "task": "colour",
        "model-fingerprint": fingerprint_model_dir(model),
        "epsilon": 1.0,
        "shots": SHOTS,
        "clip-norm": 1.0,
        "num-selected-heads": 4,
        "expected-sites": sites,
        "min-sites": min(sites, 3),
        "noise-mode": mode,
    }
    if mode == "distributed":  # bounds every site's sum on SecAgg+'s grid
        run_config["max-chunks-per-site"] = per_site // (SHOTS + 1)
    noise = secure_noise()
    require_cryptographic(noise)
    settings = [site_settings_for_partition(i) for i in range(sites)]
    with in_process_sites(settings) as opened:
        grid = InProcessGrid(opened.relays, num_nodes=sites, run_config=run_config)
        return run_coordinated_release(
            grid,
            make_server_context(run_config),
            RunConfig.from_context(run_config),
            CoordinatorSettings(),
            noise,
        )


def run_child(sites: int, mode: str, per_site: int, timeout: float) -> Row | str:
    """Run one configuration in a fresh process; its row, or why it failed."""
    with tempfile.TemporaryDirectory(prefix=f"dpmtv-scale-{sites}-{mode}-") as tmp:
        command = [sys.executable, __file__, "--one", str(sites), mode, "--workdir", tmp]
        command += ["--per-site", str(per_site)]
        try:
            done = subprocess.run(  # noqa: S603 - our own script, fixed arguments
                command, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return f"did not finish in {timeout:.0f} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"exit {done.returncode}: {tail[:200]}"
    return Row(**json.loads(lines[-1]))


def table(rows: list[Row | tuple[int, str, str]]) -> list[str]:
    """Markdown rows: one per configuration, failures as such."""
    lines = [
        "| sites | noise mode | wall (s) | CPU (s) | peak RSS (MiB) | models loaded | stages (s) |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if isinstance(row, tuple):
            sites, mode, why = row
            lines.append(f"| {sites} | {mode} | — | — | — | — | failed: {why} |")
            continue
        stages = ", ".join(f"{name} {seconds:.1f}" for name, seconds in row.stages.items())
        lines.append(
            f"| {row.sites} | {row.mode} | {row.wall_s:.1f} | {row.cpu_s:.1f} | "
            f"{row.peak_mib:.0f} | {row.models_loaded} | {stages} |"
        )
    return lines


def report(rows: list[Row | tuple[int, str, str]], args: argparse.Namespace) -> str:
    """The whole markdown page."""
    sizes = " ".join(str(size) for size in args.sites)
    modes = " ".join(args.modes)
    return "\n".join(
        [
            "# Scale: a whole in-process release from 3 sites up",
            "",
            f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
            f"{os.cpu_count()} CPUs (load average at start {os.getloadavg()[0]:.1f}), "
            f"Python {platform.python_version()}. Reproduce:",
            "",
            f"    {COMMAND} --sites {sizes} --modes {modes} --per-site {args.per_site}",
            "",
            "Each row is one fresh process: the release `scripts/demo` runs (sites behind relays, "
            "SecAgg+ with ChaCha20 masks, signed broadcast, ledgers) on a tiny random LLaVA, "
            f"{args.per_site} synthetic records a site ({args.per_site // (SHOTS + 1)} chunks at "
            f"K = {SHOTS}), private head selection of 4 heads, epsilon = 1. Wall and CPU cover "
            "opening the site services (the one model load included) and the release (plan to "
            "broadcast), not writing the data and the model; the stages split the release. "
            "Peak RSS is the whole process's. Every site shares one read-only model "
            "(`client.models.shared`); its weights are checked byte for byte after the release.",
            "",
            *table(rows),
            "",
            "![CPU seconds and peak memory against sites](scale.png)",
            "",
            "CPU is the figure to compare between runs: on shared cores the wall time also counts "
            "the time other processes held them (the load average above). Peak RSS is mostly "
            "torch and transformers themselves; one model serves every site, so it stays flat as "
            "sites are added.",
            "",
        ]
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[3, 10, 30, 100])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--per-site", type=int, default=PER_SITE)
    parser.add_argument("--timeout", type=float, default=3600.0, help="per configuration (s)")
    parser.add_argument("--output", type=Path, help="write the markdown page here")
    parser.add_argument("--one", nargs=2, metavar=("SITES", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--plot-only",
        type=Path,
        metavar="PAGE",
        help="redraw the plot beside an existing page from its table, without running",
    )
    return parser.parse_args()


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # SecAgg+ logs every stage at DEBUG
    args = parse_args()
    if args.plot_only is not None:
        _plot_beside(args.plot_only)
        return 0
    if args.one is not None:
        sites, mode = int(args.one[0]), args.one[1]
        print(json.dumps(asdict(run_one(sites, mode, args.workdir, args.per_site))))
        return 0
    rows: list[Row | tuple[int, str, str]] = []
    for sites in args.sites:
        for mode in args.modes:
            outcome = run_child(sites, mode, args.per_site, args.timeout)
            rows.append(outcome if isinstance(outcome, Row) else (sites, mode, outcome))
            print(table([rows[-1]])[-1], flush=True)
    page = report(rows, args)
    if args.output is not None:
        args.output.write_text(page, encoding="utf-8")
        _plot_beside(args.output)
    print(page)
    return 0


def _plot_beside(page: Path) -> None:
    """``scale.png`` beside the page, drawn from the page's own table."""
    from benchmarks._scale_plot import plot, points_from_page

    plot(points_from_page(page.read_text(encoding="utf-8")), page.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())

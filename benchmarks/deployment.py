"""Benchmark a whole deployed release: TLS SuperLink, authenticated SuperNodes, site services.

Starts the real processes of ``scripts/local_consortium.py`` on 127.0.0.1 (one
``flower-superlink`` with TLS and SuperNode authentication, per site a ``dpmtv-site serve``
service and a ``flower-supernode`` given only the service's socket), submits one
``flwr run`` (``selection='all'``, shots 2, tiny random LLaVA, 30 records a site) and reports:

* the coordinator's stage seconds (the ServerApp's summary line) and the whole run as Flower
  sees it (``flwr run`` submitted → status ``finished``);
* per Flower message at the sites, read off the SuperNode logs: the *pickup* (the site's
  previous reply sent → this message received: the SuperNode's idle poll of 3 s, hard-coded
  in flwr 1.42 ``supernode/start_client_internal.py``, plus the coordinator waiting for the
  slowest site), the *process start* (received → ``flwr-clientapp`` running: the SuperExec's
  task poll plus a fresh Python process importing Flower, once per message) and the
  *handling* (``flwr-clientapp`` running → reply sent: relay plus site service);
* Flower's floor, in the same run: on the same SuperLink and SuperNodes, right after the
  release, a stock Flower app with a no-op ClientApp (``benchmarks/flower_floor``) makes as
  many round trips as the release took messages a site (``--no-floor`` skips it).

Usage (from the repository root; about 2-3 minutes per consortium size on 2 cores)::

    .venv/bin/python -m benchmarks.deployment [--sites 3 --sites 10] \
        [--run-config "selection='private' order='release-first'"] \
        [--compare "before (e1d4c23)=/tmp/old-workdir"] \
        [--output docs/benchmarks/deployment.md [--table NAME]]

``--output`` replaces the table between the ``<!-- deployment table -->`` markers (with
``--table NAME``: ``<!-- deployment table NAME -->``) of an existing page
(docs/benchmarks/deployment.md keeps its text), or writes a new file. ``--run-config`` changes
the release (default ``selection='all' shots=2``).
``--compare LABEL=WORKDIR[:SITES[:RUN_SECONDS]]`` adds the table of an earlier
``local_consortium.py run`` workdir (e.g. one made from an older commit) for a before/after
comparison.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

from scripts.local_consortium import (
    Consortium,
    make_credentials,
    prepare_consortium,
    stage_timings,
)

FLOOR_APP = REPO / "benchmarks" / "flower_floor"
FLOOR_LABEL = "stock Flower app (no-op)"
_FLOOR = re.compile(r"floor seconds: ([0-9.]+)")
_LINE = re.compile(r"^\[\s*([0-9.]+)\] (.*)$")
_EVENTS = {
    "receiving": re.compile(r"Receiving: (\S+) message"),
    "started": re.compile(r"Start `flwr-clientapp` process"),
    "sending": re.compile(r"Sending: (\S+) message"),
}


@dataclass
class Measured:
    """One release's timings."""

    label: str
    sites: int
    status: str
    run_seconds: float
    stages: dict[str, float]
    pickup: list[float] = field(default_factory=list)
    process_start: list[float] = field(default_factory=list)
    handling: list[float] = field(default_factory=list)
    messages_per_site: int = 0
    chunks: int | None = None
    given_up: int = 0

    @property
    def round_trip(self) -> float:
        """Mean seconds per message at a site (pickup + process start + handling)."""
        return sum(_mean(values) for values in (self.pickup, self.process_start, self.handling))


def site_hops(log: Path, since: float = 0.0) -> tuple[list[float], list[float], list[float]]:
    """Pickup, process-start and handling seconds of every message in one SuperNode log.

    ``since``: only lines stamped at or after this many seconds (a later run on the same
    SuperNodes).
    """
    events: list[tuple[str, float]] = []
    for raw in log.read_text(encoding="utf-8").splitlines():
        match = _LINE.match(raw)
        if match is None or float(match.group(1)) < since:
            continue
        for kind, pattern in _EVENTS.items():
            if pattern.search(match.group(2)):
                events.append((kind, float(match.group(1))))
    pickup, start, handling = [], [], []
    last_sent = received = started = None
    for kind, at in events:
        if kind == "receiving":
            if last_sent is not None:
                pickup.append(at - last_sent)
            received = at
        elif kind == "started" and received is not None:
            start.append(at - received)
            started = at
        elif kind == "sending" and started is not None:
            handling.append(at - started)
            last_sent, received, started = at, None, None
    return pickup, start, handling


def analyse(
    label: str,
    workdir: Path,
    sites: int,
    status: str,
    seconds: float,
    *,
    run_log_name: str = "flwr-run",
    since: float = 0.0,
) -> Measured:
    """Read stage timings and per-message hops off a consortium's logs.

    ``run_log_name``/``since``: the run's own log, and where its lines start in the site logs.
    """
    logs = workdir / "logs"
    run_log = (logs / f"{run_log_name}.log").read_text(encoding="utf-8")
    floor = _FLOOR.search(run_log)
    stages = {"round trips": float(floor.group(1))} if floor else stage_timings(run_log)
    measured = Measured(label, sites, status, seconds, stages)
    chunks = re.search(r"m=(\d+) chunks", run_log)
    measured.chunks = int(chunks.group(1)) if chunks else None
    measured.given_up = len(re.findall(r"gave up on ", run_log))
    for index in range(sites):
        pickup, start, handling = site_hops(logs / f"site-{index}.log", since)
        measured.pickup += pickup
        measured.process_start += start
        measured.handling += handling
        measured.messages_per_site = max(measured.messages_per_site, len(handling))
    return measured


def run_once(
    workdir: Path,
    sites: int,
    label: str,
    overrides: dict[str, object] | None = None,
    *,
    with_floor: bool = True,
) -> list[Measured]:
    """Prepare a consortium of ``sites`` under ``workdir``, make one release, analyse it.

    With ``with_floor``, the stock Flower app of ``benchmarks/flower_floor`` then makes as many
    round trips as the release took messages a site, on the same SuperLink and SuperNodes.
    """
    files = prepare_consortium(workdir, sites=sites, per_site=30)
    creds = make_credentials(workdir / "credentials", [site.name for site in files.sites])
    config: dict[str, object] = {
        "task": "colour",
        "model-fingerprint": files.fingerprint,
        "selection": "all",
        "shots": 2,
        "expected-sites": sites,
        "min-sites": 2,
        "stage-timeout": 600.0,
        **(overrides or {}),
    }
    with Consortium(workdir, creds, coordinator_env=files.coordinator_env()) as consortium:
        consortium.start_superlink()
        for site in files.sites:
            consortium.register(site.name)
            consortium.start_site_service(site)
            consortium.start_supernode(site)
        result = consortium.wait_run(consortium.submit(config), timeout=1200)
        release = analyse(label, workdir, sites, result.status, result.seconds)
        if not with_floor:
            return [release]
        since = time.monotonic() - consortium.started
        floor_config = {"rounds": max(release.messages_per_site, 1), "expected-sites": sites}
        run = consortium.submit(floor_config, app=FLOOR_APP, name="flwr-run-floor")
        done = consortium.wait_run(run, timeout=600)
    floor = analyse(
        FLOOR_LABEL,
        workdir,
        sites,
        done.status,
        done.seconds,
        run_log_name="flwr-run-floor",
        since=since,
    )
    return [release, floor]


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def table(rows: list[Measured]) -> str:
    """Markdown: one column per measured release."""
    stages = ("wait", "plan", "sums+noise", "broadcast")
    head = "| | " + " | ".join(f"{r.label}, {r.sites} sites" for r in rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]

    def add(name: str, cells: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    add("status", [r.status for r in rows])
    add("chunks released (m)", [str(r.chunks) if r.chunks is not None else "—" for r in rows])
    add("sites given up as silent", [str(r.given_up) for r in rows])
    for stage in stages:
        add(f"ServerApp: {stage} (s)", [_seconds(r.stages.get(stage)) for r in rows])
    add("**ServerApp total (s)**", [f"**{sum(r.stages.values()):.1f}**" for r in rows])
    add("flwr run → finished (s)", [f"{r.run_seconds:.1f}" for r in rows])
    add("messages per site", [str(r.messages_per_site) for r in rows])
    add("per message: pickup (s)", [f"{_mean(r.pickup):.2f}" for r in rows])
    add("per message: process start (s)", [f"{_mean(r.process_start):.2f}" for r in rows])
    add("per message: handling (s)", [f"{_mean(r.handling):.2f}" for r in rows])
    add("per message: total at a site (s)", [f"{r.round_trip:.2f}" for r in rows])
    return "\n".join(lines)


def write_report(path: Path, report: str, name: str = "") -> None:
    """Replace the table between the markers ``name`` of an existing page, or write a new file.

    The markers are ``<!-- deployment table[ NAME] -->`` and ``<!-- /deployment table[ NAME] -->``.
    """
    suffix = f" {name}" if name else ""
    begin, end = f"<!-- deployment table{suffix} -->", f"<!-- /deployment table{suffix} -->"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = f"{head}{begin}\n{report}{end}{rest.split(end, 1)[1]}"
    else:
        text = report
    path.write_text(text, encoding="utf-8")


def parse_run_config(text: str) -> dict[str, object]:
    """``"key=value key=value"`` (TOML scalars: 'text', 1, 0.5, true) as a dict."""
    import tomllib

    config: dict[str, object] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--run-config items must look like key=value, got {item!r}")
        config[key] = tomllib.loads(f"v = {value}")["v"]
    return config


def _environment() -> str:
    load = os.getloadavg()
    return (
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}, "
        f"flwr {version('flwr')}, {os.cpu_count()} CPU cores, load average "
        f"{load[0]:.1f} when written"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, action="append", help="consortium size (repeat)")
    parser.add_argument(
        "--compare", action="append", default=[], help="LABEL=WORKDIR[:SITES[:RUN_SECONDS]]"
    )
    parser.add_argument("--label", default="this checkout")
    parser.add_argument(
        "--run-config",
        default="",
        help="'key=value ...' over the default release (selection='all' shots=2)",
    )
    parser.add_argument("--table", default="", help="which marked table of --output to replace")
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the stock Flower app's round trips after each release",
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    overrides = parse_run_config(args.run_config)
    rows: list[Measured] = []
    for item in args.compare:
        label, _, rest = item.partition("=")
        path, sites, seconds = [*rest.split(":"), "3", "nan"][:3]
        run_log = (Path(path) / "logs" / "flwr-run.log").read_text(encoding="utf-8")
        status = "finished:completed" if "stage seconds:" in run_log else "unknown"
        rows.append(analyse(label, Path(path), int(sites), status, float(seconds)))
    for sites in args.sites or [3]:
        with tempfile.TemporaryDirectory(prefix=f"dpmtv-deploy-{sites}-") as tmp:
            rows += run_once(Path(tmp), sites, args.label, overrides, with_floor=not args.no_floor)
            print(table(rows), flush=True)
    report = f"{table(rows)}\n\n{_environment()}\n"
    print(report)
    if args.output is not None:
        write_report(args.output, report, args.table)
    return 0 if all(r.status == "finished:completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

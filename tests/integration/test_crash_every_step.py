"""Kill -9 at every step of a 10-site release: every ledger resolves as the threat model says.

Ten real ``dpmtv-site serve`` processes (each its own ledger, release records, roster key,
Unix socket; ``scripts/local_consortium.prepare_consortium``) serve releases run by the
coordinator's own code (``run_coordinated_release``) over an ``InProcessGrid`` whose relays
reach the services through their sockets, exactly as a SuperNode's relay does. At one step a
process is killed with SIGKILL:

* **a site's service**, before a message reaches it or right after it answered one; the
  release goes on without it or aborts, and the service is started again on the same state
  (it resolves what it left open at start);
* **the coordinator** (its own process, killed as it is about to send a message): no abort
  notice ever comes, and every site resolves the release by its idle sweep.

Then every site's ledger holds the release as its own record says (``client.release.states``):
counted (committed) when its masked input may have left — always when the coordinator got
it — and refunded (aborted) only when nothing of its data left; no record is left open; the
consortium ledger is counted exactly when noise was drawn; nothing else is lost (every
earlier release stays as it was).

The default run kills one site after two steps of a central release of one sum (the plan:
nothing of its data left; its masked input: it left); ``-m reproduction``
(``scripts/check-reproductions``) runs every step of a private release (two secure sums), site
and coordinator, in both noise modes. The same with a real SuperLink and SuperNodes:
``scripts/local_consortium.py run --sites 10`` and ``kill -9`` of the ``flower-superlink``
process group (docs/deployment.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import contextlib
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message

from client.release.record import ReleaseRecordStore
from client.service.relay import SOCKET_KEY, RelayApp
from dpmtv_common.errors import DpmtvError
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.privacy.noise import secure_noise
from protocol import MaskedInput, message_from_record
from server.coordinator import run_coordinated_release
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import InProcessGrid, make_server_context
from tests.flower_harness import flower_process_state

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
SITES, PER_SITE = 10, 15
IDLE_S = 20.0  # a site's idle limit: long enough for a 10-site stage on shared cores

_spec = importlib.util.spec_from_file_location(
    "local_consortium", REPO / "scripts" / "local_consortium.py"
)
assert _spec is not None
assert _spec.loader is not None
consortium_script = importlib.util.module_from_spec(_spec)
sys.modules["local_consortium"] = consortium_script
_spec.loader.exec_module(consortium_script)

PRIVATE_STEPS = [  # (message type, its occurrence) in a private select-first release
    ("query.plan", 1),
    ("query.sum_shares", 1),
    ("query.sum_survivors", 1),
    ("query.sum_unmask", 1),
    ("query.sum_collect", 1),
    ("query.sum_survivors", 2),
    ("query.sum_unmask", 2),
    ("query.release", 1),
]
DEFAULT_STEPS = [("query.plan", 1), ("query.sum_shares", 1)]  # nothing left; its input left


@dataclass
class Services:
    """The ten site services (real processes) and their files."""

    files: Any
    mode: str
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)

    def start(self, site: Any) -> None:
        command = [*site.service_command(), "--idle-release-seconds", str(IDLE_S)]
        with (site.ledger_path.parent / "service.log").open("ab") as log:  # the child keeps it
            self.processes[site.name] = subprocess.Popen(
                command, stdout=log, stderr=log, cwd=REPO, start_new_session=True
            )

    def wait_ready(self, site: Any, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.processes[site.name].poll() is not None:
                raise AssertionError(f"{site.name} exited: {service_log(site)[-2000:]}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(str(site.socket_path))
                    return
                except OSError:
                    time.sleep(0.2)
        raise AssertionError(f"{site.name} never listened: {service_log(site)[-2000:]}")

    def kill(self, name: str) -> None:
        process = self.processes[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def site(self, name: str) -> Any:
        return next(site for site in self.files.sites if site.name == name)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def service_log(site: Any) -> str:
    path = site.ledger_path.parent / "service.log"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def services(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Services]:
    """Ten running site services of the noise mode the test names (indirect parameter)."""
    mode = request.param
    root = tmp_path_factory.mktemp(f"crash-{mode}")
    files = consortium_script.prepare_consortium(
        root, sites=SITES, per_site=PER_SITE, noise_mode=mode
    )
    started = Services(files, mode)
    for site in files.sites:
        started.start(site)
    try:
        for site in files.sites:
            started.wait_ready(site)
        yield started
    finally:
        started.stop()


class KillingGrid(InProcessGrid):
    """The in-process grid, which kills one site's service at one step of the release."""

    def __init__(
        self,
        *args: Any,
        kill: tuple[str, int],
        victim: int,
        when: str,
        killer: Services,
        names: dict[int, str],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.kill_at, self.victim, self.when = kill, victim, when
        self.services, self.names = killer, names
        self.seen = 0
        self.killed = False

    def _deliver(self, message: Message) -> Message | None:
        due = (
            not self.killed
            and message.metadata.dst_node_id == self.victim
            and message.metadata.message_type == self.kill_at[0]
        )
        if due:
            self.seen += 1
            due = self.seen == self.kill_at[1]
        if due and self.when == "before":
            self.services.kill(self.names[self.victim])
            self.killed = True
        reply = super()._deliver(message)
        if due and self.when == "after":
            self.services.kill(self.names[self.victim])
            self.killed = True
        return reply


def run_config(services: Services, release_id: str, selection: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model-fingerprint": services.files.fingerprint,
        "release-id": release_id,
        "selection": selection,
        "order": "select-first",
        "shots": 2,
        "clip-norm": 1.0,
        "num-selected-heads": 2,
        "expected-sites": SITES,
        "min-sites": 3,
        "stage-timeout": 120.0,
        "node-wait-timeout": 5.0,
    }
    if services.mode == "distributed":
        config |= {
            "noise-mode": "distributed",
            "max-chunks-per-site": 5,
            "min-honest": 2,
            "max-sites": SITES,
        }
    return config


def coordinator_settings(services: Services) -> CoordinatorSettings:
    files = services.files
    return CoordinatorSettings(
        signing_key=files.signing_key,
        ledger_path=files.consortium_ledger,
        budget_epsilon=1000.0,
        artifacts_dir=files.coordinator_artifacts,
    )


def site_grid(
    services: Services, grid_type: type[InProcessGrid] = InProcessGrid, **kwargs: Any
) -> InProcessGrid:
    sites = services.files.sites
    return grid_type(
        [RelayApp() for _ in sites],
        num_nodes=len(sites),
        node_configs=[{SOCKET_KEY: str(site.socket_path)} for site in sites],
        **kwargs,
    )


def ledger_states(ledger: Path, budget_epsilon: float = 10.0) -> dict[str, ReleaseState]:
    """Every release in a ledger (opening skips the entries of a live service)."""
    from dpmtv_common.privacy.budget import PrivacyBudget

    with PrivacyLedger.open(ledger, PrivacyBudget(budget_epsilon, 1e-5)) as opened:
        return {entry.release_id: entry.state for entry in opened.releases()}


def wait_closed(services: Services, release_id: str, timeout: float) -> None:
    """Until no site holds the release open (each resolved it by its own record)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        open_sites = [
            site.name
            for site in services.files.sites
            if (record := records_of(site).get(release_id)) is not None and not record.finished
        ]
        if not open_sites:
            return
        time.sleep(0.5)
    raise AssertionError(f"sites left {release_id} open: {open_sites}")


def records_of(site: Any) -> ReleaseRecordStore:
    return ReleaseRecordStore(site.ledger_path.with_name(site.ledger_path.name + ".releases"))


def check_resolved(services: Services, release_id: str, got_input: set[str]) -> None:
    """Every site's ledger holds the release as its own record says; nothing earlier moved."""
    for site in services.files.sites:
        record = records_of(site).get(release_id)
        states = ledger_states(site.ledger_path)
        state = states.get(release_id)
        if record is None:  # never accepted (dead at the plan): nothing reserved
            assert state is None, (site.name, state)
            continue
        assert record.finished, (site.name, record.state)
        sent = bool(record.sent) or record.state.value == "contributed"
        if site.name in got_input:
            assert sent, f"{site.name}: the coordinator got its input, its record says none left"
        expected = ReleaseState.COMMITTED if sent else ReleaseState.ABORTED
        assert state is expected, (site.name, record.state, record.sent, state)
        for earlier in services.released:  # nothing earlier is lost or changed
            if records_of(site).get(earlier) is not None:
                assert states.get(earlier) in (ReleaseState.COMMITTED, ReleaseState.ABORTED)


def inputs_received(grid: InProcessGrid, names: dict[int, str]) -> set[str]:
    """The sites whose masked input reached the coordinator."""
    got = set()
    for node, stage, reply in grid.replies:
        if stage in ("query.sum_shares", "query.sum_collect") and not reply.has_error():
            try:
                if isinstance(message_from_record(reply.content), MaskedInput):
                    got.add(names[node])
            except DpmtvError:
                continue
    return got


def kill_a_site(
    services: Services, step: tuple[str, int], when: str, selection: str = "private"
) -> None:
    """One release in which site 9's service dies at ``step``; then it restarts."""
    release_id = f"site-{when}-{step[0].split('.')[1]}-{step[1]}"
    names = {1000 + index: site.name for index, site in enumerate(services.files.sites)}
    victim = 1000 + SITES - 1
    config = run_config(services, release_id, selection)
    with flower_process_state():
        grid = site_grid(
            services,
            KillingGrid,
            kill=step,
            victim=victim,
            when=when,
            killer=services,
            names=names,
            run_config=config,
        )
        # The release may abort: what matters is how every site resolves it.
        with contextlib.suppress(DpmtvError):
            run_coordinated_release(
                grid,
                make_server_context(config),
                RunConfig.from_context(config),
                coordinator_settings(services),
                secure_noise(),
            )
    assert isinstance(grid, KillingGrid)
    assert grid.killed, f"{step} {when}: never reached"
    site = services.site(names[victim])
    services.start(site)  # the same state: it resolves what it left open at start
    services.wait_ready(site)
    wait_closed(services, release_id, timeout=3 * IDLE_S)
    check_resolved(services, release_id, inputs_received(grid, names))
    consortium = ledger_states(services.files.consortium_ledger, 1000.0)[release_id]
    assert consortium in (ReleaseState.COMMITTED, ReleaseState.ABORTED)
    services.released.append(release_id)


COORDINATOR = """
import os, signal, sys
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
from client.service.relay import RelayApp, SOCKET_KEY
from dpmtv_common.privacy.noise import secure_noise
from server.coordinator import run_coordinated_release
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import InProcessGrid, make_server_context
import json
args = json.loads(sys.argv[1])
kill_type, kill_count = args["kill"]

class Grid(InProcessGrid):
    seen = 0
    def _deliver(self, message):
        if message.metadata.message_type == kill_type:
            Grid.seen += 1
            if Grid.seen == kill_count:
                print("killed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return super()._deliver(message)

sockets, config = args["sockets"], args["config"]
grid = Grid([RelayApp() for _ in sockets], num_nodes=len(sockets),
            node_configs=[{SOCKET_KEY: path} for path in sockets], run_config=config)
settings = CoordinatorSettings(**args["settings"])
run_coordinated_release(grid, make_server_context(config), RunConfig.from_context(config),
                        settings, secure_noise())
print("finished", flush=True)
"""


def kill_the_coordinator(services: Services, step: tuple[str, int]) -> None:
    """One release whose coordinator dies at ``step``: every site resolves it by itself."""
    release_id = f"coordinator-{step[0].split('.')[1]}-{step[1]}"
    files = services.files
    settings = coordinator_settings(services)
    arguments = {
        "kill": list(step),
        "sockets": [str(site.socket_path) for site in files.sites],
        "config": run_config(services, release_id, "private"),
        "settings": {
            "signing_key": str(settings.signing_key),
            "ledger_path": str(settings.ledger_path),
            "budget_epsilon": settings.budget_epsilon,
            "artifacts_dir": str(settings.artifacts_dir),
        },
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COORDINATOR), json.dumps(arguments)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr[-3000:]
    wait_closed(services, release_id, timeout=4 * IDLE_S + 30)
    check_resolved(services, release_id, set())
    services.released.append(release_id)


@pytest.mark.parametrize("services", ["central"], indirect=True)
@pytest.mark.parametrize("step", DEFAULT_STEPS, ids=lambda s: f"{s[0]}-{s[1]}")
def test_a_site_killed_after_a_step_resolves_as_its_record_says(
    services: Services, step: tuple[str, int]
) -> None:
    kill_a_site(services, step, "after", selection="all")


@pytest.mark.reproduction
@pytest.mark.parametrize("services", ["central", "distributed"], indirect=True)
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", PRIVATE_STEPS, ids=lambda s: f"{s[0]}-{s[1]}")
def test_a_site_killed_at_every_step_resolves_as_its_record_says(
    services: Services, step: tuple[str, int], when: str
) -> None:
    kill_a_site(services, step, when)


@pytest.mark.reproduction
@pytest.mark.parametrize("services", ["central", "distributed"], indirect=True)
@pytest.mark.parametrize("step", PRIVATE_STEPS, ids=lambda s: f"{s[0]}-{s[1]}")
def test_the_coordinator_killed_at_every_step_leaves_every_site_to_resolve_by_itself(
    services: Services, step: tuple[str, int]
) -> None:
    kill_the_coordinator(services, step)

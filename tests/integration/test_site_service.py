"""The site service as a site admin runs it: a real ``dpmtv-site serve`` process and its socket.

A subprocess serves a tiny random LLaVA site; the test talks to it the way Flower's per-message
relay does (``client.service.relay.RelayApp`` over the Unix socket) and the way an admin does
(``service-status``, ``ask``), starts a second service on the same ledger, and stops it with
SIGTERM.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from client.cli.main import main
from client.data.synthetic import write_task_datasets
from client.models import save_tiny_model
from client.service.relay import SOCKET_KEY, RelayApp
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import ServiceError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.roster import Roster
from protocol import (
    PlanAccept,
    PlanRequest,
    ReleaseAck,
    WireMessage,
    message_from_record,
    message_to_record,
)
from server.simulation import set_task_identity
from tests.flower_harness import flower_process_state
from tests.integration.test_hostile_coordinator import (
    World,
    make_plan,
    signed_request,
)

pytestmark = pytest.mark.integration

ROSTER_FILE, IDENTITY_FILE = "roster.toml", "site-0.identity.key"


@dataclass
class Served:
    process: subprocess.Popen[str]
    socket: Path
    state: Path
    world: World
    data: Path

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "client.cli", "serve",
            "--model", str(self.world.model),
            "--data", str(self.data),
            "--state-dir", str(self.state),
            "--socket", str(self.socket),
            "--trusted-key", str(self.world.verify_key),
            "--device", "cpu",
            "--threads", "1",
            "--min-sites", "3",
            "--name", "site-0",
            "--roster", str(self.world.root / ROSTER_FILE),
            "--identity-key", str(self.world.root / IDENTITY_FILE),
            *extra,
        ]  # fmt: skip


def _pump(process: subprocess.Popen[str], lines: list[str]) -> None:
    assert process.stderr is not None
    for line in process.stderr:  # drained to the end, so the service never blocks on a pipe
        lines.append(line)


def _wait_for(lines: list[str], text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for line in list(lines)):
            return
        time.sleep(0.1)
    raise AssertionError(f"service never printed {text!r}; it printed:\n{''.join(lines)}")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("served")
    write_task_datasets(
        root / "data", task="colour", sites=1, per_site=15, public=0, test=2, seed=0
    )
    save_tiny_model("llava", root / "model", seed=0)
    key = SigningKey.generate()
    key.verify_key.save(root / "coordinator.pub")
    # The consortium's roster: this site and one other member (secure sums need a roster).
    identity = SigningKey.generate()
    identity.save(root / IDENTITY_FILE)
    members = {"site-0": identity.verify_key, "site-1": SigningKey.generate().verify_key}
    (root / ROSTER_FILE).write_text(Roster("served", members).to_toml())
    return World(root, root / "model", fingerprint_model_dir(root / "model"), key,
                 root / "coordinator.pub")  # fmt: skip


@pytest.fixture
def served(world: World, tmp_path: Path) -> Iterator[Served]:
    socket_path = tmp_path / "s.sock"  # AF_UNIX paths must stay under ~100 bytes
    data = world.root / "data" / "site-0"
    plan = Served(None, socket_path, tmp_path / "state", world, data)  # type: ignore[arg-type]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plan.process = subprocess.Popen(
        plan.command(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    lines: list[str] = []
    reader = threading.Thread(target=_pump, args=(plan.process, lines), daemon=True)
    reader.start()
    try:
        _wait_for(lines, "serving on", timeout=120)
        yield plan
    finally:
        if plan.process.poll() is None:
            plan.process.kill()
        plan.process.wait(timeout=30)
        reader.join(timeout=10)
        assert plan.process.stderr is not None
        plan.process.stderr.close()
        socket_path.unlink(missing_ok=True)


def relay_ask(served: Served, message_type: str, body: WireMessage) -> object:
    with flower_process_state():
        set_task_identity()
        from flwr.app import Message

        message = Message(
            message_to_record(body), dst_node_id=7, message_type=message_type, group_id="g"
        )
        message.metadata.__dict__["_message_id"] = "m1"
        context = Context(
            run_id=1,
            node_id=7,
            node_config={SOCKET_KEY: str(served.socket)},
            state=RecordDict(),
            run_config={},
        )
        reply = RelayApp()(message, context)
    return message_from_record(reply.content)


def ledger_state(served: Served, release_id: str) -> ReleaseState | None:
    ledger = served.state / "ledger.sqlite"
    with PrivacyLedger.open(ledger, PrivacyBudget(10.0, 1e-5)) as opened:
        return {e.release_id: e.state for e in opened.releases()}.get(release_id)


def test_the_service_answers_the_relay_the_admin_and_stops_cleanly(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    # Health, as an admin checks it (as the service's user: the status file's details too).
    assert main(["service-status", "--socket", str(served.socket)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "ok"
    assert status["pid"] == served.process.pid
    assert status["site"] == "site-0"
    assert status["ledger"] == str(served.state / "ledger.sqlite")
    # A plan through the real relay over the real socket: accepted and reserved.
    plan = make_plan(served.world)
    accept = relay_ask(served, "query.plan", PlanRequest(plan=plan))
    assert isinstance(accept, PlanAccept)
    assert ledger_state(served, "r1") is ReleaseState.RESERVED
    assert main(["service-status", "--socket", str(served.socket)]) == 0
    assert json.loads(capsys.readouterr().out)["open_releases"] == 1
    # The artifact of that plan (the site sent nothing: it refunds and stores it).
    request = signed_request(served.world, served.state.parent, plan)
    assert isinstance(relay_ask(served, "query.release", request), ReleaseAck)
    assert ledger_state(served, "r1") is ReleaseState.ABORTED
    # Local inference by the running service with that stored artifact.
    image = next((served.world.root / "data" / "test" / "images").glob("*.png"))
    code = main(
        ["ask", "--socket", str(served.socket), "--release-id", "r1",
         "--image", str(image), "--question", "What is the answer for this image?"]
    )  # fmt: skip
    assert code == 0
    assert capsys.readouterr().out.strip() != ""
    # A second plan left open, then SIGTERM: the service resolves it (nothing sent: refund).
    relay_ask(served, "query.plan", PlanRequest(plan=make_plan(served.world, "r2")))
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=60) == 0
    assert ledger_state(served, "r2") is ReleaseState.ABORTED
    assert not served.socket.exists()


def test_a_second_service_on_the_same_ledger_is_refused(served: Served) -> None:
    other = served.socket.with_name(served.socket.name + "-2")
    done = subprocess.run(
        served.command("--socket", str(other)), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "another dpmtv-site service already serves ledger" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_relay_without_a_socket_or_service_fails_with_a_clear_error(served: Served) -> None:
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ServiceError, match="node config must set site-socket"):
        RelayApp()._transport(context, b"")
    context.node_config[SOCKET_KEY] = str(served.socket) + ".missing"
    with pytest.raises(ServiceError, match="the site service must listen on"):
        RelayApp()._transport(context, b"")

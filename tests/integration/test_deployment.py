"""The real deployment: a TLS SuperLink, authenticated SuperNodes and site services.

Everything runs on 127.0.0.1 through ``scripts/local_consortium.py``: test-made certificates,
one registered EC key a site, a site service per site (``dpmtv-site serve``) and a SuperNode
given only its socket, ``flwr run`` of this very project (a FAB built from the checkout), 3
sites of 30 records of a tiny random LLaVA. One consortium serves the whole module, in file
order: a release (about a minute on two loaded cores: six Flower round trips, each bounded
below by the SuperNode's 3 s idle poll and a fresh ``flwr-clientapp`` process, see
docs/benchmarks/deployment.md), the SuperLink's refusals, a run stopped with ``flwr stop``
and a release that loses a site. The site services run with a short
``DPMTV_CLIENT_IDLE_RELEASE_SECONDS``, so a reservation no coordinator will finish is
resolved by the site itself within seconds.
"""

from __future__ import annotations

import ipaddress
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from cryptography.x509.verification import PolicyBuilder, Store

from dpmtv_common.artifact import MANIFEST_FILE, TENSORS_FILE, load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from scripts.local_consortium import (
    PROCESS_ENV,
    Consortium,
    ConsortiumFiles,
    Credentials,
    RunResult,
    keep_logs,
    make_credentials,
    prepare_consortium,
    stage_timings,
)

pytestmark = pytest.mark.integration

SITES = 3
PER_SITE = 30  # shots 2: floor(30 / (2 + 1)) = 10 chunks a site
CHUNKS_PER_SITE = 10
BUDGET = PrivacyBudget(10.0, 1e-5)  # the ledgers' default budget
INTRUDER = "intruder"


def _slowdown() -> float:
    """How much slower than an idle 2-core machine this one runs now: the run queue per core.

    Measured when the module starts, it scales what must hold a live release: a loaded host
    (load 11-13 on 2 cores is 5-6x) stretches every Flower round trip alike.
    """
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


SLOWDOWN = _slowdown()
# A site resolves a release idle for this long (its sweep runs every IDLE / 4 s). A live
# release stays silent towards the surviving sites while the coordinator waits for a lost
# one (up to 2x the time the others took), so this must exceed about three stage times:
# 45 s on an idle machine, scaled by the measured load. Production defaults exceed the
# coordinator's stage timeout.
IDLE_RELEASE_SECONDS = round(45.0 * SLOWDOWN)
SITE_ENV = {"DPMTV_CLIENT_IDLE_RELEASE_SECONDS": str(IDLE_RELEASE_SECONDS)}
# Silence (no process of the consortium printing) that means a release is stuck: long next
# to any one Flower round trip, even on a loaded machine; a release that keeps printing is
# waited for (scripts.local_consortium.ProgressDeadline).
QUIET_S = 240.0


def run_config(
    files: ConsortiumFiles, release_id: str, *, stage_timeout: float
) -> dict[str, object]:
    return {
        "task": "colour",
        "model-fingerprint": files.fingerprint,
        "selection": "all",
        "shots": 2,
        "epsilon": 1.0,
        "expected-sites": SITES,
        "min-sites": 2,
        "node-wait-timeout": 60.0,
        "stage-timeout": stage_timeout,
        "release-id": release_id,
    }


def start_sites(consortium: Consortium, files: ConsortiumFiles) -> None:
    consortium.start_superlink()
    for site in files.sites:
        consortium.register(site.name)
        consortium.start_site_service(site)
        consortium.start_supernode(site)


def states(ledger: Path) -> dict[str, ReleaseState]:
    # Opening does not touch a live service's entries (crash recovery skips live owners).
    with PrivacyLedger.open(ledger, BUDGET) as opened:
        return {entry.release_id: entry.state for entry in opened.releases()}


def wait_resolved(ledgers: list[Path], release_id: str, timeout: float) -> dict[Path, float]:
    """Seconds until each ledger holds ``release_id`` as committed or aborted."""
    started = time.monotonic()
    resolved: dict[Path, float] = {}
    while time.monotonic() - started < timeout and len(resolved) < len(ledgers):
        for ledger in ledgers:
            final = (ReleaseState.COMMITTED, ReleaseState.ABORTED)
            if ledger not in resolved and states(ledger).get(release_id) in final:
                resolved[ledger] = time.monotonic() - started
        time.sleep(0.5)
    return resolved


def journal(files: ConsortiumFiles) -> list[str]:
    """The coordinator's release journal (server.app): one line per release."""
    ledger = files.consortium_ledger
    return ledger.with_name(ledger.name + ".releases.log").read_text().splitlines()


def artifact_bytes(directory: Path) -> tuple[bytes, bytes]:
    return (directory / MANIFEST_FILE).read_bytes(), (directory / TENSORS_FILE).read_bytes()


def explain(result: RunResult, consortium: Consortium) -> str:
    return f"run {result.run_id} ended {result.status!r}; logs in {consortium.workdir / 'logs'}"


@pytest.fixture(autouse=True)
def _failure_logs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """On failure, every process's log is copied out of pytest's rotating temporary folders
    (to a kept folder beside them) and its tail shown in the report (tests/conftest.py)."""
    if "deployment" not in request.fixturenames:
        return
    kept = tmp_path_factory.getbasetemp().parent / "dpmtv-kept-logs" / request.node.name

    def keep() -> str:
        consortium: Consortium = request.getfixturevalue("deployment")
        return keep_logs(consortium.workdir / "logs", kept)

    request.node.dpmtv_failure_logs = keep


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> ConsortiumFiles:
    return prepare_consortium(tmp_path_factory.mktemp("deployed"), sites=SITES, per_site=PER_SITE)


@pytest.fixture(scope="module")
def credentials(files: ConsortiumFiles) -> Credentials:
    names = [site.name for site in files.sites]
    return make_credentials(files.root / "credentials", [*names, INTRUDER])


@pytest.fixture(scope="module")
def deployment(files: ConsortiumFiles, credentials: Credentials) -> Iterator[Consortium]:
    env = files.coordinator_env()
    with Consortium(files.root, credentials, coordinator_env=env, site_env=SITE_ENV) as running:
        start_sites(running, files)
        yield running
    assert running.leftover_pids() == [], "a process outlived the consortium's teardown"


def test_the_credentials_are_a_server_chain_for_loopback_and_ssh_keys_per_site(
    tmp_path: Path,
) -> None:
    # Act
    creds = make_credentials(tmp_path, ["site-0"], hosts=["127.0.0.1", "localhost", "superlink"])
    # Assert: the server certificate verifies under the CA for every name a client may dial.
    ca = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(creds.server_cert.read_bytes())
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier
    for name in (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("superlink")):
        verifier(name).verify(server, [])
    # Assert: the site key is EC P-384 in OpenSSH format, private files are owner-only.
    key = load_ssh_private_key(creds.private_key("site-0").read_bytes(), password=None)
    assert key.curve.name == "secp384r1"  # type: ignore[union-attr]
    assert creds.public_key("site-0").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert creds.private_key("site-0").stat().st_mode & 0o077 == 0
    assert creds.server_key.stat().st_mode & 0o077 == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a safety net only: the waits below end on silence, not a total
def test_a_tls_deployment_with_authenticated_sites_makes_one_signed_release(
    deployment: Consortium, files: ConsortiumFiles
) -> None:
    # Arrange
    release_id = "deployed-release"
    keys = TrustedKeys.from_files([files.verify_key])
    # Act
    result = deployment.wait_run(
        deployment.submit(run_config(files, release_id, stage_timeout=180.0)), timeout=QUIET_S
    )
    # Assert: Flower reports success, and the coordinator's one summary line reached the
    # stream (so the ServerApp saw the DPMTV_SERVER_* variables given to the SuperLink).
    assert result.completed, explain(result, deployment)
    summary = rf"release {release_id} COMMITTED: \d+ heads \(m={SITES * CHUNKS_PER_SITE} chunks"
    assert len(re.findall(summary, result.log)) == 1, result.log
    assert "released to site-0, site-1, site-2" in result.log
    assert [line for line in journal(files) if f"release {release_id} COMMITTED" in line]
    assert set(stage_timings(result.log)) == {"wait", "plan", "sums+noise", "broadcast"}
    assert [node["status"] for node in deployment.supernodes()] == ["online"] * SITES
    # Assert: every site holds the same signed artifact, which verifies against the key and
    # the model, and is the coordinator's own copy.
    coordinator_copy = artifact_bytes(files.coordinator_artifacts / release_id)
    for site in files.sites:
        directory = site.artifacts_dir / release_id
        artifact = load_artifact(
            directory, trusted_keys=keys, expected_model_fingerprint=files.fingerprint
        )
        assert artifact.manifest.num_chunks == SITES * CHUNKS_PER_SITE
        assert artifact_bytes(directory) == coordinator_copy
        assert states(site.ledger_path)[release_id] is ReleaseState.COMMITTED
    assert states(files.consortium_ledger)[release_id] is ReleaseState.COMMITTED
    # Assert: every process we started was told not to spin and to poll every 0.1 s.
    for name in ("superlink", "site-0", "site-0-service"):
        environ = Path(f"/proc/{deployment.processes[name].process.pid}/environ").read_bytes()
        for key, value in PROCESS_ENV.items():
            assert f"{key}={value}".encode() in environ.split(b"\0"), (name, key)


# A plaintext request on the TLS port ends in whichever of these the race between the
# server's close and the client's read produces; both mean the TLS port refused plaintext.
PLAINTEXT_AGAINST_TLS = (
    "Server disconnected without sending a response",
    "Connection reset by peer",
)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a safety net: the waits scale with the measured load
def test_the_superlink_refuses_unregistered_insecure_and_keyless_supernodes(
    deployment: Consortium, files: ConsortiumFiles, credentials: Credentials
) -> None:
    # Arrange: a well-formed key nobody registered; plain HTTP against the TLS port; TLS
    # without any key while SuperNode authentication is on.
    site = files.sites[0]
    retries = ["--max-retries", "2"]  # a lost connection must end, not retry forever
    attempts = {
        "intruder": deployment.start_supernode(
            site, key=credentials.private_key(INTRUDER), name="intruder", extra_args=retries
        ),
        "insecure": deployment.start_supernode(
            site, insecure=True, authenticate=False, name="insecure", extra_args=retries
        ),
        "keyless": deployment.start_supernode(
            site, authenticate=False, name="keyless", extra_args=retries
        ),
    }
    # Act
    codes = {name: managed.wait(timeout=120 * SLOWDOWN) for name, managed in attempts.items()}
    # Assert: each SuperNode gave up with Flower's exit code 305 for the reason expected,
    # and the SuperLink still knows only the three registered sites.
    logs = {name: managed.text() for name, managed in attempts.items()}
    assert all(code != 0 for code in codes.values()), codes
    assert all("Exit Code: 305" in log for log in logs.values()), logs
    assert "[code: 2004] Failed to activate SuperNode" in logs["intruder"]
    assert any(reason in logs["insecure"] for reason in PLAINTEXT_AGAINST_TLS), logs["insecure"]
    assert "[code: 2001] SuperNode authentication is enabled" in logs["keyless"]
    assert len(deployment.supernodes()) == SITES


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a safety net: the waits scale with the measured load
def test_an_insecure_supernode_with_an_auth_key_refuses_to_start(
    deployment: Consortium, files: ConsortiumFiles
) -> None:
    # Act: Flower refuses this combination locally, before any connection (exit code 303).
    managed = deployment.start_supernode(files.sites[0], insecure=True, name="insecure-with-key")
    code = managed.wait(timeout=120 * SLOWDOWN)
    # Assert
    assert code != 0
    assert "Exit Code: 303" in managed.text()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a safety net: the idle limit itself scales with the load
def test_after_flwr_stop_every_site_resolves_its_reservation_by_itself(
    deployment: Consortium, files: ConsortiumFiles
) -> None:
    # Arrange: a release whose plan every site accepted (each reserved its budget).
    release_id = "stopped-release"
    run = deployment.submit(run_config(files, release_id, stage_timeout=180.0))
    run_id = deployment.run_id(run)
    for site in files.sites:
        accepted = rf"release {release_id}: plan accepted"
        deployment.wait_for_line(f"{site.name}-service", accepted, timeout=QUIET_S)
    # Act: the operator stops the run; no coordinator will ever finish or abort it.
    stopped = deployment.stop_run(run_id)
    run.wait(timeout=60)  # the stream ends with the run
    resolved = wait_resolved(
        [site.ledger_path for site in files.sites], release_id, timeout=3 * IDLE_RELEASE_SECONDS
    )
    # Assert: Flower stopped the run, and every site resolved its own reservation within
    # its idle limit plus one sweep, by its own record: refund unless its data had left.
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert len(resolved) == SITES, f"resolved after {resolved}; sites {files.sites}"
    assert max(resolved.values()) < IDLE_RELEASE_SECONDS * 1.25 + 10
    for site in files.sites:
        service_log = deployment.processes[f"{site.name}-service"].text()
        sent = f"release {release_id}: contributed" in service_log
        expected = ReleaseState.COMMITTED if sent else ReleaseState.ABORTED
        assert states(site.ledger_path)[release_id] is expected
    # Assert: the coordinator's journal says what happened to this release, in one line
    # (flwr log cannot: the SuperLink revokes the run's token at the stop).
    (line,) = [line for line in journal(files) if f"release {release_id} " in line]
    assert f"release {release_id} STOPPED (the SuperLink ended the run" in line
    assert "consortium ledger: aborted" in line  # no noise drawn before the stop: refunded
    assert states(files.consortium_ledger)[release_id] is ReleaseState.ABORTED


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a safety net only: the waits below end on silence, not a total
def test_a_site_killed_during_the_activation_secure_sum_costs_seconds_not_the_timeout(
    deployment: Consortium, files: ConsortiumFiles
) -> None:
    # Arrange: the last test of the module (it kills a SuperNode); a 600 s stage timeout, so
    # without the coordinator's straggler rule the loss would cost Flower's heartbeat expiry
    # (38-60 s) or the timeout.
    release_id = "survivors-release"
    victim, survivors = files.sites[-1], files.sites[:-1]
    skip = deployment.line_count(victim.name)
    run = deployment.submit(run_config(files, release_id, stage_timeout=600.0))
    # Act: the first message is the plan (the site's signed key rides on its acceptance;
    # selection "all" has one sum); the victim accepts it and dies as it receives the second
    # (the first sum's shares request), before any of its data left.
    deployment.wait_for_line(
        victim.name, r"Receiving: query\.plan message", timeout=QUIET_S, skip=skip
    )
    deployment.wait_for_line(
        f"{victim.name}-service", rf"release {release_id}: plan accepted", timeout=QUIET_S
    )
    deployment.wait_for_line(
        victim.name, r"Receiving: query\.sum_shares message", timeout=QUIET_S, skip=skip
    )
    deployment.kill(victim.name)
    result = deployment.wait_run(run, timeout=QUIET_S)
    # Assert: the release went on with the two survivors; m counts their chunks only; the
    # coordinator gave the victim up by its registered name a few seconds after the others.
    assert result.completed, explain(result, deployment)
    gave_up = re.search(
        rf"gave up on {victim.name} \(\d+\): silent ([0-9.]+) s after the other sites "
        r"answered \(in ([0-9.]+) s\)",
        result.log,
    )
    assert gave_up, result.log
    # By the coordinator's own rule, scaled by how long the others took on this machine now
    # (max(5 s, 2x), plus a pull or two), never the 600 s stage timeout.
    silent, others = float(gave_up.group(1)), float(gave_up.group(2))
    assert silent <= max(5.0, 2.0 * others) + 5.0, gave_up.group(0)
    stages = stage_timings(result.log)
    assert stages["sums+noise"] < 600, stages
    keys = TrustedKeys.from_files([files.verify_key])
    for site in survivors:
        artifact = load_artifact(
            site.artifacts_dir / release_id,
            trusted_keys=keys,
            expected_model_fingerprint=files.fingerprint,
        )
        assert artifact.manifest.num_chunks == len(survivors) * CHUNKS_PER_SITE
        assert states(site.ledger_path)[release_id] is ReleaseState.COMMITTED
    assert not (victim.artifacts_dir / release_id).exists()
    # The victim's SuperNode died before its data left: its service, still running, resolves
    # the release from its own record (nothing sent: refund) once idle.
    resolved = wait_resolved([victim.ledger_path], release_id, timeout=3 * IDLE_RELEASE_SECONDS)
    assert resolved, "the victim's service left its reservation open"
    assert states(victim.ledger_path)[release_id] is ReleaseState.ABORTED
    assert states(files.consortium_ledger)[release_id] is ReleaseState.COMMITTED

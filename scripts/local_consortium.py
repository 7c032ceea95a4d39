"""A whole consortium on one machine: TLS SuperLink, authenticated SuperNodes, one ``flwr run``.

Every component is its own process (group), as in a real deployment, on 127.0.0.1:

1. ``make_credentials``: a CA, a server certificate (SAN IP:127.0.0.1, DNS:localhost and any
   extra names) and one EC P-384 OpenSSH key pair a site, written with ``cryptography``.
2. ``prepare_consortium``: synthetic site data, a tiny random model, the coordinator's Ed25519
   signing key and each site's folders (``client.data.synthetic``, ``client.models``).
3. ``Consortium``: starts ``flower-superlink`` with TLS and SuperNode authentication (the
   coordinator's ``DPMTV_SERVER_*`` variables set in *its* environment, which its superexec
   and ``flwr-serverapp`` inherit), registers each site's public key with
   ``flwr supernode register``, starts each site's service (``dpmtv-site serve``: the only
   process given the site's model, data, ledger and keys) and one ``flower-supernode`` a site
   (own ``--port``, ``--node-config "site-socket=..."``: the socket and nothing else),
   submits ``flwr run . <federation> --stream``, waits for the run's end,
   and always tears every process group down (bounded waits, then SIGKILL, then a sweep of
   anything that still carries this consortium's marker variable).

Every line a process prints is kept in ``<workdir>/logs/<name>.log`` prefixed with the seconds
since the consortium started, so stage timings can be read off the logs.

Usage:
    python scripts/local_consortium.py make-credentials docker/ [--sites 3] [--host superlink]
    python scripts/local_consortium.py prepare /srv/dpmtv-demo [--sites 3] [--per-site 30]
    python scripts/local_consortium.py run --workdir /tmp/consortium [--sites 3] [--per-site 30]
        [--run-config "selection='all' shots=2 stage-timeout=120.0"]

One file on purpose (over the usual 400 lines): the tests import it and operators run it, and
it must not become product code (it starts processes and writes keys for a demo).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "OFFLINE_ENV",
    "PROCESS_ENV",
    "Consortium",
    "ConsortiumFiles",
    "Credentials",
    "Managed",
    "ProgressDeadline",
    "RunResult",
    "SiteFiles",
    "free_port",
    "keep_logs",
    "main",
    "make_credentials",
    "prepare_consortium",
    "stage_timings",
]

OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "HF_HUB_OFFLINE": "1",
}
# Every process we start: Flower's executors poll for tasks every 0.1 s instead of 1 s (read
# by the superexec that flower-superlink and flower-supernode start), and no thread pool
# busy-waits on shared cores (torch's OpenMP pool spins by default: 1.9-4.2x slower demo).
PROCESS_ENV = {
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
FEDERATION = "consortium"
MARKER = "DPMTV_LOCAL_CONSORTIUM"  # set in every process we start; the teardown sweep reads it
BIN = Path(sys.executable).parent  # the venv's bin: flower-superlink, flower-supernode, flwr
_RUN_ID = re.compile(r"Successfully started run (\d+)")


# ---------------------------------------------------------------- credentials


@dataclass(frozen=True)
class Credentials:
    """Where ``make_credentials`` wrote the TLS files and the sites' SSH key pairs."""

    certs: Path
    keys: Path

    @property
    def ca_cert(self) -> Path:
        """The CA certificate every SuperNode and the CLI trust (``--root-certificates``)."""
        return self.certs / "ca.crt"

    @property
    def server_cert(self) -> Path:
        """The SuperLink's certificate (``--ssl-certfile``)."""
        return self.certs / "server.pem"

    @property
    def server_key(self) -> Path:
        """The SuperLink's TLS private key (``--ssl-keyfile``)."""
        return self.certs / "server.key"

    def private_key(self, site: str) -> Path:
        """The site's OpenSSH private key (``--auth-supernode-private-key``)."""
        return self.keys / site

    def public_key(self, site: str) -> Path:
        """The site's OpenSSH public key (``flwr supernode register``)."""
        return self.keys / f"{site}.pub"


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only (created 0600: never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as sink:
        sink.write(data)
    path.chmod(0o600)  # an existing file keeps its old mode through O_CREAT


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    subject: str,
    public_key: ec.EllipticCurvePublicKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey],
    *,
    ca: bool,
    hosts: Iterable[str] = (),
    days: int = 30,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer[0])]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key()),
            critical=False,
        )
    )
    if ca:
        usage = {"key_cert_sign": True, "crl_sign": True, "digital_signature": False}
    else:
        usage = {"key_cert_sign": False, "crl_sign": False, "digital_signature": True}
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    builder = builder.add_extension(
        x509.KeyUsage(
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
            **usage,
        ),
        critical=True,
    )
    return builder.sign(issuer[1], hashes.SHA384())


def make_credentials(
    root: Path,
    sites: Iterable[str],
    *,
    hosts: Iterable[str] = ("127.0.0.1", "localhost"),
    days: int = 30,
) -> Credentials:
    """Write a CA, a SuperLink certificate for ``hosts`` and one SSH key pair per site.

    Layout: ``root/certs/{ca.crt,ca.key,server.pem,server.key}`` and
    ``root/keys/{site,site.pub}``. Site keys are EC P-384 in OpenSSH format, the kind
    ``flwr supernode register`` accepts (EC on a NIST curve; notes/flower.md §3.3).
    """
    creds = Credentials(root / "certs", root / "keys")
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = _certificate("dpmtv consortium CA", ca_key.public_key(), ("dpmtv consortium CA", ca_key),
                      ca=True, days=days)  # fmt: skip
    server_key = ec.generate_private_key(ec.SECP384R1())
    hosts = list(hosts)
    server = _certificate(hosts[0], server_key.public_key(), ("dpmtv consortium CA", ca_key),
                          ca=False, hosts=hosts, days=days)  # fmt: skip
    _write_private(creds.certs / "ca.key", _pem_key(ca_key))
    _write_private(creds.server_key, _pem_key(server_key))
    creds.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    creds.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    for site in sites:
        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        _write_private(creds.private_key(site), private)
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        creds.public_key(site).write_bytes(public + f" {site}\n".encode())
    return creds


# ---------------------------------------------------------------- site and coordinator files


@dataclass(frozen=True)
class SiteFiles:
    """One site's private files: given to its site service, never to its SuperNode."""

    name: str
    model_path: Path
    data_path: Path
    ledger_path: Path
    artifacts_dir: Path
    trusted_keys: Path
    roster: Path
    identity_key: Path
    min_sites: int = 2
    noise_mode: str = "central"

    @property
    def socket_path(self) -> Path:
        """The site service's socket (the SuperNode's only site setting)."""
        return self.ledger_path.parent / "site.sock"

    def node_config(self) -> str:
        """The SuperNode's ``--node-config``: where the site service listens, nothing more."""
        return f"site-socket={json.dumps(str(self.socket_path))}"

    def service_command(self) -> list[str]:
        """``dpmtv-site serve`` with every private file of the site."""
        return [
            sys.executable, "-m", "client.cli", "serve",
            "--name", self.name,
            "--model", str(self.model_path),
            "--data", str(self.data_path),
            "--state-dir", str(self.ledger_path.parent),  # the site's own state folder
            "--ledger", str(self.ledger_path),
            "--artifacts-dir", str(self.artifacts_dir),
            "--trusted-key", str(self.trusted_keys),
            "--roster", str(self.roster),
            "--identity-key", str(self.identity_key),
            "--socket", str(self.socket_path),
            "--socket-mode", "600",
            "--min-sites", str(self.min_sites),
            "--noise-mode", self.noise_mode,
            "--device", "cpu",
            "--threads", "1",
        ]  # fmt: skip


@dataclass(frozen=True)
class ConsortiumFiles:
    """Everything ``prepare_consortium`` wrote: the shared model, the sites, the coordinator."""

    root: Path
    model_path: Path
    fingerprint: str
    signing_key: Path
    verify_key: Path
    sites: tuple[SiteFiles, ...]

    @property
    def consortium_ledger(self) -> Path:
        """The coordinator's privacy ledger."""
        return self.root / "coordinator" / "consortium-ledger.sqlite"

    @property
    def coordinator_artifacts(self) -> Path:
        """Where the coordinator keeps the artifacts it signed."""
        return self.root / "coordinator" / "artifacts"

    def coordinator_env(self) -> dict[str, str]:
        """The ``DPMTV_SERVER_*`` variables the SuperLink (hence the ServerApp) must see."""
        return {
            "DPMTV_SERVER_SIGNING_KEY": str(self.signing_key),
            "DPMTV_SERVER_LEDGER_PATH": str(self.consortium_ledger),
            "DPMTV_SERVER_ARTIFACTS_DIR": str(self.coordinator_artifacts),
        }


def prepare_consortium(
    root: Path,
    *,
    sites: int = 3,
    per_site: int = 30,
    task: str = "colour",
    seed: int = 0,
    model: Path | None = None,
    data: Path | None = None,
    noise_mode: str = "central",
) -> ConsortiumFiles:
    """Write site data, a tiny random LLaVA model and the coordinator's signing key.

    ``model`` and ``data`` (a folder holding ``site-0`` ... ``site-{sites-1}``, docs/data.md)
    use your own model and per-site datasets instead; ``noise_mode`` is every site's own mode.
    """
    from client.data.synthetic import write_task_datasets
    from client.models import save_tiny_model  # torch: imported only when files are made
    from dpmtv_common.crypto import SigningKey
    from dpmtv_common.fingerprint import fingerprint_model_dir

    if data is None:
        data = root / "data"
        write_task_datasets(
            data, task=task, sites=sites, per_site=per_site, public=0, test=0, seed=seed
        )
    missing = [f"site-{i}" for i in range(sites) if not (data / f"site-{i}").is_dir()]
    if missing:
        raise SystemExit(f"--data must hold {missing} (docs/data.md), got {data}.")
    if model is None:
        model = root / "model"
        save_tiny_model("llava", model, seed=seed)
    (root / "coordinator").mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()
    key.save(root / "coordinator" / "signing.key")
    key.verify_key.save(root / "coordinator" / "signing.pub")
    roster = _write_roster(root, [f"site-{i}" for i in range(sites)])
    site_files = tuple(
        SiteFiles(
            name=f"site-{i}",
            model_path=model,
            data_path=data / f"site-{i}",
            ledger_path=root / f"site-{i}" / "ledger.sqlite",
            artifacts_dir=root / f"site-{i}" / "artifacts",
            trusted_keys=root / "coordinator" / "signing.pub",
            roster=roster,
            identity_key=root / f"site-{i}" / "identity.key",
            noise_mode=noise_mode,
        )
        for i in range(sites)
    )
    for site in site_files:
        site.artifacts_dir.mkdir(parents=True, exist_ok=True)
    return ConsortiumFiles(
        root=root,
        model_path=model,
        fingerprint=fingerprint_model_dir(model),
        signing_key=root / "coordinator" / "signing.key",
        verify_key=root / "coordinator" / "signing.pub",
        sites=site_files,
    )


def _write_roster(root: Path, names: list[str]) -> Path:
    """Each site's identity key under ``root/NAME/identity.key`` and the roster naming them.

    A real consortium makes the keys at each member (``dpmtv-site keygen``) and the roster
    from the public halves (``dpmtv-site roster make``); here one process plays every member.
    """
    from dpmtv_common.crypto import SigningKey
    from dpmtv_common.roster import Roster

    keys = {}
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        key = SigningKey.generate()
        key.save(root / name / "identity.key")
        keys[name] = key.verify_key
    roster = root / "roster.toml"
    roster.write_text(Roster("local-consortium", keys).to_toml())
    return roster


# ---------------------------------------------------------------- processes


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Managed:
    """A process we started in its own session, with its output kept in a timestamped log."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def text(self) -> str:
        """Everything the process printed so far."""
        return "\n".join(line for _, line in list(self.lines))

    def running(self) -> bool:
        """Whether the process has not exited yet."""
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        """Wait for the exit code, then briefly for the last lines to reach ``text()``."""
        code = self.process.wait(timeout=timeout)
        if self.reader is not None:  # a lingering child may hold the pipe: do not wait long
            self.reader.join(timeout=3)
        return code


def _pump(managed: Managed, stream: IO[bytes], started: float) -> None:
    with stream, managed.log.open("a", encoding="utf-8") as sink:
        for raw in iter(stream.readline, b""):
            line = _strip_ansi(raw.decode("utf-8", "replace").rstrip())
            now = time.monotonic() - started
            managed.lines.append((now, line))
            sink.write(f"[{now:8.2f}] {line}\n")
            sink.flush()


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session=True: pgid == pid


def _marked_pids(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``MARKER=marker`` (Linux /proc)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


class ProgressDeadline:
    """A deadline that moves while the consortium makes progress.

    It expires once no process has printed for ``quiet`` seconds (stuck), or after
    ``CAP_FACTOR`` times ``quiet`` in all (a loop that prints forever). On a loaded machine a
    release is slow but keeps printing (every Flower message, every site's stage), so a
    fixed total would fail it; silence is what a hung release shows.
    """

    CAP_FACTOR = 6.0

    def __init__(self, last_output: Callable[[], float], quiet: float) -> None:
        self._last_output = last_output
        self.quiet = quiet
        self.started = time.monotonic()

    def expired(self) -> bool:
        """Whether the wait is over: silent for ``quiet`` s, or past the cap."""
        now = time.monotonic()
        since = now - max(self.started, self._last_output())
        return since > self.quiet or now - self.started > self.CAP_FACTOR * self.quiet

    def why(self) -> str:
        """What the wait allowed, for an error message."""
        waited = time.monotonic() - self.started
        return (
            f"waited {waited:.0f} s: at most {self.quiet:g} s of silence, "
            f"{self.CAP_FACTOR * self.quiet:g} s in all"
        )


def keep_logs(logs: Path, keep_in: Path, *, tail: int = 40) -> str:
    """Copy ``logs`` into ``keep_in`` (a new folder); where it went and each log's tail.

    Test runs delete old temporary folders: a failure's logs must outlive them.
    """
    keep_in.mkdir(parents=True, exist_ok=True)
    kept = keep_in / dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    shutil.copytree(logs, kept)
    parts = [f"logs kept in {kept}"]
    for log in sorted(kept.glob("*.log")):
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        parts.append(f"--- {log.name} (last {min(tail, len(lines))} of {len(lines)} lines)")
        parts.extend(lines[-tail:])
    return "\n".join(parts)


@dataclass(frozen=True)
class RunResult:
    """How a ``flwr run`` ended, with its streamed log."""

    run_id: int | None
    status: str
    exit_code: int | None
    seconds: float
    log: str

    @property
    def completed(self) -> bool:
        """Whether Flower reports the run finished without error."""
        return self.status == "finished:completed"


class Consortium:
    """SuperLink, SuperNodes and ``flwr run`` on 127.0.0.1; a context manager that cleans up.

    Args:
        workdir: Where Flower homes, logs and the run config go.
        credentials: TLS files and site keys from :func:`make_credentials`.
        coordinator_env: Variables for the SuperLink and so the ServerApp
            (``ConsortiumFiles.coordinator_env()``).
        site_env: Extra variables for every SuperNode (and so its ClientApp processes).
    """

    def __init__(
        self,
        workdir: Path,
        credentials: Credentials,
        *,
        coordinator_env: Mapping[str, str],
        site_env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.credentials = credentials
        self.coordinator_env = dict(coordinator_env)
        self.site_env = {"OMP_NUM_THREADS": "1", **(site_env or {})}
        self.marker = uuid.uuid4().hex
        self.started = time.monotonic()
        self.processes: dict[str, Managed] = {}
        self.retired: list[Managed] = []  # earlier processes of a reused name (e.g. flwr-run)
        self.port = free_port()
        self.cli_home = workdir / "flwr-cli"
        for folder in ("logs", "flwr-cli", "flwr-superlink"):
            (workdir / folder).mkdir(parents=True, exist_ok=True)
        self._write_cli_config()

    # -- context manager -------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- environment -----------------------------------------------------------------------

    def _env(self, flwr_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        # DPMTV_* of the caller must not leak into a component that did not ask for it.
        env = {key: value for key, value in os.environ.items() if not key.startswith("DPMTV_")}
        env.update(OFFLINE_ENV)
        env.update(PROCESS_ENV)
        env.update(extra or {})
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env["FLWR_HOME"] = str(flwr_home)
        env[MARKER] = self.marker
        return env

    def _write_cli_config(self) -> None:
        config = (
            "[superlink]\n"
            f'default = "{FEDERATION}"\n\n'
            f"[superlink.{FEDERATION}]\n"
            f'address = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{self.credentials.ca_cert}"\n'
        )
        (self.cli_home / "config.toml").write_text(config)

    # -- processes -------------------------------------------------------------------------

    def start(self, name: str, command: list[str], env: Mapping[str, str]) -> Managed:
        """Start ``command`` in its own session; its output goes to ``logs/<name>.log``."""
        process = subprocess.Popen(  # noqa: S603 (our own binaries, argument list)
            command,
            cwd=REPO,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        managed = Managed(name, process, self.workdir / "logs" / f"{name}.log")
        assert process.stdout is not None  # noqa: S101 (stdout=PIPE above)
        managed.reader = threading.Thread(
            target=_pump, args=(managed, process.stdout, self.started), daemon=True
        )
        managed.reader.start()
        if name in self.processes:  # keep it: close() still stops and reaps it
            self.retired.append(self.processes[name])
        self.processes[name] = managed
        return managed

    def last_output(self) -> float:
        """``time.monotonic()`` of the latest line any process of the consortium printed."""
        latest = [m.lines[-1][0] for m in [*self.retired, *self.processes.values()] if m.lines]
        return self.started + max(latest, default=0.0)

    def deadline(self, quiet: float) -> ProgressDeadline:
        """A wait that lasts while the consortium makes progress (see :class:`ProgressDeadline`)."""
        return ProgressDeadline(self.last_output, quiet)

    def wait_for_line(self, name: str, pattern: str, timeout: float, *, skip: int = 0) -> str:
        """Wait until process ``name`` prints a line matching ``pattern``; return the line.

        ``timeout`` is the longest the consortium may stay silent, not a total: while its
        processes print (a loaded machine is slow, not stuck) the wait goes on, up to
        :data:`ProgressDeadline.CAP_FACTOR` times ``timeout``. ``skip`` ignores the first
        lines (``line_count`` before an event of interest).
        """
        regex = re.compile(pattern)
        deadline = self.deadline(timeout)
        managed = self.processes[name]
        seen = skip
        while not deadline.expired():
            lines = list(managed.lines)
            for _, line in lines[seen:]:
                if regex.search(line):
                    return line
            seen = len(lines)
            if not managed.running() and managed.reader and not managed.reader.is_alive():
                break
            time.sleep(0.2)
        raise TimeoutError(
            f"{name} must print a line matching {pattern!r} ({deadline.why()}); it "
            f"{'is still running' if managed.running() else 'exited'}. Log: {managed.log}"
        )

    def line_count(self, name: str) -> int:
        """How many lines process ``name`` printed so far."""
        return len(self.processes[name].lines)

    def kill(self, name: str) -> None:
        """SIGKILL the process group of ``name`` (a crash, not a shutdown)."""
        _signal_group(self.processes[name].process, signal.SIGKILL)
        self.processes[name].process.wait(timeout=10)

    def close(self, grace: float = 10.0) -> None:
        """Stop every process group (SIGTERM, then SIGKILL), then sweep marked stragglers."""
        everything = [*self.retired, *self.processes.values()]
        for managed in everything:
            if managed.running():
                _signal_group(managed.process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for managed in everything:
            with contextlib.suppress(subprocess.TimeoutExpired):
                managed.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            _signal_group(managed.process, signal.SIGKILL)  # the group may outlive its leader
            with contextlib.suppress(subprocess.TimeoutExpired):
                managed.process.wait(timeout=5)
        for pid in _marked_pids(self.marker):  # e.g. a child that started its own session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for managed in everything:
            if managed.reader is not None:
                managed.reader.join(timeout=5)

    def leftover_pids(self) -> list[int]:
        """Live processes started by this consortium (empty after ``close``)."""
        return _marked_pids(self.marker)

    # -- the coordinator -------------------------------------------------------------------

    def start_superlink(self, timeout: float = 60.0) -> Managed:
        """Start the TLS SuperLink with SuperNode authentication; wait until it listens."""
        creds = self.credentials
        command = [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile", str(creds.ca_cert),
            "--ssl-certfile", str(creds.server_cert),
            "--ssl-keyfile", str(creds.server_key),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1",
            "--port", str(self.port),
        ]  # fmt: skip
        env = self._env(self.workdir / "flwr-superlink", self.coordinator_env)
        managed = self.start("superlink", command, env)
        _wait_for_port(self.port, self.deadline(timeout), managed)
        return managed

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run one ``flwr`` CLI command against this consortium's SuperLink."""
        return subprocess.run(  # noqa: S603 (our own binary, argument list)
            [str(BIN / "flwr"), *args],
            cwd=REPO,
            env=self._env(self.cli_home),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def register(self, site: str) -> None:
        """Register ``site``'s public key with the SuperLink (``flwr supernode register``)."""
        done = self.flwr(
            "supernode", "register", str(self.credentials.public_key(site)), FEDERATION,
            "--name", site,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"flwr supernode register {site} failed: {done.stdout}{done.stderr}")

    def supernodes(self) -> list[dict[str, Any]]:
        """The SuperLink's node list (``flwr supernode list --format json``)."""
        done = self.flwr("supernode", "list", FEDERATION, "--format", "json")
        if done.returncode != 0:
            raise RuntimeError(f"flwr supernode list failed: {done.stdout}{done.stderr}")
        payload = json.loads(done.stdout)
        return list(payload.get("nodes", []))

    # -- the sites -------------------------------------------------------------------------

    def start_site_service(self, site: SiteFiles, timeout: float = 120.0) -> Managed:
        """Start ``site``'s service (its data, model, ledger, keys); wait until it listens."""
        name = f"{site.name}-service"
        home = self.workdir / f"flwr-{name}"
        home.mkdir(parents=True, exist_ok=True)
        managed = self.start(name, site.service_command(), self._env(home, self.site_env))
        self.wait_for_line(name, r"serving on", timeout=timeout)
        return managed

    def start_supernode(
        self,
        site: SiteFiles,
        *,
        key: Path | None = None,
        insecure: bool = False,
        authenticate: bool = True,
        name: str | None = None,
        extra_args: Iterable[str] = (),
    ) -> Managed:
        """Start ``site``'s SuperNode: TLS and its own key, unless told otherwise.

        Args:
            site: The site's files, passed as ``--node-config``.
            key: Another private key to authenticate with (e.g. an unregistered one).
            insecure: Dial without TLS (``--insecure``): the TLS SuperLink must refuse it.
            authenticate: Pass ``--auth-supernode-private-key`` at all.
            name: Process name for logs (default: the site's name).
            extra_args: More ``flower-supernode`` flags (e.g. ``--max-retries``).
        """
        name = name or site.name
        command = [
            str(BIN / "flower-supernode"),
            "--superlink", f"127.0.0.1:{self.port}",
            "--port", str(free_port()),
            "--node-config", site.node_config(),
        ]  # fmt: skip
        if insecure:
            command.append("--insecure")
        else:
            command += ["--root-certificates", str(self.credentials.ca_cert)]
        if authenticate:
            key = key or self.credentials.private_key(site.name)
            command += ["--auth-supernode-private-key", str(key)]
        command += list(extra_args)
        home = self.workdir / f"flwr-{name}"
        home.mkdir(parents=True, exist_ok=True)
        return self.start(name, command, self._env(home, self.site_env))

    # -- the run ---------------------------------------------------------------------------

    def submit(
        self, run_config: Mapping[str, object], *, app: Path = REPO, name: str = "flwr-run"
    ) -> Managed:
        """``flwr run APP consortium --stream`` with ``run_config`` written to a TOML file.

        ``app`` is the Flower app's folder (default: this project's); ``name`` names the
        process and its log (``logs/<name>.log``).
        """
        path = self.workdir / f"{name}-config.toml"
        path.write_text("".join(f"{key} = {_toml(value)}\n" for key, value in run_config.items()))
        command = [str(BIN / "flwr"), "run", str(app), FEDERATION, "--stream"]
        command += ["--run-config", str(path)]
        return self.start(name, command, self._env(self.cli_home))

    def run_id(self, managed: Managed, timeout: float = 60.0) -> int:
        """The run id ``flwr run`` printed."""
        match = _RUN_ID.search(self.wait_for_line(managed.name, _RUN_ID.pattern, timeout))
        if match is None:  # the pattern matched, so this cannot happen
            raise RuntimeError(f"no run id in the output of {managed.name}")
        return int(match.group(1))

    def stop_run(self, run_id: int) -> subprocess.CompletedProcess[str]:
        """``flwr stop RUN_ID``, as an operator would."""
        return self.flwr("stop", str(run_id), FEDERATION)

    def run_status(self, run_id: int) -> str:
        """Flower's status of ``run_id`` (e.g. ``running``, ``finished:completed``)."""
        done = self.flwr("ls", FEDERATION, "--run-id", str(run_id), "--format", "json")
        if done.returncode != 0:
            return "unknown"
        runs = json.loads(done.stdout).get("runs", [])
        return str(runs[0].get("status", "unknown")) if runs else "unknown"

    def wait_run(self, managed: Managed, timeout: float) -> RunResult:
        """Wait for the streamed run to end; stop it once the consortium is silent too long.

        ``timeout`` bounds silence, not the run (:meth:`wait_for_line`): a run that keeps
        its processes printing on a loaded machine is waited for, up to the cap.
        """
        started = time.monotonic()
        line = self.wait_for_line(managed.name, _RUN_ID.pattern, timeout=60)
        match = _RUN_ID.search(line)
        run_id = int(match.group(1)) if match else None
        status = "unknown"
        deadline = self.deadline(timeout)
        # The stream ends with the run; `flwr ls` (a CLI process, ~1 s of CPU) is asked only
        # every 15 s as a fallback, so waiting does not slow the release on shared cores.
        checked = time.monotonic()
        while managed.running() and not deadline.expired():
            if run_id is not None and time.monotonic() - checked > 15:
                checked = time.monotonic()
                if self.run_status(run_id).startswith("finished"):
                    break
            time.sleep(0.2)
        for _ in range(20):  # the status may lag the stream's end by a moment
            if run_id is None:
                break
            status = self.run_status(run_id)
            if status.startswith("finished") or deadline.expired():
                break
            time.sleep(0.5)
        if run_id is not None and not status.startswith("finished"):
            self.flwr("stop", str(run_id), FEDERATION)
        with contextlib.suppress(subprocess.TimeoutExpired):
            managed.process.wait(timeout=15)  # the stream ends shortly after the run
        return RunResult(
            run_id, status, managed.process.poll(), time.monotonic() - started, managed.text()
        )


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _wait_for_port(port: int, deadline: ProgressDeadline, managed: Managed) -> None:
    while not deadline.expired():
        if not managed.running():
            raise RuntimeError(f"{managed.name} exited early; log: {managed.log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{managed.name} must listen on port {port} ({deadline.why()}).")


def stage_timings(log: str) -> dict[str, float]:
    """Seconds per coordinator stage, from the ServerApp's "stage seconds:" summary line.

    Example line: ``... stage seconds: wait 0.0, plan 15.2, sums+noise 51.7, broadcast 15.3``.
    """
    match = re.search(r"stage seconds: (.*)", log)
    if match is None:
        return {}
    pairs = (item.rsplit(" ", 1) for item in match.group(1).split(", "))
    return {stage: float(seconds) for stage, seconds in pairs}


# ---------------------------------------------------------------- command line


def _prepare_from_args(root: Path, args: argparse.Namespace) -> ConsortiumFiles:
    """``prepare_consortium`` with the options ``prepare`` and ``run`` share."""
    return prepare_consortium(
        root,
        sites=args.sites,
        per_site=args.per_site,
        task=args.task,
        model=args.model.resolve() if args.model else None,
        data=args.data.resolve() if args.data else None,
        noise_mode=args.noise_mode,
    )


def _run(args: argparse.Namespace) -> int:
    workdir: Path = args.workdir.resolve()
    files = _prepare_from_args(workdir, args)
    creds = make_credentials(workdir / "credentials", [site.name for site in files.sites])
    run_config: dict[str, object] = {
        "task": args.task,
        "model-fingerprint": files.fingerprint,
        "expected-sites": args.sites,
        "min-sites": min(2, args.sites),
        "noise-mode": args.noise_mode,
    }
    for item in args.run_config.split():
        key, _, value = item.partition("=")
        run_config[key] = _parse_value(value)
    if args.noise_mode == "distributed" and "max-chunks-per-site" not in run_config:
        run_config["max-chunks-per-site"] = _largest_site_chunks(files, run_config)
    with Consortium(workdir, creds, coordinator_env=files.coordinator_env()) as consortium:
        consortium.start_superlink()
        for site in files.sites:
            consortium.register(site.name)
            consortium.start_site_service(site)
            consortium.start_supernode(site)
        result = consortium.wait_run(consortium.submit(run_config), timeout=args.timeout)
    print(result.log)
    stages = ", ".join(f"{name} {sec:.1f} s" for name, sec in stage_timings(result.log).items())
    print(f"run {result.run_id}: {result.status} after {result.seconds:.1f} s ({stages})")
    print(f"logs: {workdir / 'logs'}; artifacts: {files.sites[0].artifacts_dir.parent.parent}")
    return 0 if result.completed else 1


def _largest_site_chunks(files: ConsortiumFiles, run_config: Mapping[str, object]) -> int:
    """The most chunks a site cuts (a public count; it sizes the distributed SecAgg+ grid)."""
    from client.activations.chunking import planned_num_chunks
    from client.data.records import load_dataset

    shots = int(str(run_config.get("shots", 4)))
    return max(
        planned_num_chunks(load_dataset(site.data_path, check_images=False), shots, None)
        for site in files.sites
    )


def _parse_value(text: str) -> object:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: take it as a string


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    creds = commands.add_parser("make-credentials", help="write certs/ and keys/ under ROOT")
    creds.add_argument("root", type=Path)
    creds.add_argument("--sites", type=int, default=3, help="keys for site-0 ... site-{N-1}")
    creds.add_argument(
        "--host", action="append", default=[], help="extra SAN, e.g. superlink (repeatable)"
    )
    prepare = commands.add_parser("prepare", help="write demo data, model, signing key")
    prepare.add_argument("root", type=Path)
    run = commands.add_parser("run", help="prepare, start everything, make one release")
    run.add_argument("--workdir", type=Path, required=True)
    run.add_argument("--run-config", default="", help="'key=value key=value' (TOML values)")
    run.add_argument("--timeout", type=float, default=900.0)
    for command in (prepare, run):
        command.add_argument("--sites", type=int, default=3)
        command.add_argument("--per-site", type=int, default=30)
        command.add_argument("--task", default="colour")
        command.add_argument("--model", type=Path, help="your own model (default: tiny random)")
        command.add_argument("--data", type=Path, help="your folder of site-0 ... site-{N-1}")
        command.add_argument("--noise-mode", choices=("central", "distributed"), default="central")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``make-credentials``, ``prepare`` or ``run`` (see ``--help``)."""
    args = _parser().parse_args(argv)
    if args.command == "make-credentials":
        sites = [f"site-{i}" for i in range(args.sites)]
        made = make_credentials(args.root, sites, hosts=["127.0.0.1", "localhost", *args.host])
        print(f"wrote {made.certs} and {made.keys}")
        return 0
    if args.command == "prepare":
        root = args.root.resolve()
        files = _prepare_from_args(root, args)
        print(f"wrote data, model and coordinator key under {root}")
        print(f"model-fingerprint = {files.fingerprint}")
        return 0
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())

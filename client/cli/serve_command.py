"""``dpmtv-site serve``, ``service-status`` and ``ask``: the site service, its health, its answers.

``serve`` is what a site admin starts, under the site's own user, from the installed package:
it owns the model, the data, the ledger and the keys, and answers the Flower relay over a
Unix socket (docs/deployment.md). ``service-status`` asks a running service whether it is up
(and, run as the service's user, reads the pid and open releases from its status file);
``ask`` has it answer questions with an artifact it stores (its model stays loaded).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import signal
import socket
from pathlib import Path
from types import FrameType
from typing import Any

from client.cli._common import add_model_options, check_site_model, settings_from
from client.cli._types import file_mode, open_unit_float, positive_float, positive_int
from client.cli.http_options import add_http_options, check_http, start_http
from client.release.ledgers import check_one_ledger
from client.service.wire import FrameKind, read_frame, write_frame
from client.settings import service_status_file
from dpmtv_common.errors import ConfigError, DataError, ServiceError

__all__ = ["register"]

_EPILOG = """\
The SuperNode of this site then runs with
  --node-config "site-socket='SOCKET'"
and must be able to write to SOCKET (e.g. a shared group and --socket-mode 0o660); it needs
no access to the data, the ledger or the keys. One service serves one ledger: a second is
refused. SIGTERM or Ctrl-C stops it cleanly (open releases are resolved from the site's own
record: nothing sent -> refund; anything sent -> counted).
"""

_log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    """Add ``serve``, ``service-status`` and ``ask``."""
    parser = sub.add_parser(
        "serve",
        help="run the site service that the Flower relay talks to (owns data, ledger, keys)",
        description="Run this site's service: the only process that reads the site's data, "
        "model, ledger and keys during a federated release.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_option(parser)
    add_model_options(parser)
    parser.add_argument("--data", type=Path, help="the site's private dataset folder")
    parser.add_argument("--name", help="how the site names itself to the coordinator")
    parser.add_argument("--state-dir", type=Path, help="default folder of ledger and artifacts")
    parser.add_argument("--ledger", dest="ledger_path", type=Path, help="the site's ledger")
    parser.add_argument("--artifacts-dir", type=Path, help="where received artifacts go")
    parser.add_argument("--socket", dest="socket_path", type=Path, help="the Unix socket")
    parser.add_argument("--socket-mode", type=file_mode, help="octal, e.g. 660")
    parser.add_argument(
        "--trusted-key",
        dest="trusted_keys",
        type=Path,
        action="append",
        help="coordinator public key whose artifacts are accepted (repeat)",
    )
    parser.add_argument(
        "--roster",
        type=Path,
        help="the consortium roster (TOML) whose members may share a secure sum with this site",
    )
    parser.add_argument(
        "--identity-key",
        type=Path,
        help="this member's roster identity key (PEM private key from 'dpmtv-site keygen')",
    )
    parser.add_argument("--budget-epsilon", type=positive_float, help="total ε of this data")
    parser.add_argument("--budget-delta", type=open_unit_float, help="δ of the ledger")
    parser.add_argument("--min-sites", type=positive_int, help="fewest sites in a plan (>= 2)")
    parser.add_argument("--max-release-epsilon", type=positive_float, help="per-release ε cap")
    parser.add_argument(
        "--noise-mode",
        choices=("central", "distributed"),
        help="the trust mode this site takes part in (default central); plans of the other "
        "mode are refused",
    )
    parser.add_argument(
        "--min-honest",
        type=positive_int,
        help="distributed mode: the fewest honest sites this site assumes in a sum (default 2; "
        "1 = its own noise share alone protects it)",
    )
    parser.add_argument(
        "--idle-release-seconds",
        type=positive_float,
        help="resolve a release whose run sent no message for this long (default 900; keep it "
        "above the coordinator's stage timeout)",
    )
    parser.add_argument(
        "--answer-end-from",
        type=Path,
        action="append",
        metavar="DIR",
        help="a labelled PUBLIC dataset (repeat for more): every release served under the "
        "prompt-last-token policy learns from them, at its first request, where a one-token "
        "answer ends, and stops there (no privacy cost; for tasks whose answers are one token)",
    )
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: cores)")
    add_http_options(parser)
    parser.set_defaults(handler=run_serve)
    status = sub.add_parser("service-status", help="ask a running site service whether it is up")
    _add_config_option(status)
    status.add_argument("--socket", dest="socket_path", type=Path, help="the service's socket")
    status.add_argument("--state-dir", type=Path, help="default folder of the socket")
    status.set_defaults(handler=run_status)
    ask = sub.add_parser(
        "ask",
        help="answer questions with the running service's model and a stored artifact",
        description="Send images and questions to the running site service, which answers "
        "with its loaded model patched by the verified artifact of --release-id (no privacy "
        "cost: the vector is released). Images travel as bytes; the service opens no path.",
    )
    _add_config_option(ask)
    ask.add_argument("--release-id", required=True, help="a release whose artifact it stores")
    ask.add_argument("--image", type=Path, action="append", required=True, help="repeatable")
    ask.add_argument("--question", action="append", required=True, help="one per --image")
    ask.add_argument(
        "--instruction",
        help="text put before each question; must be the release's dataset.json "
        "'instruction' (default: none)",
    )
    ask.add_argument("--max-new-tokens", type=positive_int, default=10)
    ask.add_argument("--socket", dest="socket_path", type=Path, help="the service's socket")
    ask.add_argument("--state-dir", type=Path, help="default folder of the socket")
    ask.set_defaults(handler=run_ask)


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        dest="config_file",
        type=Path,
        help="a TOML file of site settings (keys as the flags, e.g. budget-epsilon = 4.0); "
        "flags and DPMTV_CLIENT_* variables win over it. No other file (no .env) is read",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Start the service and block until SIGTERM/SIGINT."""
    settings = settings_from(args)  # the thread policy (--threads) is set by main()
    http = check_http(args)  # a bad address or token file stops here, before the model
    from client.service.server import SiteService
    from client.service.sum_stages import load_membership  # loads torch: only here

    check_site_model(settings)  # refused in one line, before weights, data or socket
    for line in check_one_ledger(settings):  # one ledger per site: refused if split
        _log.warning(line)
    if load_membership(settings) is None:  # a wrong roster or key is refused here, too
        _log.warning(
            "no --roster and --identity-key: this site refuses every federated release "
            "(it cannot tell real sites from made-up ones) and serves local inference only."
        )
    service = SiteService(settings)
    service.site.model()  # load once, before the first relay waits on it
    # Every record decoded and the answers checked now, before any plan: from here on a
    # record that breaks costs its own chunk, never the site's place in a release.
    service.site.check_data()
    service.acquire()

    def stop(signum: int, frame: FrameType | None) -> None:
        service.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    endpoint = start_http(http, service.site, service.model_lock)
    try:
        service.serve(settings.socket_file)
    finally:
        if endpoint is not None:
            endpoint.stop()
    return 0


def _exchange(
    path: Path, kind: FrameKind, payload: bytes, timeout: float
) -> tuple[FrameKind, bytes]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            write_frame(sock, kind, payload)
            return read_frame(sock, max_bytes=1 << 24)
    except OSError as exc:
        raise ServiceError(
            f"no site service answers on {path}: {exc}. Is 'dpmtv-site serve' running? "
            "(--socket or --state-dir name where it listens)"
        ) from exc


def run_status(args: argparse.Namespace) -> int:
    """Print whether the service is up, with its status file's details where readable.

    The socket's ``PING`` answers only that the service is alive (whoever shares the socket,
    the relay included, may ask). The pid, the open releases and the service's files come
    from the status file the service keeps beside its socket, readable by its own user: run
    this as that user to see them.
    """
    path = settings_from(args).socket_file
    kind, payload = _exchange(path, FrameKind.PING, b"", timeout=10.0)
    if kind is not FrameKind.STATUS:
        raise ServiceError(f"the service at {path} answered {kind.name}, not a status.")
    status = json.loads(payload)
    status_file = service_status_file(path)
    try:
        status = {**json.loads(status_file.read_text(encoding="utf-8")), **status}
    except PermissionError:
        status["details"] = f"{status_file} is readable by the service's user only"
    except (OSError, ValueError):
        status["details"] = f"no status file at {status_file} (a service of an older version?)"
    print(json.dumps(status, indent=1, sort_keys=True))
    return 0


def run_ask(args: argparse.Namespace) -> int:
    """Print one answer per --image/--question pair, as the running service gives them."""
    if len(args.image) != len(args.question):
        raise ConfigError(
            f"--image and --question must pair up, got {len(args.image)} and {len(args.question)}."
        )
    images = []
    for image in args.image:
        try:
            images.append(base64.b64encode(image.read_bytes()).decode())
        except OSError as exc:
            raise DataError(
                f"--image must be a readable file, got {str(image)!r} ({exc})."
            ) from exc
    request = {
        "release_id": args.release_id,
        "questions": args.question,
        "images": images,
        "instruction": args.instruction,
        "max_new_tokens": args.max_new_tokens,
    }
    path = settings_from(args).socket_file
    kind, payload = _exchange(path, FrameKind.INFER, json.dumps(request).encode(), timeout=600.0)
    if kind is not FrameKind.ANSWERS:
        raise ServiceError(f"the site service refused: {payload.decode(errors='replace')}")
    for answer in json.loads(payload)["answers"]:
        print(answer)
    return 0

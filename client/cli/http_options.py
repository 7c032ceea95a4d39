"""The ``--http*`` options of ``dpmtv-site serve``: the OpenAI-compatible endpoint, off by default.

Checked before the model loads (address, token file), started once the service holds its
ledger (:class:`client.service.http_server.HttpEndpoint`).
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli._types import file_mode, positive_int
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    from client.release.site import Site
    from client.service.http_server import HttpEndpoint, HttpSettings

__all__ = ["add_http_options", "check_http", "start_http"]


def add_http_options(parser: Any) -> None:
    """Add the endpoint's options to ``serve``."""
    group = parser.add_argument_group(
        "HTTP endpoint (OpenAI-compatible chat completions; off unless --http is given)"
    )
    group.add_argument(
        "--http",
        metavar="HOST:PORT|unix:PATH",
        help="serve POST /v1/chat/completions, GET /v1/models, /metrics and /health here "
        "(a loopback address, e.g. 127.0.0.1:8080, or a Unix socket)",
    )
    group.add_argument(
        "--http-token-file",
        type=Path,
        help="the bearer token clients must send (one line, owner-only file); required with --http",
    )
    group.add_argument(
        "--http-allow-remote",
        action="store_true",
        help="allow a non-loopback --http address (put TLS in front: the token is in clear)",
    )
    group.add_argument(
        "--http-max-queue",
        type=positive_int,
        default=64,
        help="requests admitted at once; more are answered 503 (default 64)",
    )
    group.add_argument(
        "--http-max-connections",
        type=positive_int,
        default=256,
        help="open connections served at once; more are answered 503 (default 256)",
    )
    group.add_argument(
        "--http-max-request-mib",
        type=positive_int,
        default=1024,
        help="MiB of request bodies and decoded images held at once (a request's images until "
        "it is answered); a request that would pass it is answered 503, unless it is the only "
        "one (default 1024; one request holds at most about 150)",
    )
    group.add_argument(
        "--http-batch-invariant",
        action="store_true",
        help="answer each request alone, so an answer is bit-identical to plain generate()'s "
        "whatever else is asked at the time (costs the batching gain: see "
        "docs/benchmarks/serving.md)",
    )
    group.add_argument(
        "--http-socket-mode",
        type=file_mode,
        default=0o660,
        help="permission bits of a unix: socket, octal (default 660)",
    )


def check_http(args: argparse.Namespace) -> HttpSettings | None:
    """The endpoint's settings, checked (address, token file), or None when --http is unset.

    Raises:
        ConfigError: A bad address, or a token file missing, shared or too short.
    """
    if getattr(args, "http", None) is None:
        if getattr(args, "http_token_file", None) is not None:
            raise ConfigError("--http-token-file must come with --http, got no --http.")
        return None
    from client.service.http_server import HttpSettings, parse_address, read_token

    if args.http_token_file is None:
        raise ConfigError(
            "--http-token-file must be given with --http, got none; the endpoint never runs "
            "without a token."
        )
    parse_address(args.http, allow_remote=args.http_allow_remote)
    read_token(args.http_token_file)
    return HttpSettings(
        address=args.http,
        token_file=args.http_token_file,
        allow_remote=args.http_allow_remote,
        max_queue=args.http_max_queue,
        max_connections=args.http_max_connections,
        max_request_memory=args.http_max_request_mib << 20,
        socket_mode=args.http_socket_mode,
        batch_invariant=args.http_batch_invariant,
    )


def start_http(
    settings: HttpSettings | None, site: Site, model_lock: threading.Lock
) -> HttpEndpoint | None:
    """Start the endpoint when ``settings`` is given; say where it listens on stderr."""
    if settings is None:
        return None
    from client.service.http_server import HttpEndpoint

    endpoint = HttpEndpoint(site, model_lock, settings)
    where = endpoint.start()
    print(f"HTTP endpoint on {where}", file=sys.stderr, flush=True)
    return endpoint

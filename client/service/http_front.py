"""The HTTP front: a process of its own that speaks HTTP for the site service.

How this connects: :class:`~client.service.http_server.HttpEndpoint` binds the listening
socket, then starts ``python -m client.service.http_front --listen-fd N --link-fd M`` with
that socket and its end of a Unix socket pair. The front reads its settings (the token among
them: never on its command line) from the link's first frame, serves the routes of
:mod:`client.service.http_api` with uvicorn (httptools, else h11; connections bounded by
:mod:`client.service.http_guard`), says ``ready`` once it listens, and stops when the site
service says ``stop`` or its end of the link closes (the service stopped or died: no front
outlives it).

Why a process: HTTP parsing, JSON, base64 and image decoding cost about as much a request as
a small model's whole answer. In the site service they would take turns with the batcher's
decoding loop under one interpreter lock; here they run beside it, on another core.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import socket
import sys

import uvicorn

from client.service.front_link import read_frame
from client.service.http_api import FrontApi, FrontLink, announce_chat, build_app
from client.service.http_guard import IdleConnections, guarded_protocol
from client.service.write_coalescing import IdleSelector

__all__ = ["main"]

_log = logging.getLogger("client.service.http_front")


def _settings(link: socket.socket) -> dict[str, object]:
    frame = read_frame(link)
    if frame is None or frame[0].get("kind") != "init":
        raise SystemExit("the HTTP front must get its settings from the site service first.")
    return frame[0]


async def _serve(
    listener: socket.socket, link_socket: socket.socket, selector: IdleSelector
) -> None:
    settings = _settings(link_socket)
    server: uvicorn.Server | None = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    link_socket.setblocking(False)
    _, link = await loop.connect_accepted_socket(
        lambda: FrontLink(stop, defer=selector.defer), sock=link_socket
    )
    api = FrontApi(
        token=str(settings["token"]).encode(),
        max_queue=int(settings["max_queue"]),  # type: ignore[call-overload]
        max_memory=int(settings["max_request_memory"]),  # type: ignore[call-overload]
        owner=str(settings["owner"]),
        link=link,
    )
    idle = IdleConnections(int(settings["idle_per_client"]))  # type: ignore[call-overload]
    protocol = guarded_protocol(idle, functools.partial(announce_chat, link))
    config = uvicorn.Config(
        build_app(api),
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        http=protocol,
        ws="none",  # no websockets served (nor their library imported)
        proxy_headers=False,  # no client address is read, and no forwarded header trusted
        loop="asyncio",
        limit_concurrency=int(settings["max_connections"]),  # type: ignore[call-overload]
        timeout_keep_alive=5,
        timeout_graceful_shutdown=10,  # a stop waits this long for answers under way
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if server.started and not link.lost:
        link.send({"kind": "ready"})
    await serving


def main(argv: list[str] | None = None) -> int:
    """Serve until told to stop (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m client.service.http_front")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--link-fd", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    listener = socket.socket(fileno=args.listen_fd)
    link = socket.socket(fileno=args.link_fd)
    selector = IdleSelector()  # the link's frames leave when the loop goes idle
    try:
        with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
            runner.run(_serve(listener, link, selector))
    finally:
        link.close()
        listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

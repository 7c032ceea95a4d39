"""The site's real Flower handlers, run inside the site service (never in the relay).

Message types (the coordinator's ``server.app`` sends them in this order):

* ``query.plan`` — a ``PlanRequest`` (a centred plan's public centre rides beside it);
  replies ``PlanAccept`` with the site's signed key for the release's secure sums, or
  ``ErrorReply``.
* ``query.sum_keys`` — every participant's key (sparse graphs only); the site checks them
  against its roster, counts the graph draw against its policy and replies ``NonceReveal``.
* ``query.sum_shares`` — every participant's key and nonce; the site draws the graph (and
  checks the keys, for a complete graph), shares its self-mask seeds and replies
  ``MaskedInput`` (sealed shares, and its masked input to the first sum beside it).
* ``query.sum_collect`` — a later sum's instructions (in release-first order with private
  selection, the noisy all-head vector rides beside them); replies ``MaskedInput``.
* ``query.sum_survivors`` / ``query.sum_unmask`` — the survivor set to sign, then every
  survivor's signature on it; replies ``SurvivorsSigned`` / ``UnmaskReply``.
* ``query.release`` — the signed artifact; replies ``ReleaseAck``.
* ``query.abort`` — the release stops; the site resolves it from its own record.

The protocol, and what the site checks at each step, is :mod:`client.secure_sum`. Every
failure becomes data: an ``ErrorReply`` with a code and a fixed reason; exception text stays
in the site log. The relay only ever carries masked integers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode as FlowerErrorCode

from client.release.site import Site
from client.service.sum_stages import SiteSums
from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.errors import DpmtvError
from protocol import (
    CENTRE_ARRAY_KEY,
    AbortNotice,
    ErrorReply,
    MessageDecodeError,
    PlanRequest,
    ReleaseRequest,
    WireMessage,
    expect,
    message_to_record,
)
from protocol.codec import array_from_record, with_array
from protocol.secure_sum import (
    MASKED_ARRAY_KEY,
    REFERENCE_ARRAY_KEY,
    MaskedInput,
    SumCollectRequest,
    SumKeysRequest,
    SumSharesRequest,
    SurvivorsRequest,
    UnmaskRequest,
)

__all__ = ["build_site_app", "error_message"]

_log = logging.getLogger(__name__)


def build_site_app(site: Site, sums: SiteSums | None = None) -> ClientApp:
    """The ClientApp whose handlers decide for ``site``; the service calls it per message.

    ``sums`` holds the secure-sum sessions; pass one to reach them from outside (the
    service drops those of releases its sweep resolved).
    """
    sums = sums if sums is not None else SiteSums(site)
    app = ClientApp()
    _add_release_handlers(app, site, sums)
    _add_input_handlers(app, sums)
    _add_unmask_handlers(app, sums)
    return app


def _add_release_handlers(app: ClientApp, site: Site, sums: SiteSums) -> None:
    """The plan (with the release's signed key), the artifact and the abort notice."""

    @app.query("plan")
    def plan(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            request = expect(msg.content, PlanRequest)
            node, run = msg.metadata.dst_node_id, msg.metadata.run_id
            centre = _array_beside(msg, CENTRE_ARRAY_KEY)
            return sums.accept(request.plan, node_id=node, run_id=run, centre=centre)

        return _reply(msg, handle)

    @app.query("release")
    def release(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            request = expect(msg.content, ReleaseRequest)
            ack = site.finish(request, run_id=msg.metadata.run_id)
            sums.forget(request.release_id)
            return ack

        return _reply(msg, handle)

    @app.query("abort")
    def abort(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            notice = expect(msg.content, AbortNotice)
            site.abort(notice, run_id=msg.metadata.run_id)
            sums.forget(notice.release_id)
            return notice

        return _reply(msg, handle)


def _add_input_handlers(app: ClientApp, sums: SiteSums) -> None:
    """The graph nonce and the masked inputs (the protocol: :mod:`client.secure_sum`)."""

    @app.query("sum_keys")
    def sum_keys(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            request = expect(msg.content, SumKeysRequest)
            _no_reference(msg)
            return sums.keys(request, run_id=msg.metadata.run_id)

        return _reply(msg, handle)

    @app.query("sum_shares")
    def sum_shares(msg: Message, context: Context) -> Message:
        def handle() -> tuple[MaskedInput, Int64Array]:
            request = expect(msg.content, SumSharesRequest)
            _no_reference(msg)
            return sums.shares(request, run_id=msg.metadata.run_id)

        return _masked_reply(msg, handle)

    @app.query("sum_collect")
    def sum_collect(msg: Message, context: Context) -> Message:
        def handle() -> tuple[MaskedInput, Int64Array]:
            request = expect(msg.content, SumCollectRequest)
            return sums.collect(request, _reference(msg), run_id=msg.metadata.run_id)

        return _masked_reply(msg, handle)


def _add_unmask_handlers(app: ClientApp, sums: SiteSums) -> None:
    """The survivor signatures and the unmask (the protocol: :mod:`client.secure_sum`)."""

    @app.query("sum_survivors")
    def sum_survivors(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            request = expect(msg.content, SurvivorsRequest)
            return sums.survivors(request, run_id=msg.metadata.run_id)

        return _reply(msg, handle)

    @app.query("sum_unmask")
    def sum_unmask(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            request = expect(msg.content, UnmaskRequest)
            return sums.unmask(request, run_id=msg.metadata.run_id)

        return _reply(msg, handle)


def _reference(msg: Message) -> Float64Array | None:
    """The noisy vector a release-first select sum carries, if any (float64, no pickles)."""
    return _array_beside(msg, REFERENCE_ARRAY_KEY)


def _array_beside(msg: Message, key: str) -> Float64Array | None:
    """The one float64 vector under ``key`` beside the message, if any (no pickles).

    Raises:
        MessageDecodeError: Any other array rides beside the message.
    """
    if key not in msg.content.array_records:
        _no_reference(msg)
        return None
    if set(msg.content.array_records) != {key}:
        raise MessageDecodeError(
            f"a request may carry only the array {key!r}, got {sorted(msg.content.array_records)}."
        )
    values = array_from_record(msg.content, key, dtype="float64")
    return np.asarray(values, dtype=np.float64)


def _no_reference(msg: Message) -> None:
    if msg.content.array_records:
        raise MessageDecodeError(
            f"this request must carry no arrays, got {sorted(msg.content.array_records)}."
        )


def _masked_reply(msg: Message, handle: Callable[[], tuple[MaskedInput, Int64Array]]) -> Message:
    """Run a collect handler; its masked vector travels beside the message."""
    try:
        answer, masked = handle()
    except Exception as exc:
        return _reply(msg, _raise(exc))
    content = with_array(message_to_record(answer), MASKED_ARRAY_KEY, masked)
    return Message(content, reply_to=msg)


def _raise(exc: Exception) -> Callable[[], WireMessage]:
    def handle() -> WireMessage:
        raise exc

    return handle


def _reply(msg: Message, handle: Callable[[], WireMessage]) -> Message:
    """Run a handler; failures travel back as an ErrorReply with a fixed reason."""
    try:
        answer = handle()
    except DpmtvError as exc:  # a typed refusal; its text stays here
        _log.warning("%s refused: %s", msg.metadata.message_type, exc)
        answer = ErrorReply.from_exception(exc)
    except Exception as exc:  # a bug or an I/O failure
        _log.exception("%s failed", msg.metadata.message_type)
        answer = ErrorReply.from_exception(exc)
    return Message(message_to_record(answer), reply_to=msg)


def error_message(msg: Message, exc: BaseException) -> Message:
    """A Flower error reply for ``msg`` that carries the code and class, never the text."""
    reply = ErrorReply.from_exception(exc)
    reason = f"{reply.code.value}: {reply.error_type}: {reply.reason}"
    return Message(Error(FlowerErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)

"""The site's Flower ``ClientApp``: wiring only; the logic lives in :class:`client.site.Site`.

Message types (the coordinator's ``server.app`` sends them in this order):

* ``query.plan`` — a ``PlanRequest``; replies ``PlanAccept`` or ``ErrorReply``.
* ``train`` — a SecAgg+ round (``secaggplus_mod`` owns it); the FitIns config carries a
  ``SecureSumRequest``; the reply is the site's masked contribution.
* ``query.noisy_vector`` — release-first order: the noisy all-head vector to score against.
* ``query.release`` — the signed artifact; replies ``ReleaseAck``.
* ``query.abort`` — the release stops; the site refunds or commits its reservation.

Run state that must survive between messages (the plan and the secret chunk seed) is kept in
``context.state``, which stays on the SuperNode and never reaches the coordinator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from client.secagg import install_secure_mask_prg, secaggplus_clipping_range, secure_sum_reply
from client.settings import SiteSettings
from client.site import Site
from dpmtv_common.errors import ConfigError, DpmtvError
from dpmtv_common.rng import secret_seed
from protocol import (
    AbortNotice,
    ErrorReply,
    NoisyVectorBroadcast,
    PlanRequest,
    ReleasePlan,
    ReleaseRequest,
    WireMessage,
    arrays_from_record,
    arrays_to_record,
    expect,
    message_arrays_from_record,
    message_to_record,
    secure_sum_request_from_config,
)

__all__ = ["app"]

_log = logging.getLogger(__name__)
_STATE = "dpmtv-site"
_REFERENCE = "dpmtv-reference"

install_secure_mask_prg()  # masks from ChaCha20, as the coordinator's (checked per round)
app = ClientApp()


def _site(context: Context) -> Site:
    return Site(SiteSettings.from_node_config(dict(context.node_config)))


def _reply(msg: Message, handle: Callable[[], WireMessage]) -> Message:
    """Run a handler; typed failures travel back as an ErrorReply, never as a pickle."""
    try:
        answer = handle()
    except DpmtvError as exc:  # a typed refusal: its message is meant for the coordinator
        _log.warning("%s refused: %s", msg.metadata.message_type, exc)
        answer = ErrorReply.from_exception(exc)
    except Exception as exc:  # a bug or an I/O failure: details stay in the site's log
        _log.exception("%s failed", msg.metadata.message_type)
        answer = ErrorReply.from_exception(exc)
    return Message(message_to_record(answer), reply_to=msg)


def _plan_of(context: Context) -> tuple[ReleasePlan, int]:
    state = context.state.config_records.get(_STATE)
    if state is None:
        raise ConfigError("no accepted plan in this run: the plan stage must come first.")
    return ReleasePlan.model_validate_json(str(state["plan"])), int(str(state["chunk-seed"]), 16)


@app.query("plan")
def plan(msg: Message, context: Context) -> Message:
    """Check the plan and reserve its cost; remember the plan and a secret chunk seed."""

    def handle() -> WireMessage:
        request = expect(msg.content, PlanRequest)
        accept = _site(context).accept_plan(request.plan)
        state = ConfigRecord()
        state.update({"plan": request.plan.model_dump_json(), "chunk-seed": f"{secret_seed():x}"})
        context.state.config_records[_STATE] = state
        return accept

    return _reply(msg, handle)


@app.train(mods=[secaggplus_mod])
def contribute(msg: Message, context: Context) -> Message:
    """One secure sum: this site's clipped sum (or votes) and chunk count, to be masked."""
    request = secure_sum_request_from_config(msg.content.config_records["fitins.config"])
    release_plan, seed = _plan_of(context)
    reference = None
    if request.stage == "select" and _REFERENCE in context.state.array_records:
        reference = arrays_from_record(context.state.array_records[_REFERENCE])["values"]
    arrays = _site(context).contribution(release_plan, request, seed=seed, reference=reference)
    return secure_sum_reply(msg, arrays, clipping_range=secaggplus_clipping_range(context))


@app.query("noisy_vector")
def noisy_vector(msg: Message, context: Context) -> Message:
    """Keep the released noisy all-head vector to score heads against (release-first)."""

    def handle() -> WireMessage:
        notice = expect(msg.content, NoisyVectorBroadcast)
        values = message_arrays_from_record(msg.content)["values"]
        context.state.array_records[_REFERENCE] = arrays_to_record({"values": values})
        return notice

    return _reply(msg, handle)


@app.query("release")
def release(msg: Message, context: Context) -> Message:
    """Verify, store and acknowledge the signed artifact; commit the site ledger."""
    return _reply(msg, lambda: _site(context).finish(expect(msg.content, ReleaseRequest)))


@app.query("abort")
def abort(msg: Message, context: Context) -> Message:
    """Refund (no noisy output yet) or commit (noise drawn) this release's reservation."""

    def handle() -> WireMessage:
        notice = expect(msg.content, AbortNotice)
        _site(context).abort(notice)
        return notice

    return _reply(msg, handle)

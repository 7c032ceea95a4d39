"""The site's real Flower handlers, run inside the site service (never in the relay).

Message types (the coordinator's ``server.app`` sends them in this order):

* ``query.plan`` — a ``PlanRequest``; replies ``PlanAccept`` or ``ErrorReply``. The
  coordinator folds the plan into the first secure sum's SecAgg+ setup instead
  (:func:`plan_at_setup_mod`); the query remains for tools that check a plan alone.
* ``train`` — a SecAgg+ round: :func:`secagg_policy_mod` checks the coordinator's SecAgg+
  parameters against the site's policy, then Flower's ``secaggplus_mod`` runs the protocol
  with the service's own state; at collect, :func:`contribute` hands it the site's arrays and
  the mod masks them here, so a relay only ever carries masked integers. In release-first
  order the select round's request names the noisy all-head vector's heads and carries its
  rows beside the config; the site keeps that exact vector before it votes against it.
* ``query.release`` — the signed artifact; replies ``ReleaseAck``.
* ``query.abort`` — the release stops; the site resolves it from its own record.

Every failure becomes data: an ``ErrorReply`` with a code and a fixed reason (queries) or a
Flower ``Error`` with a fixed reason (SecAgg+ rounds). Exception text stays in the site log.

Every refusal of a collect message happens before the site marks its release exposed: what
Flower's ``secaggplus_mod`` would only check after the handler ran (the neighbours' shares
decrypt and are addressed to this site, enough of them to unmask) and what
:func:`client.secagg.secure_sum_reply` would only check after the sum was computed (the mask
PRG, a clipping range wide enough for the plan) are checked first, from public values only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode as FlowerErrorCode
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

from client.secagg import (
    FITINS_CONFIG,
    SecAggRanges,
    carried_arrays,
    install_secure_mask_prg,
    mask_prg_in_use,
    secaggplus_ranges,
    secure_sum_reply,
    sent_reference,
)
from client.settings import SiteSettings
from client.site import Site
from dpmtv_common.crypto import mask_prg
from dpmtv_common.errors import ConfigError, DpmtvError, PolicyError
from dpmtv_common.heads import HeadSet
from protocol import (
    MESSAGE_RECORD_KEY,
    AbortNotice,
    ErrorReply,
    NoiseMode,
    PlanMismatchError,
    PlanRequest,
    ReleaseRequest,
    SecureSumRequest,
    StageOrderError,
    WireMessage,
    expect,
    message_to_record,
    secure_sum_request_from_config,
)

__all__ = [
    "build_site_app",
    "error_message",
    "plan_at_setup_mod",
    "secagg_policy_mod",
]

_log = logging.getLogger(__name__)


def build_site_app(site: Site) -> ClientApp:
    """The ClientApp whose handlers decide for ``site``; the service calls it per message."""
    install_secure_mask_prg()  # masks from ChaCha20, as the coordinator's (checked per round)
    app = ClientApp()

    @app.query("plan")
    def plan(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            request = expect(msg.content, PlanRequest)
            return site.accept_plan(request.plan, run_id=msg.metadata.run_id)

        return _reply(msg, handle)

    @app.train(mods=[secagg_policy_mod(site.settings), plan_at_setup_mod(site), secaggplus_mod])
    def contribute(msg: Message, context: Context) -> Message:
        request = secure_sum_request_from_config(msg.content.config_records[FITINS_CONFIG])
        run_id = msg.metadata.run_id
        if request.reference_heads is not None:  # release-first: keep the vector, then vote
            values = sent_reference(msg)
            site.store_reference(
                request.release_id, HeadSet(request.reference_heads), values, run_id=run_id
            )
        elif carried_arrays(msg):
            raise PlanMismatchError("a secure sum request must not carry arrays it does not name.")
        ranges = secaggplus_ranges(context)
        _check_before_exposure(msg, site, request, ranges)
        arrays = site.contribution(request, run_id=run_id, ranges=ranges)
        return secure_sum_reply(msg, arrays, clipping_range=ranges.clipping_range)

    @app.query("release")
    def release(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            request = expect(msg.content, ReleaseRequest)
            return site.finish(request, run_id=msg.metadata.run_id)

        return _reply(msg, handle)

    @app.query("abort")
    def abort(msg: Message, context: Context) -> Message:
        def handle() -> WireMessage:
            notice = expect(msg.content, AbortNotice)
            site.abort(notice, run_id=msg.metadata.run_id)
            return notice

        return _reply(msg, handle)

    return app


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


def _check_before_exposure(
    msg: Message, site: Site, request: SecureSumRequest, ranges: SecAggRanges
) -> None:
    """Refuse, before the ledger is marked exposed, what the reply would be refused for.

    The clipping range must hold every coordinate the plan allows this site: m_i chunks of
    per-layer norm at most C (activations) or 1 (votes), and the count m_i itself. Checked
    from the plan and m_i (public), never from the computed sum: a refusal that depended on
    the data would tell the coordinator something about it.

    Raises:
        ConfigError: The coordinator announced another mask PRG than this site runs.
        PlanMismatchError: The clipping range is too small for the plan.
    """
    config = msg.content.config_records.get(FITINS_CONFIG, ConfigRecord())
    announced, ours = config.get(mask_prg.MASK_PRG_CONFIG_KEY), mask_prg_in_use()
    if announced != ours:
        raise ConfigError(
            f"the coordinator's mask PRG must match this site's {ours!r}, got {announced!r}."
        )
    record = site.records.require(request.release_id)
    plan = record.plan
    per_chunk = 1.0 if plan.noise_mode is NoiseMode.DISTRIBUTED else max(plan.clip_norm, 1.0)
    needed = record.num_chunks * per_chunk  # distributed: its grid is checked exactly later
    if not ranges.clipping_range >= needed:
        raise PlanMismatchError(
            f"SecAgg+ clipping_range must be at least m_i * max(C, 1) = {needed} for this "
            f"site's sum, got {ranges.clipping_range}."
        )


def plan_at_setup_mod(site: Site) -> Callable[[Message, Context, ClientAppCallable], Message]:
    """A mod that accepts a release plan riding on a SecAgg+ setup message, then sets up.

    The coordinator folds the plan into the first secure sum's setup message (one round trip
    fewer). The site checks and reserves the plan exactly as for a ``query.plan`` message,
    *before* SecAgg+ generates its keys; a refused plan ends the message with an error, so
    the site takes no part in the sum. The reply carries SecAgg+'s public keys and, beside
    them, the site's ``PlanAccept``. Nothing of the site's data is sent at setup.
    """

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        configs = msg.content.config_records
        stage = configs.get(RECORD_KEY_CONFIGS, ConfigRecord()).get(Key.STAGE)
        if stage != Stage.SETUP or MESSAGE_RECORD_KEY not in configs:
            return call_next(msg, context)
        request = expect(msg.content, PlanRequest)
        accept = site.accept_plan(request.plan, run_id=msg.metadata.run_id)
        reply = call_next(msg, context)
        if reply.has_error():  # reserved, nothing sent: the site's sweep refunds it
            return reply
        content = RecordDict(dict(reply.content.items()))
        content[MESSAGE_RECORD_KEY] = message_to_record(accept)[MESSAGE_RECORD_KEY]
        return Message(content, reply_to=msg)

    return mod


def secagg_policy_mod(
    settings: SiteSettings,
) -> Callable[[Message, Context, ClientAppCallable], Message]:
    """A mod that refuses SecAgg+ parameters weaker than the site's policy.

    At ``setup``: at least ``settings.min_sites`` sites in the sum, and a reconstruction
    threshold above ``secagg_min_threshold_fraction`` of the neighbourhood (so fewer
    colluding neighbours cannot rebuild this site's mask secrets). At ``unmask``: no node may
    be both active and dropped (asking for both shares of one node would unmask it). At
    ``collect_masked_vectors``: the neighbours' shares must be enough to unmask, decrypt and
    be addressed to this site, as ``secaggplus_mod`` checks only after the handler ran (after
    the site's contribution was counted).
    """

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS, ConfigRecord())
        stage = configs.get(Key.STAGE)
        if stage == Stage.SETUP:
            _check_setup(configs, settings)
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            _check_collect(configs, context)
        elif stage == Stage.UNMASK:
            _check_unmask(configs)
        return call_next(msg, context)

    return mod


def _check_setup(configs: ConfigRecord, settings: SiteSettings) -> None:
    sample, shares, threshold = (
        _int(configs.get(key)) for key in (Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD)
    )
    if sample < settings.min_sites:
        raise PolicyError(
            f"secure sum must include at least this site's minimum of {settings.min_sites} "
            f"sites, got {sample}."
        )
    needed = int(shares * settings.secagg_min_threshold_fraction) + 1
    if threshold < max(needed, 2) or threshold > shares:
        raise PolicyError(
            f"SecAgg+ reconstruction threshold must lie in [{max(needed, 2)}, {shares}] for a "
            f"neighbourhood of {shares}, got {threshold}."
        )


def _check_collect(configs: ConfigRecord, context: Context) -> None:
    stored = context.state.config_records.get(RECORD_KEY_STATE)
    if stored is None or stored.get("current_stage") != Stage.SHARE_KEYS:
        raise StageOrderError("SecAgg+ collect must follow this site's share_keys stage.")
    state = SecAggPlusState(**stored)
    ciphertexts = configs.get(Key.CIPHERTEXT_LIST)
    sources = _ints(configs.get(Key.SOURCE_LIST))
    if not isinstance(ciphertexts, list) or len(ciphertexts) != len(sources):
        raise PolicyError(
            f"SecAgg+ collect must pair each share with its source, got {len(sources)} sources."
        )
    if len(ciphertexts) + 1 < state.threshold:
        raise PolicyError(
            f"SecAgg+ collect must bring at least threshold - 1 = {state.threshold - 1} "
            f"neighbours' shares, got {len(ciphertexts)}."
        )
    for source, ciphertext in zip(sources, ciphertexts, strict=True):
        key = state.ss2_dict.get(source)
        if key is None or not isinstance(ciphertext, bytes):
            raise PolicyError(f"SecAgg+ share source must be a neighbour, got node {source}.")
        try:
            sender, receiver, _, _ = share_keys_plaintext_separate(decrypt(key, ciphertext))
        except Exception as exc:  # any failure to decrypt or parse is a forged share
            raise PolicyError(f"SecAgg+ share from node {source} must decrypt, got junk.") from exc
        if sender != source or receiver != state.nid:
            raise PolicyError(
                f"SecAgg+ share must go from node {source} to this node, got {sender} -> "
                f"{receiver}."
            )


def _check_unmask(configs: ConfigRecord) -> None:
    active = set(_ints(configs.get(Key.ACTIVE_NODE_ID_LIST)))
    dead = set(_ints(configs.get(Key.DEAD_NODE_ID_LIST)))
    if active & dead:
        raise PolicyError(
            f"SecAgg+ unmask lists must be disjoint, got {len(active & dead)} node(s) in both."
        )


def _int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise PolicyError(f"SecAgg+ setup value must be an int, got {type(value).__name__}.")


def _ints(value: object) -> list[int]:
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise PolicyError(f"SecAgg+ node list must hold ints, got {type(value).__name__}.")

"""How a site's release record and its privacy ledger entry must stand beside each other.

A site keeps two state machines for each release: its own record
(:class:`~client.release.record.SiteReleaseState`) and the privacy ledger's entry
(:class:`~dpmtv_common.privacy.ledger.ReleaseState`). The site writes them in a fixed order
(the ledger first when data is about to leave, the ledger first when a release is settled),
so after every completed step the pair is one of the rows below. "Sent" means the record
names at least one secure sum whose masked contribution left the site.

Pairs that may stand beside each other (:data:`BESIDE`)::

    record        sent   ledger                  left by
    ───────────   ────   ─────────────────────   ──────────────────────────────────────
    planned       no     reserved                accepting a plan
    contributed   yes    exposed                 a contribution (ledger marked first)
    released      yes    committed               a stored artifact after a contribution
    released      no     aborted                 a stored artifact, nothing sent
    aborted       yes    committed               an abort or sweep after a contribution
    aborted       no     aborted, committed      an abort or sweep, nothing sent

An aborted record with nothing sent may stand beside ``committed``: when the ledger was
already exposed or committed (a stop between the two writes of a step) the release stays
counted. Counting more than was spent costs budget; refunding what left costs privacy.

How the ledger is settled when a record becomes released or aborted (:data:`SETTLEMENT`)::

    ledger      sent   ledger action            the release
    ─────────   ────   ──────────────────────   ─────────────────────────────────────
    reserved    no     abort (refund)           refunded: nothing of the site's data left
    reserved    yes    commit                   counted (out of step: fail closed)
    exposed     any    commit                   counted: masked data may have left
    committed   any    none                     counted (settled before a stop)
    aborted     no     none                     refunded (settled before a stop)
    aborted     yes    refused (LedgerError)    data left but the ledger refunded it
    (missing)   any    refused (LedgerError)    the ledger does not know the release

For settling, a record counts as sent if it names a secure sum *or* says ``contributed``:
if the record contradicts itself, the budget counts. Only the single consistent pair
(planned, nothing sent, reserved) is ever refunded.

A record opened for a further step (a secure sum, a noisy vector, an artifact) must stand
beside its ledger entry as the table says; any other pair is refused with a
:class:`~dpmtv_common.errors.LedgerError` and left for the settlement above.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from client.release.record import ReleaseRecord, SiteReleaseState
from dpmtv_common.errors import LedgerError
from dpmtv_common.privacy.ledger import ReleaseState

__all__ = [
    "BESIDE",
    "SETTLEMENT",
    "Settlement",
    "anything_sent",
    "in_step",
    "require_in_step",
    "settlement",
]

_PLANNED = SiteReleaseState.PLANNED
_CONTRIBUTED = SiteReleaseState.CONTRIBUTED
_RELEASED = SiteReleaseState.RELEASED
_ABORTED = SiteReleaseState.ABORTED
_RESERVED = ReleaseState.RESERVED
_EXPOSED = ReleaseState.EXPOSED
_COMMITTED = ReleaseState.COMMITTED
_REFUNDED = ReleaseState.ABORTED


class Settlement(StrEnum):
    """What the ledger does when a record becomes released or aborted."""

    COMMIT = "commit"
    REFUND = "refund"
    KEEP_COUNTED = "keep counted"
    KEEP_REFUNDED = "keep refunded"

    @property
    def counts(self) -> bool:
        """Whether the release stays counted against the site's budget."""
        return self in (Settlement.COMMIT, Settlement.KEEP_COUNTED)


BESIDE: Final[Mapping[tuple[SiteReleaseState, bool], frozenset[ReleaseState]]] = MappingProxyType(
    {
        (_PLANNED, False): frozenset({_RESERVED}),
        (_CONTRIBUTED, True): frozenset({_EXPOSED}),
        (_RELEASED, True): frozenset({_COMMITTED}),
        (_RELEASED, False): frozenset({_REFUNDED}),
        (_ABORTED, True): frozenset({_COMMITTED}),
        (_ABORTED, False): frozenset({_REFUNDED, _COMMITTED}),
    }
)
"""(record state, anything sent) -> the ledger states that may stand beside it."""

SETTLEMENT: Final[Mapping[tuple[ReleaseState, bool], Settlement]] = MappingProxyType(
    {
        (_RESERVED, False): Settlement.REFUND,
        # The record names a sent sum only after the ledger is exposed, so this pair means
        # the two went out of step: the data may have left, so the release counts.
        (_RESERVED, True): Settlement.COMMIT,
        # Exposed is written before anything is handed over: whatever the record says, the
        # masked contribution may have left.
        (_EXPOSED, False): Settlement.COMMIT,
        (_EXPOSED, True): Settlement.COMMIT,
        (_COMMITTED, False): Settlement.KEEP_COUNTED,
        (_COMMITTED, True): Settlement.KEEP_COUNTED,
        (_REFUNDED, False): Settlement.KEEP_REFUNDED,
        # (aborted, sent) has no row: a refund cannot be undone, so it is refused.
    }
)
"""(ledger state, anything sent) -> what the ledger does when the record is finished."""


def anything_sent(record: ReleaseRecord) -> bool:
    """Whether any of the site's data may have left, reading the record fail-closed."""
    return bool(record.sent) or record.state is _CONTRIBUTED


def in_step(record: ReleaseRecord, ledger_state: ReleaseState | None) -> bool:
    """Whether ``record`` and its ledger state form a pair of :data:`BESIDE`."""
    # The key is the record's own view (its list of sent sums), so a record whose state and
    # list disagree (e.g. contributed with nothing sent) matches no row.
    allowed = BESIDE.get((record.state, bool(record.sent)), frozenset())
    return ledger_state in allowed


def require_in_step(record: ReleaseRecord, ledger_state: ReleaseState | None, action: str) -> None:
    """Refuse ``action`` on a record that does not stand beside its ledger as the table says.

    Raises:
        LedgerError: The pair is not in :data:`BESIDE`; the message names both sides.
    """
    if in_step(record, ledger_state):
        return
    raise LedgerError(
        f"{action} for release {record.release_id!r} needs its record and ledger in step: "
        f"record {_describe(record)} must stand beside ledger state {_expected(record)}, "
        f"got {_name(ledger_state)}. Refused before anything is computed; an abort or sweep "
        "settles it, counted unless nothing of the site's data can have left."
    )


def settlement(record: ReleaseRecord, ledger_state: ReleaseState | None) -> Settlement:
    """What the ledger does as ``record`` is finished, by :data:`SETTLEMENT`.

    Raises:
        LedgerError: The ledger lacks the release, or refunded a release whose data left.
    """
    sent = anything_sent(record)
    rule = None if ledger_state is None else SETTLEMENT.get((ledger_state, sent))
    if rule is None:
        raise LedgerError(
            f"release {record.release_id!r} cannot be settled: record {_describe(record)} "
            f"stands beside ledger state {_name(ledger_state)}, which the site cannot count. "
            "The record is left open; the site admin must resolve the ledger entry."
        )
    return rule


def _describe(record: ReleaseRecord) -> str:
    sent = f"sent {list(record.sent)}" if record.sent else "nothing sent"
    return f"{record.state.value!r} ({sent})"


def _expected(record: ReleaseRecord) -> str:
    allowed = BESIDE.get((record.state, bool(record.sent)))
    if allowed is None:
        return "none (no row of the table has this record state with this list of sums)"
    return " or ".join(repr(state.value) for state in sorted(allowed))


def _name(state: ReleaseState | None) -> str:
    return "none (no ledger entry)" if state is None else repr(state.value)

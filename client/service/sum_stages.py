"""The site service's handlers of a release's secure sums, one method a message.

:class:`SiteSums` joins a :class:`~client.release.site.Site` (plan, ledger, data) and the
release's :class:`~client.secure_sum.session.SiteSumSession` (keys, seeds, protocol state).
Its order within each message is the site's rule: everything that can be refused from
public values (the stage order, the advertisements, the ranges against the plan) is
checked *before* the site computes and marks its release exposed; only then is the input
computed, quantised and masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from client.release.site import Site
from client.secure_sum.session import SiteSumSession
from client.settings import SiteSettings
from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import ConfigError, PolicyError
from dpmtv_common.heads import HeadSet
from dpmtv_common.roster import Roster
from protocol import NoiseMode, PlanAccept, PlanMismatchError, ReleasePlan, StageOrderError
from protocol.secure_sum import (
    MaskedInput,
    NonceReveal,
    SumCollectRequest,
    SumInstructions,
    SumKeysRequest,
    SumSharesRequest,
    SurvivorsRequest,
    SurvivorsSigned,
    UnmaskReply,
    UnmaskRequest,
    planned_sum_count,
)

__all__ = ["SiteSums", "load_membership"]


def load_membership(settings: SiteSettings) -> tuple[Roster, SigningKey] | None:
    """The site's roster and identity key, checked against each other; None if neither is set.

    Raises:
        ConfigError: Only one of them is set, a file does not load, ``name`` is not a member,
            or the identity key is not the roster's key for ``name``.
    """
    if settings.roster is None and settings.identity_key is None:
        return None
    if settings.roster is None or settings.identity_key is None:
        raise ConfigError("--roster and --identity-key go together: set both, or neither.")
    roster, identity = Roster.load(settings.roster), SigningKey.load(settings.identity_key)
    expected = roster.members.get(settings.name)
    if expected is None:
        raise ConfigError(
            f"--name must be a member of the roster {roster.fingerprint[:16]}, got "
            f"{settings.name!r}; members: {sorted(roster.members)}."
        )
    if expected != identity.verify_key:
        raise ConfigError(
            f"--identity-key must be the roster's key for {settings.name!r} (key "
            f"{expected.key_id}), got key {identity.key_id}."
        )
    return roster, identity


@dataclass
class SiteSums:
    """A site's secure-sum sessions, by release (memory only)."""

    site: Site
    sessions: dict[str, SiteSumSession] = field(default_factory=dict)

    def accept(
        self,
        plan: ReleasePlan,
        *,
        node_id: int,
        run_id: int,
        centre: Float64Array | None = None,
    ) -> PlanAccept:
        """Accept the plan (``Site.accept_plan``) and advertise this release's signed key.

        The roster and identity key are loaded first: a site that cannot take part in a
        secure sum refuses before anything is reserved. ``centre`` is the flat public centre
        that rode beside a centred plan.
        """
        roster, identity = self._membership()
        accept = self.site.accept_plan(plan, run_id=run_id, centre=centre)
        session = SiteSumSession(
            release_id=plan.release_id,
            node_id=node_id,
            member=self.site.settings.name,
            roster=roster,
            identity=identity,
            num_sums=planned_sum_count(plan),
            required_sites=self._required_sites(plan),
            min_threshold_fraction=self.site.settings.secagg_min_threshold_fraction,
            graph_minimum=plan.min_sites,
        )
        self.sessions[plan.release_id] = session
        return accept.model_copy(update={"keys": session.advertise()})

    def keys(self, request: SumKeysRequest, *, run_id: int) -> NonceReveal:
        """Check every advertisement, count the graph draw, reveal this site's nonce.

        The draw is recorded durably (and refused past the site's policy) before the nonce
        leaves: a coordinator that aborts to re-draw the graph spends the site's draws.
        """
        session = self._session(request.release_id)
        session.join(list(request.adverts))
        session.require_revealable()  # a complete graph or a second reveal: refused uncounted
        self.site.note_graph_draw(request.release_id, run_id=run_id)
        return session.reveal_nonce()

    def shares(self, request: SumSharesRequest, *, run_id: int) -> tuple[MaskedInput, Int64Array]:
        """Draw the graph, share the seeds, and mask the first sum's input."""
        session = self._session(request.release_id)
        session.draw_graph(list(request.adverts), list(request.nonces))
        session.begin_sum(request.instructions.sum_index)
        boxes = session.seal_shares()
        masked = self._masked_input(session, request.instructions, None, run_id)
        answer = MaskedInput(release_id=request.release_id, sum_index=session.current, boxes=boxes)
        return answer, masked

    def collect(
        self, request: SumCollectRequest, reference: Float64Array | None, *, run_id: int
    ) -> tuple[MaskedInput, Int64Array]:
        """Mask a later sum's input (its participants: the previous sum's survivors)."""
        session = self._session(request.release_id)
        session.begin_sum(request.instructions.sum_index)
        masked = self._masked_input(session, request.instructions, reference, run_id)
        answer = MaskedInput(release_id=request.release_id, sum_index=session.current, boxes=[])
        return answer, masked

    def survivors(self, request: SurvivorsRequest, *, run_id: int) -> SurvivorsSigned:
        """Sign the sum's survivor set (once a sum; the service renews the run if accepted)."""
        return self._session(request.release_id).sign_survivors(request)

    def unmask(self, request: UnmaskRequest, *, run_id: int) -> UnmaskReply:
        """Reveal shares and pair seeds for a survivor set every survivor signed."""
        return self._session(request.release_id).reveal(request)

    def forget(self, release_id: str) -> None:
        """Drop a finished or aborted release's keys and seeds."""
        self.sessions.pop(release_id, None)

    def forget_resolved(self) -> list[str]:
        """Drop the sessions of releases the site no longer has open (e.g. swept as idle).

        A release resolved by the site's own sweep gets no ``release`` or ``abort`` message,
        so without this its private key and seeds would stay in memory until the service
        stops. Returns the releases dropped.
        """
        still_open = {record.release_id for record in self.site.records.open_records()}
        dropped = [release_id for release_id in self.sessions if release_id not in still_open]
        for release_id in dropped:
            del self.sessions[release_id]
        return dropped

    # ------------------------------------------------------------------ helpers

    def _masked_input(
        self,
        session: SiteSumSession,
        instructions: SumInstructions,
        reference: Float64Array | None,
        run_id: int,
    ) -> Int64Array:
        request, ranges = instructions.request, instructions.ranges
        if request.release_id != session.release_id:  # else another release's data, this sum
            raise PlanMismatchError(
                f"a secure sum of release {session.release_id!r} must ask for that release's "
                f"contribution, got instructions for {request.release_id!r}."
            )
        record = self.site.records.require(request.release_id)
        if request.reference_heads is not None:
            if reference is None:
                raise PlanMismatchError("a request naming reference heads must carry the vector.")
            shape = (record.num_layers, record.num_heads, record.head_dim)
            if reference.size != record.num_layers * record.num_heads * record.head_dim:
                raise PlanMismatchError(
                    f"the noisy vector must hold L*H*D values for {shape}, got {reference.size}."
                )
            self.site.store_reference(
                request.release_id,
                HeadSet(request.reference_heads),
                reference.reshape(shape),
                run_id=run_id,
            )
        elif reference is not None:
            raise PlanMismatchError("a secure sum request must not carry arrays it does not name.")
        _check_range_fits(record.num_chunks, record.plan, ranges.clipping_range)
        ranges.check_no_wrap(len(session.participants))
        arrays = self.site.contribution(request, run_id=run_id, ranges=ranges)
        vector = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
        return session.mask(vector, ranges)

    def _session(self, release_id: str) -> SiteSumSession:
        session = self.sessions.get(release_id)
        if session is None:
            raise StageOrderError(
                f"release {release_id!r} has no secure-sum keys at this site (not accepted "
                "here, or accepted by an earlier run of this service)."
            )
        return session

    def _membership(self) -> tuple[Roster, SigningKey]:
        membership = load_membership(self.site.settings)
        if membership is None:
            raise PolicyError(
                "a site takes part in secure sums only with a consortium roster and its "
                "identity key: set --roster and --identity-key (docs/deployment.md)."
            )
        return membership

    def _required_sites(self, plan: ReleasePlan) -> int:
        required = max(plan.min_sites, self.site.settings.min_sites)
        if plan.noise_mode is NoiseMode.DISTRIBUTED:
            required = max(required, plan.min_honest)
        return required


def _check_range_fits(num_chunks: int, plan: ReleasePlan, clipping_range: float) -> None:
    """Refuse, before exposure, a range too small for what the plan lets this site send.

    m_i chunks of per-layer norm at most C (activations) or 1 (votes), and the count m_i
    itself; checked from public values only, never from the computed sum (a refusal that
    depended on the data would tell the coordinator something about it). Distributed
    plans' grids are checked exactly by ``client.release.policy.distributed_grid``.
    """
    per_chunk = 1.0 if plan.noise_mode is NoiseMode.DISTRIBUTED else max(plan.clip_norm, 1.0)
    needed = num_chunks * per_chunk
    if not clipping_range >= needed:
        raise PlanMismatchError(
            f"the sum's clipping range must be at least m_i * max(C, 1) = {needed} for this "
            f"site's sum, got {clipping_range}."
        )

"""A site's side of a release's secure sums, stage by stage (``protocol.secure_sum``).

One :class:`SiteSumSession` lives in the site service's memory from the plan to the last
unmask (a restarted service has lost its keys and seeds, and resolves the release instead).
Its methods run in protocol order and each refuses what it cannot check:

1. :meth:`SiteSumSession.advertise` — a fresh X25519 key for this release and a commitment
   to a fresh graph nonce, signed with the site's roster identity.
2. :meth:`~SiteSumSession.join` — every advertisement: signed by a distinct member of the
   site's own roster, for this release and roster, this site's own unchanged; at least the
   site's minimum of them. The graph's shape (degree, t, ĉ) follows from their number.
3. :meth:`~SiteSumSession.reveal_nonce` — for a sparse graph only, once a release, and only
   after step 2 fixed every advertisement: this site's nonce.
4. :meth:`~SiteSumSession.draw_graph` — the same advertisements again and every nonce, each
   matching its commitment: the graph (``protocol.sum_graph``), the neighbours, the keys.
5. :meth:`~SiteSumSession.seal_shares` — a fresh self-mask seed per planned sum, Shamir-shared
   with the neighbours, each share sealed for its receiver.
6. :meth:`~SiteSumSession.mask` — the quantised input plus every mask of the sum.
7. :meth:`~SiteSumSession.sign_survivors` — the boxes addressed to this site open; U is a
   subset of the sum's participants holding this site, a majority of them (so one U a sum
   can be fully signed), at least the site's minimum, and with r surviving neighbours (so
   whatever can be unmasked with this site's input holds its minimum of honest inputs);
   one U signed per sum.
8. :meth:`~SiteSumSession.reveal` — every member of U signed that very U: shares of the
   survivors' seeds, pair seeds of the neighbours that dropped out.

Refusals raise :class:`~dpmtv_common.errors.PolicyError` or
:class:`~protocol.StageOrderError` and reveal nothing. The checks of the advertisements and
nonces are pure functions (:mod:`client.secure_sum.agreement`); this file keeps the state
machine whole, one method a stage in protocol order, so it reads top to bottom (over 400
lines for that reason).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from client.secure_sum.agreement import check_shape, checked_nonces, verified_members
from dpmtv_common.aliases import Int64Array
from dpmtv_common.crypto import SigningKey, mask_prg, shamir
from dpmtv_common.crypto import key_agreement as ka
from dpmtv_common.errors import IntegrityError, PolicyError
from dpmtv_common.roster import Roster
from protocol import StageOrderError
from protocol.secure_sum import (
    AddressedBox,
    NodeBytes,
    NonceReveal,
    SumRanges,
    SurvivorsRequest,
    SurvivorsSigned,
    UnmaskReply,
    UnmaskRequest,
    key_transcript,
    quantise,
    survivors_signed_bytes,
)
from protocol.sum_graph import GraphShape, SumGraph, build_graph, graph_seed, graph_shape
from protocol.sum_keys import NONCE_BYTES, KeyAdvert, advert_signed_bytes, nonce_commitment

__all__ = ["SiteSumSession"]

_SEED_BYTES = 32


@dataclass
class _Agreement:
    """What the advertisements fixed: who takes part, their keys, the graph's shape."""

    transcript: bytes
    members: dict[int, str]
    adverts: dict[int, KeyAdvert]
    shape: GraphShape


@dataclass
class _Drawn:
    """What the graph fixed: this site's neighbours and its keys with each of them."""

    graph: SumGraph
    neighbours: tuple[int, ...]
    box_keys: dict[int, bytes]
    pair_secrets: dict[int, bytes]

    @property
    def threshold(self) -> int:
        """t: shares (the owner's counted) that rebuild a self-mask seed."""
        return self.graph.shape.threshold


@dataclass
class SiteSumSession:
    """This site's keys, seeds and progress through one release's secure sums.

    Attributes:
        release_id: The release.
        node_id: This site's node id in the run (from the message envelope).
        member: This site's roster name.
        roster: The roster the site admin installed.
        identity: This member's roster identity key.
        num_sums: Secure sums the accepted plan runs.
        required_sites: The fewest honest sites the site allows in anything that can be
            unmasked with its input (its own minimum, the plan's, ``min_honest``).
        min_threshold_fraction: t must exceed this fraction of the neighbourhood.
        graph_minimum: The plan's ``min_sites``, which sizes the graph (every site computes
            the same one); None: ``required_sites``.
    """

    release_id: str
    node_id: int
    member: str
    roster: Roster
    identity: SigningKey
    num_sums: int
    required_sites: int
    min_threshold_fraction: float
    graph_minimum: int | None = None
    key: ka.AgreementKey = field(default_factory=ka.AgreementKey.generate)
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE_BYTES))
    agreement: _Agreement | None = None
    drawn: _Drawn | None = None
    revealed: bool = False
    seeds: list[bytes] = field(default_factory=list)
    own_shares: list[bytes] = field(default_factory=list)
    held: dict[int, list[bytes]] = field(default_factory=dict)
    participants: tuple[int, ...] = ()
    current: int = -1
    step: str = "open"  # in the current sum: open -> masked -> signed -> revealed
    signed: tuple[int, ...] | None = None

    def advertise(self) -> KeyAdvert:
        """This release's public key, signed by this member (stage 1)."""
        if self.roster.identity(self.member) != self.identity.verify_key:
            raise PolicyError(
                f"this site's identity key must be the roster's key for {self.member!r}, got "
                f"key {self.identity.key_id}: install the right key or roster."
            )
        fields = {
            "member": self.member,
            "node_id": self.node_id,
            "release_id": self.release_id,
            "roster_sha256": self.roster.fingerprint,
            "public_key": self.key.public_bytes,
            "nonce_commitment": self._commitment(),
        }
        signature = self.identity.sign(advert_signed_bytes(**fields))  # type: ignore[arg-type]
        return KeyAdvert(**fields, signature=signature)  # type: ignore[arg-type]

    def join(self, adverts: list[KeyAdvert]) -> None:
        """Check every advertisement and fix the graph's shape (stage 2).

        Raises:
            StageOrderError: Called twice.
            PolicyError: An advertisement is not this release's, not this roster's, not a
                distinct member's, does not verify; this site's own is missing or altered;
                fewer participants than the site requires; a threshold below policy, or a
                graph that cannot give this site its minimum.
        """
        if self.agreement is not None:
            raise StageOrderError("the key advertisements must arrive once a release.")
        members = verified_members(adverts, release_id=self.release_id, roster=self.roster)
        mine = [a for a in adverts if a.node_id == self.node_id]
        if len(mine) != 1 or mine[0] != self.advertise():
            raise PolicyError("the advertisements must hold this site's own, unchanged.")
        self._require_enough(len(members), "the secure sum's participants")
        minimum = self.graph_minimum if self.graph_minimum is not None else self.required_sites
        shape = graph_shape(len(members), minimum=minimum)
        check_shape(
            shape,
            min_threshold_fraction=self.min_threshold_fraction,
            required_sites=self.required_sites,
        )
        self.agreement = _Agreement(
            transcript=key_transcript(adverts),
            members=members,
            adverts={advert.node_id: advert for advert in adverts},
            shape=shape,
        )
        self.participants = tuple(sorted(members))

    def reveal_nonce(self) -> NonceReveal:
        """This site's graph nonce, once, after every advertisement is fixed (stage 3).

        Raises:
            StageOrderError: As :meth:`require_revealable`.
        """
        self.require_revealable()
        self.revealed = True
        return NonceReveal(release_id=self.release_id, nonce=self.nonce)

    def require_revealable(self) -> None:
        """Refuse a reveal now: before :meth:`join`, a second time, or for a complete graph.

        Raises:
            StageOrderError: As above (a complete graph needs no randomness).
        """
        agreement = self._agreement()
        if agreement.shape.complete:
            raise StageOrderError(f"a complete graph of {agreement.shape.sites} needs no nonce.")
        if self.revealed or self.drawn is not None:
            raise StageOrderError("a site reveals its graph nonce once a release.")

    def draw_graph(self, adverts: list[KeyAdvert], nonces: list[NodeBytes]) -> None:
        """Draw the graph from the advertisements this site checked and every nonce (stage 4).

        A complete graph joins here (no nonce round); a sparse one needs this site's nonce
        revealed for exactly these advertisements, and every participant's nonce, each the
        one its advertisement committed to.

        Raises:
            StageOrderError: Drawn already, or a sparse graph before this site revealed.
            PolicyError: Other advertisements than those this site revealed for, a nonce
                missing, extra or not matching its commitment, or nonces for a complete graph.
        """
        if self.drawn is not None:
            raise StageOrderError("the graph must be drawn once a release.")
        if self.agreement is None:
            self.join(adverts)
        agreement = self._agreement()
        if key_transcript(adverts) != agreement.transcript:
            raise PolicyError(
                "the secure sum's advertisements must be those this site checked, got others."
            )
        seed = None
        if agreement.shape.complete:
            if nonces:
                raise PolicyError("a complete graph takes no nonces, got some.")
        else:
            if not self.revealed:
                raise StageOrderError("a sparse graph needs this site's nonce revealed first.")
            checked = checked_nonces(
                nonces,
                adverts=agreement.adverts,
                release_id=self.release_id,
                own=(self.node_id, self.nonce),
            )
            seed = graph_seed(agreement.transcript, checked)
        graph = build_graph(self.participants, agreement.shape, seed)
        near = graph.of(self.node_id)
        publics = {node: agreement.adverts[node].public_key for node in near}
        secrets = {node: self.key.shared_secret(publics[node]) for node in near}
        self.drawn = _Drawn(
            graph=graph,
            neighbours=near,
            box_keys={
                node: ka.share_box_key(secret, release_id=self.release_id)
                for node, secret in secrets.items()
            },
            pair_secrets=secrets,
        )

    def seal_shares(self) -> list[AddressedBox]:
        """Fresh self-mask seeds, one per sum, shared with the neighbours (stage 3)."""
        agreement = self._drawn()
        if self.seeds:
            raise StageOrderError("the self-mask seeds must be shared once a release.")
        holders = sorted((*agreement.neighbours, self.node_id))
        self.seeds = [_fresh_seed() for _ in range(self.num_sums)]
        per_seed = [
            shamir.create_shares(seed, agreement.threshold, len(holders)) for seed in self.seeds
        ]
        boxes: list[AddressedBox] = []
        for index, holder in enumerate(holders):
            shares = [shares_of_seed[index] for shares_of_seed in per_seed]
            if holder == self.node_id:
                self.own_shares = shares
                continue
            plaintext = _pack(shares)
            box = ka.seal_box(
                agreement.box_keys[holder],
                plaintext,
                associated=self._box_context(self.node_id, holder),
            )
            boxes.append(AddressedBox(node_id=holder, box=box))
        return boxes

    def begin_sum(self, sum_index: int) -> None:
        """Enter sum ``sum_index``: the next one, after the previous one's unmask.

        Raises:
            StageOrderError: Out of order, or more sums than the plan has.
        """
        previous_done = self.current < 0 or self.step == "revealed"
        if sum_index != self.current + 1 or sum_index >= self.num_sums or not previous_done:
            raise StageOrderError(
                f"secure sum {sum_index} must come next, got it after sum {self.current} of "
                f"{self.num_sums} (previous one unmasked: {previous_done})."
            )
        self._require_enough(len(self.participants), f"secure sum {sum_index}'s participants")
        self.current, self.step, self.signed = sum_index, "open", None

    def mask(self, vector: np.ndarray, ranges: SumRanges) -> Int64Array:
        """The current sum's masked input: quantised vector + self mask ± pair masks (mod M).

        Raises:
            ConfigError: A coordinate lies beyond ±c (refused, never clipped).
            PolicyError: The grid could wrap for this sum's participants.
        """
        agreement = self._drawn()
        if self.step != "open" or self.current < 0 or not self.seeds:
            raise StageOrderError("a secure sum's input must be masked once, after sharing.")
        try:
            ranges.check_no_wrap(len(self.participants))
        except Exception as exc:
            raise PolicyError(str(exc)) from exc
        modulus, size = ranges.modulus_range, int(np.asarray(vector).size)
        total = quantise(vector, ranges)
        total = (total + _expand(self.seeds[self.current], modulus, size)) % modulus
        for node in agreement.neighbours:
            if node not in self.participants:
                continue
            pair = self._pair_mask(node, modulus, size)
            total = (total + pair if self.node_id < node else total - pair) % modulus
        self.step = "masked"
        return total

    def sign_survivors(self, request: SurvivorsRequest) -> SurvivorsSigned:
        """Sign U once for the current sum, after the boxes addressed here open (stage 5).

        Raises:
            PolicyError: U is not a subset of the sum's participants holding this site, is
                no majority of them, is smaller than the site's minimum, leaves fewer than r
                surviving neighbours, or a box does not open (forged, replayed, from a
                non-neighbour); another U was signed for this sum already.
        """
        agreement = self._drawn()
        if request.sum_index != self.current or self.step not in ("masked", "signed"):
            raise StageOrderError(f"survivors must follow this site's input to sum {self.current}.")
        survivors = tuple(sorted(set(request.survivors)))
        if self.signed is not None and self.signed != survivors:
            raise PolicyError("a site signs one survivor set a sum, got a second, different one.")
        self._check_survivors(survivors, agreement)
        if request.sum_index == 0:
            self._open_boxes(request.boxes, survivors, agreement)
        elif request.boxes:
            raise PolicyError("share boxes travel with the first sum only, got more later.")
        self.signed, self.step = survivors, "signed"
        return SurvivorsSigned(
            release_id=self.release_id,
            sum_index=self.current,
            signature=self.identity.sign(self._statement(survivors)),
        )

    def reveal(self, request: UnmaskRequest) -> UnmaskReply:
        """Shares and pair seeds for the signed U, once all of U signed it (stage 6).

        Raises:
            PolicyError: U differs from the one this site signed, or a member of U has no
                valid roster signature over it.
        """
        agreement = self._drawn()
        survivors = tuple(sorted(set(request.survivors)))
        if request.sum_index != self.current or self.step != "signed" or self.signed is None:
            raise StageOrderError(f"unmask must follow the survivors of sum {self.current}.")
        if survivors != self.signed:
            raise PolicyError("unmask must name the survivor set this site signed, got another.")
        self._check_signatures(request.signatures, survivors, agreement)
        owners = [node for node in (*agreement.neighbours, self.node_id) if node in survivors]
        shares = [NodeBytes(node_id=owner, value=self._share_of(owner)) for owner in sorted(owners)]
        dropped = [
            node
            for node in agreement.neighbours
            if node in self.participants and node not in survivors
        ]
        seeds = [NodeBytes(node_id=node, value=self._pair_seed(node)) for node in dropped]
        self.participants, self.step = survivors, "revealed"
        return UnmaskReply(
            release_id=self.release_id,
            sum_index=self.current,
            seed_shares=shares,
            pair_seeds=seeds,
        )

    # ------------------------------------------------------------------ checks

    def _check_survivors(self, survivors: tuple[int, ...], agreement: _Drawn) -> None:
        if self.node_id not in survivors or not set(survivors) <= set(self.participants):
            raise PolicyError(
                "survivors must be participants of this sum, this site among them, got others."
            )
        self._require_enough(len(survivors), f"secure sum {self.current}'s survivors")
        # Two fully signed survivor sets of one sum would tell sites different dropouts;
        # each honest site signs one U, so only one majority of the participants can be.
        if 2 * len(survivors) <= len(self.participants):
            raise PolicyError(
                f"survivors must be a majority of the sum's {len(self.participants)} "
                f"participants (one survivor set a sum), got {len(survivors)}."
            )
        # The input can only be unmasked together with every surviving neighbour whose pair
        # mask stays hidden: r of them leave the site's minimum of honest ones even if the
        # graph's bound of colluders sits among them (protocol.sum_graph).
        alive = [node for node in agreement.neighbours if node in survivors]
        need = agreement.graph.shape.required_neighbours(self.required_sites)
        if len(alive) < need:
            raise PolicyError(
                f"a site needs r = {need} surviving neighbours to take part in an unmask "
                f"(its minimum of {self.required_sites} honest sites with up to "
                f"{agreement.graph.shape.colluding_neighbours} colluding), got {len(alive)}."
            )

    def _open_boxes(
        self, boxes: list[AddressedBox], survivors: tuple[int, ...], agreement: _Drawn
    ) -> None:
        expected = {node for node in agreement.neighbours if node in survivors}
        senders = [box.node_id for box in boxes]
        if len(set(senders)) != len(senders) or set(senders) != expected:
            raise PolicyError(
                f"share boxes must come once from each surviving neighbour ({len(expected)}), "
                f"got {len(senders)} from others or twice."
            )
        for box in boxes:
            try:
                plaintext = ka.open_box(
                    agreement.box_keys[box.node_id],
                    box.box,
                    associated=self._box_context(box.node_id, self.node_id),
                )
                shares = _unpack(plaintext, self.num_sums)
            except IntegrityError as exc:
                raise PolicyError(
                    f"the share box from node {box.node_id} must open: {exc}"
                ) from exc
            self.held[box.node_id] = shares

    def _check_signatures(
        self, signatures: list[NodeBytes], survivors: tuple[int, ...], agreement: _Drawn
    ) -> None:
        by_node = {entry.node_id: entry.value for entry in signatures}
        if len(by_node) != len(signatures) or set(by_node) != set(survivors):
            raise PolicyError(
                f"unmask needs one signature from every survivor ({len(survivors)}), got "
                f"{len(signatures)} from {len(by_node)} nodes."
            )
        statement = self._statement(survivors)
        members = self._agreement().members
        for node, signature in by_node.items():
            self.roster.verify(members[node], statement, signature)

    def _require_enough(self, count: int, what: str) -> None:
        if count < self.required_sites:
            raise PolicyError(
                f"{what} must number at least this site's minimum of {self.required_sites} "
                f"roster members, got {count}."
            )

    # ------------------------------------------------------------------ secrets

    def _agreement(self) -> _Agreement:
        if self.agreement is None:
            raise StageOrderError("the key advertisements must arrive before any sum.")
        return self.agreement

    def _drawn(self) -> _Drawn:
        if self.drawn is None:
            raise StageOrderError("the graph must be drawn before any sum.")
        return self.drawn

    def _commitment(self) -> bytes:
        return nonce_commitment(
            release_id=self.release_id, member=self.member, node_id=self.node_id, nonce=self.nonce
        )

    def _statement(self, survivors: tuple[int, ...]) -> bytes:
        return survivors_signed_bytes(
            release_id=self.release_id,
            sum_index=self.current,
            transcript=self._agreement().transcript,
            survivors=survivors,
        )

    def _share_of(self, owner: int) -> bytes:
        shares = self.own_shares if owner == self.node_id else self.held.get(owner)
        if shares is None:
            raise PolicyError(f"this site holds no share of node {owner}'s seed.")
        return shares[self.current]

    def _pair_seed(self, node: int) -> bytes:
        return ka.pair_mask_seed(
            self._drawn().pair_secrets[node],
            release_id=self.release_id,
            sum_index=self.current,
            nodes=(self.node_id, node),
        )

    def _pair_mask(self, node: int, modulus: int, size: int) -> Int64Array:
        return _expand(self._pair_seed(node), modulus, size)

    def _box_context(self, sender: int, receiver: int) -> bytes:
        return b"|".join(
            (self.release_id.encode(), sender.to_bytes(8, "big"), receiver.to_bytes(8, "big"))
        )


def _fresh_seed() -> bytes:
    """A one-time self-mask seed from the OS CSPRNG."""
    return os.urandom(_SEED_BYTES)


def _expand(seed: bytes, modulus: int, size: int) -> Int64Array:
    return mask_prg.expand_mask(seed, modulus, [(size,)])[0]


def _pack(shares: list[bytes]) -> bytes:
    return b"".join(len(share).to_bytes(2, "big") + share for share in shares)


def _unpack(plaintext: bytes, count: int) -> list[bytes]:
    shares, offset = [], 0
    for _ in range(count):
        size = int.from_bytes(plaintext[offset : offset + 2], "big")
        share = plaintext[offset + 2 : offset + 2 + size]
        if size == 0 or len(share) != size:
            raise IntegrityError("a share box must hold one share per sum, got fewer bytes.")
        shares.append(share)
        offset += 2 + size
    if offset != len(plaintext):
        raise IntegrityError("a share box must hold one share per sum, got extra bytes.")
    return shares

"""What a site checks of a release's key agreement before it joins it: pure functions.

:class:`~client.secure_sum.session.SiteSumSession` calls them with what it received: every
advertisement must be a distinct roster member's, for this release and roster; the graph the
plan's size gives must leave the site its minimum; and every revealed nonce must be the one
its advertisement committed to (``protocol.sum_keys.nonce_commitment``), this site's own
unchanged. Each refusal is a :class:`~dpmtv_common.errors.PolicyError` that says what was
expected and what came.
"""

from __future__ import annotations

from collections.abc import Mapping

from dpmtv_common.errors import PolicyError
from dpmtv_common.roster import Roster
from protocol.secure_sum import NodeBytes
from protocol.sum_graph import GraphShape
from protocol.sum_keys import KeyAdvert, nonce_commitment

__all__ = ["check_shape", "checked_nonces", "verified_members"]


def verified_members(
    adverts: list[KeyAdvert], *, release_id: str, roster: Roster
) -> dict[int, str]:
    """Node id -> member of every advertisement, each signed by a distinct roster member.

    Raises:
        PolicyError: Another release's or roster's advert, a bad signature, a member or node
            twice.
    """
    members: dict[int, str] = {}
    for advert in adverts:
        if advert.release_id != release_id:
            raise PolicyError("an advertisement must be for this release, got another.")
        if advert.roster_sha256 != roster.fingerprint:
            raise PolicyError(
                f"every participant must hold this site's roster {roster.fingerprint}, "
                f"got {advert.roster_sha256} from {advert.member!r}: install one roster."
            )
        roster.verify(advert.member, advert.signed_bytes(), advert.signature)
        if advert.node_id in members or advert.member in members.values():
            raise PolicyError(
                f"participants must be distinct roster members on distinct nodes, got "
                f"{advert.member!r} (node {advert.node_id}) twice."
            )
        members[advert.node_id] = advert.member
    return members


def check_shape(shape: GraphShape, *, min_threshold_fraction: float, required_sites: int) -> None:
    """Refuse a graph whose threshold is below the site's policy or that cannot leave it r.

    Raises:
        PolicyError: t at most ``min_threshold_fraction`` of the neighbourhood, or r (for the
            site's own minimum) above the degree.
    """
    size = shape.degree + 1
    if shape.threshold <= int(size * min_threshold_fraction) or shape.threshold > size:
        raise PolicyError(
            f"the reconstruction threshold must exceed {min_threshold_fraction} of "
            f"the neighbourhood of {size}, got {shape.threshold}."
        )
    need = shape.required_neighbours(required_sites)
    if need > shape.degree:
        raise PolicyError(
            f"a secure sum of {shape.sites} sites must leave this site r = {need} "
            f"neighbours (its minimum of {required_sites} honest sites with "
            f"{shape.colluding_neighbours} colluding), got a graph of degree {shape.degree}."
        )


def checked_nonces(
    nonces: list[NodeBytes],
    *,
    adverts: Mapping[int, KeyAdvert],
    release_id: str,
    own: tuple[int, bytes],
) -> dict[int, bytes]:
    """Node id -> nonce, one per advertised participant, each matching its commitment.

    ``own`` is this site's (node id, nonce): the coordinator may not replace it.

    Raises:
        PolicyError: A nonce missing, extra, twice, or not the committed one.
    """
    by_node = {entry.node_id: entry.value for entry in nonces}
    if len(by_node) != len(nonces) or set(by_node) != set(adverts):
        raise PolicyError(
            f"the graph needs one nonce from every participant ({len(adverts)}), "
            f"got {len(nonces)} from {len(by_node)} nodes."
        )
    for node, nonce in by_node.items():
        advert = adverts[node]
        found = nonce_commitment(
            release_id=release_id, member=advert.member, node_id=node, nonce=nonce
        )
        if found != advert.nonce_commitment or (node == own[0] and nonce != own[1]):
            raise PolicyError(
                f"node {node}'s graph nonce must match its advertised commitment, got another."
            )
    return by_node

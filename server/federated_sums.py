"""The coordinator's :class:`protocol.ReleaseSums`: secure sums over the sites.

Every site returns ``[flattened sum, [m_i]]`` (concatenated, quantised and masked); the
secure sum gives the coordinator only the totals over the surviving sites, including the
public chunk count m = Σ m_i. A site lost in one secure sum is left out of the later ones;
fewer survivors than the plan's minimum raise ``InsufficientSharesError`` and the release
aborts. All sums of a release share one key agreement (``server.secure_sum``).

In distributed noise mode each site's sum is already its encoded noisy share on an integer
grid (:mod:`protocol.distributed`): the sum's ranges are the plan's (the sites refuse
others), and the total is decoded here; the coordinator never holds an un-noised sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dpmtv_common.aliases import Float64Array, LayerHead
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.distributed import DistributedNoise, decode_noisy_sum
from protocol import (
    ActivationSum,
    DistributedRelease,
    NoiseMode,
    ReleasePlan,
    SecureSumRequest,
    VoteSum,
    gaussian_heads,
)
from protocol.secure_sum import SumInstructions, SumRanges, ranges_for
from protocol.sum_keys import KeyAdvert
from server.messaging import Exchange
from server.secure_sum import SecureSumSession

__all__ = ["FederatedSums"]


@dataclass
class FederatedSums:
    """Secure sums over the sites that accepted the plan.

    Attributes:
        exchange: The coordinator's messages to the sites.
        plan: The release plan.
        sites: node id -> m_i, of the sites still in the release.
        adverts: node id -> the signed key it sent with its acceptance.
        head_dim: D of the consortium's model.
        layout: the consortium model's head layout; its carried heads (``all_heads``) are
            the scope of ``heads=None``, its dense ``L * H`` the vote histogram's length.
    """

    exchange: Exchange
    plan: ReleasePlan
    sites: dict[int, int]
    adverts: dict[int, KeyAdvert]
    head_dim: int
    layout: HeadLayout
    rounds: int = 0
    log: list[str] = field(default_factory=list)
    session: SecureSumSession | None = None

    @property
    def all_heads(self) -> HeadSet:
        """Every head the model carries (headless layers of a hybrid left out)."""
        return self.layout.all_heads()

    @property
    def distributed(self) -> DistributedRelease | None:
        """The plan's grids in distributed noise mode, else None."""
        if self.plan.noise_mode is not NoiseMode.DISTRIBUTED:
            return None
        return DistributedRelease(self.plan, self.layout.dense_size, self.head_dim)

    def _ranges(self, grid: DistributedNoise | None) -> SumRanges:
        if grid is not None:  # the plan's integer grid: sites refuse any other
            return SumRanges(
                clipping_range=float(grid.clipping_range),
                quantization_range=grid.quantization_range,
                modulus_range=grid.modulus_range,
            )
        # A site's sum of m_i clipped chunks reaches m_i * C per coordinate; votes and the
        # count reach m_i. The range covers both, so no coordinate is ever refused.
        m_max = max(self.sites.values())
        return ranges_for(float(m_max) * max(self.plan.clip_norm, 1.0), len(self.adverts))

    def _secure_sum(
        self,
        request: SecureSumRequest,
        grid: DistributedNoise | None,
        length: int,
        reference: Float64Array | None = None,
    ) -> tuple[list[Float64Array], int, int]:
        if self.session is None:
            self.session = SecureSumSession(
                self.exchange, self.plan.release_id, dict(self.adverts), self.plan.min_sites
            )
        instructions = SumInstructions(
            sum_index=self.rounds, request=request, ranges=self._ranges(grid)
        )
        self.rounds += 1
        result = self.session.run_sum(instructions, reference, length=length)
        self.sites = {node: self.sites[node] for node in result.survivors}
        self.log.append(f"{request.stage}: {len(result.survivors)} sites")
        count = round(float(result.total[-1]))
        total = result.total[:-1]
        if grid is not None:  # the sum of the sites' noisy shares, back to real units
            total = decode_noisy_sum(total, params=grid, num_sites=len(result.survivors))
        return [total, result.total[-1:]], count, len(result.survivors)

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        """Σ over surviving sites of their clipped activation sums over ``heads``."""
        request = SecureSumRequest(
            release_id=self.plan.release_id,
            stage="extract",
            heads=None if heads == self.all_heads else heads.heads,
            clip_norm=self.plan.clip_norm,
            score_top_r=None,
        )
        release = self.distributed
        grid = release.activations(heads) if release is not None else None
        arrays, count, num_sites = self._secure_sum(request, grid, len(heads) * self.head_dim + 1)
        total = np.asarray(arrays[0], dtype=np.float64).reshape(len(heads), self.head_dim)
        return ActivationSum(heads, total, count, num_sites)

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        """Σ over surviving sites of top-r votes (against ``reference`` when given).

        The noisy ``reference`` (dense ``(L, H, D)``: the rows of the plan's Gaussian heads,
        zeros elsewhere) travels beside the select sum's collect request (flattened float64),
        not in a message of its own: one round trip fewer, and a site votes only against the
        vector it holds.
        """
        request = SecureSumRequest(
            release_id=self.plan.release_id,
            stage="select",
            heads=None,
            clip_norm=self.plan.clip_norm,
            score_top_r=self.plan.score_top_r,
            reference_heads=self._reference_heads() if reference is not None else None,
        )
        release = self.distributed
        grid = release.votes() if release is not None else None
        sent = None if reference is None else np.asarray(reference, dtype=np.float64).ravel()
        arrays, count, _ = self._secure_sum(request, grid, self.layout.dense_size + 1, sent)
        return VoteSum(np.asarray(arrays[0], dtype=np.float64), count)

    def _reference_heads(self) -> tuple[LayerHead, ...]:
        """The heads whose noisy rows the reference holds: the plan's Gaussian heads."""
        heads = gaussian_heads(self.plan, self.layout)
        return (heads or self.all_heads).heads

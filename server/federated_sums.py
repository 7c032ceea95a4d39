"""The coordinator's :class:`protocol.ReleaseSums`: SecAgg+ secure sums over the sites.

Every site returns ``[flattened sum, [m_i]]``; the secure sum gives the coordinator only the
totals over the surviving sites, including the public chunk count m = Σ m_i. A site lost in
one secure sum is left out of the later ones; fewer survivors than the plan's minimum raise
``InsufficientSharesError`` and the release aborts.

In distributed noise mode each site's sum is already its encoded noisy share on an integer
grid (:mod:`protocol.distributed`): the SecAgg+ ranges are the plan's (the sites refuse
others), and the total is decoded here; the coordinator never holds an un-noised sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid

from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import InsufficientSharesError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.distributed import DistributedNoise, decode_noisy_sum
from protocol import (
    ActivationSum,
    DistributedRelease,
    NoiseMode,
    ReleasePlan,
    SecureSumRequest,
    VoteSum,
    secure_sum_request_to_config,
)
from server.secagg import (
    SecureSumRound,
    SecureSumSettings,
    install_secure_mask_prg,
    secure_sum,
)
from server.secagg_neighbourhood import neighbourhood

__all__ = ["FederatedSums", "neighbourhood"]


@dataclass
class FederatedSums:
    """Secure sums over the sites that accepted the plan.

    Attributes:
        sites: node id -> m_i, of the sites still in the release.
        head_dim: D of the consortium's model.
        layout: the consortium model's head layout; its carried heads (``all_heads``) are
            the scope of ``heads=None``, its dense ``L * H`` the vote histogram's length.
        pending: The release's first secure sum, already set up with the plan riding on it
            (``server.plan_at_setup``); the first sum asked for finishes it.
    """

    grid: Grid
    context: Context
    plan: ReleasePlan
    sites: dict[int, int]
    head_dim: int
    layout: HeadLayout
    stage_timeout: float
    rounds: int = 0
    log: list[str] = field(default_factory=list)
    pending: SecureSumRound | None = None

    def __post_init__(self) -> None:
        install_secure_mask_prg()  # idempotent; the sites refuse any other mask expansion

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

    def _settings(self, grid: DistributedNoise | None) -> SecureSumSettings:
        shares, threshold = neighbourhood(len(self.sites))
        if grid is not None:  # the plan's integer grid: sites refuse any other
            return SecureSumSettings(
                clipping_range=grid.clipping_range,
                quantization_range=grid.quantization_range,
                modulus_range=grid.modulus_range,
                timeout=self.stage_timeout,
                max_sites=grid.max_sites,
                num_shares=shares,
                reconstruction_threshold=threshold,
            )
        # A site's sum of m_i clipped chunks reaches m_i * C per coordinate; votes and the
        # count reach m_i. The range covers both, so SecAgg+ never clips silently.
        m_max = max(self.sites.values())
        return SecureSumSettings.for_plan(
            max_abs_coordinate=float(m_max) * max(self.plan.clip_norm, 1.0),
            max_sites=len(self.sites),
            timeout=self.stage_timeout,
            num_shares=shares,
            reconstruction_threshold=threshold,
        )

    def _secure_sum(
        self,
        request: SecureSumRequest,
        grid: DistributedNoise | None,
        broadcast: tuple[Float64Array, ...] = (),
    ) -> tuple[list[Float64Array], int, int]:
        self.rounds += 1
        config = secure_sum_request_to_config(request)
        if self.pending is not None:  # set up with the plan (central mode only): finish it
            opened, self.pending = self.pending, None
            result = opened.finish(config, broadcast)
        else:
            result = secure_sum(
                self.grid,
                self.context,
                sorted(self.sites),
                config,
                round_id=self.rounds,
                settings=self._settings(grid),
                min_sites=self.plan.min_sites,
                broadcast=broadcast,
            )
        if result is None:
            raise InsufficientSharesError(
                f"secure sum {self.rounds} ({request.stage}) produced no result: too few sites "
                "stayed to rebuild the masks. The release is aborted."
            )
        self.sites = {node: self.sites[node] for node in result.site_ids}
        self.log.append(f"{request.stage}: {result.num_sites} sites")
        count = round(float(result.arrays[1][0]))
        total = result.arrays[0]
        if grid is not None:  # the sum of the sites' noisy shares, back to real units
            total = decode_noisy_sum(total, params=grid, num_sites=result.num_sites)
        return [total, *result.arrays[1:]], count, result.num_sites

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
        arrays, count, num_sites = self._secure_sum(request, grid)
        total = np.asarray(arrays[0], dtype=np.float64).reshape(len(heads), self.head_dim)
        return ActivationSum(heads, total, count, num_sites)

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        """Σ over surviving sites of top-r votes (against ``reference`` when given).

        The noisy all-head ``reference`` travels in the select request itself (the FitIns
        parameters of SecAgg+'s collect stage), not in a message of its own: one round
        trip fewer, and a site votes only against the vector it holds.
        """
        request = SecureSumRequest(
            release_id=self.plan.release_id,
            stage="select",
            heads=None,
            clip_norm=self.plan.clip_norm,
            score_top_r=self.plan.score_top_r,
            reference_heads=self.all_heads.heads if reference is not None else None,
        )
        release = self.distributed
        grid = release.votes() if release is not None else None
        sent = () if reference is None else (np.asarray(reference, dtype=np.float64),)
        arrays, count, _ = self._secure_sum(request, grid, sent)
        return VoteSum(np.asarray(arrays[0], dtype=np.float64), count)

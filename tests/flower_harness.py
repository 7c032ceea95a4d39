"""Test helpers around the in-process grid (``server.simulation``).

``LoopbackGrid`` is the product's ``InProcessGrid`` under the name the tests grew up with;
:func:`flower_process_state` restores what tests change process-wide.

Secure sums without a model: :class:`StandInSite` answers what
``client.secure_sum.SiteSums`` asks of a ``client.release.site.Site`` (settings, the plan, the
record, the contribution) with a vector the test chooses, so the site's real handlers
(``client.service.handlers.build_site_app``), its real ``SiteSums`` and ``SiteSumSession``,
and the coordinator's real ``server.secure_sum.SecureSumSession`` run over the grid on
inputs whose exact sum the test knows. :func:`stand_in_sites` gives them one roster and an
identity key each; :func:`advertised_keys` runs the plan message and returns the signed keys.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from dpmtv_common.centre import ActivationCentre
from dpmtv_common.crypto import SigningKey
from dpmtv_common.heads import HeadSet
from dpmtv_common.roster import Roster
from protocol import KeyAdvert, PlanAccept, PlanRequest, ReleasePlan, SecureSumRequest, SumRanges
from server.messaging import Exchange
from server.simulation import (
    FIRST_NODE_ID,
    InProcessGrid,
    make_server_context,
    set_task_identity,
)

if TYPE_CHECKING:
    from client.release.site import Site

LoopbackGrid = InProcessGrid

__all__ = [
    "FIRST_NODE_ID",
    "Contribute",
    "LoopbackGrid",
    "StandInSite",
    "advertised_keys",
    "flower_process_state",
    "make_server_context",
    "set_task_identity",
    "stand_in_apps",
    "stand_in_sites",
]

Contribute = Callable[[int, SecureSumRequest], list[np.ndarray]]
"""A stand-in site's input to a secure sum: (site index, request) -> arrays."""

STAND_IN_SHAPE = (2, 4, 16)  # L, H, D reported at the plan (used only with a noisy vector)


@contextmanager
def flower_process_state() -> Iterator[None]:
    """Restore what tests change process-wide: the task identity ``Message(...)`` reads."""
    identity = {name: vars(TaskIdentity)[name] for name in _IDENTITY_FIELDS}
    try:
        yield
    finally:
        for name, value in identity.items():
            setattr(TaskIdentity, name, value)


_IDENTITY_FIELDS = ("_run_id", "_node_id", "_task_id")


@dataclass(frozen=True)
class StandInSettings:
    """The site settings ``SiteSums`` reads (``client.settings.SiteSettings`` fields)."""

    name: str
    roster: Path | None
    identity_key: Path | None
    min_sites: int = 2
    min_honest: int = 2
    secagg_min_threshold_fraction: float = 0.5


@dataclass(frozen=True)
class StandInRecord:
    """The release record fields ``SiteSums`` reads (``client.release.record``)."""

    plan: ReleasePlan
    num_chunks: int
    num_layers: int = STAND_IN_SHAPE[0]
    num_heads: int = STAND_IN_SHAPE[1]
    head_dim: int = STAND_IN_SHAPE[2]

    @property
    def release_id(self) -> str:
        """The release the record is of."""
        return self.plan.release_id


@dataclass
class StandInRecords:
    """A site's records by release (``client.release.record.ReleaseRecordStore``)."""

    by_release: dict[str, StandInRecord] = field(default_factory=dict)

    def require(self, release_id: str) -> StandInRecord:
        """The record of an accepted release."""
        return self.by_release[release_id]

    def open_records(self) -> list[StandInRecord]:
        """Every record not yet resolved (a resolved one is removed from ``by_release``)."""
        return list(self.by_release.values())


@dataclass
class StandInSite:
    """A site for secure sums only: it accepts any plan and sends a set vector.

    Attributes:
        index: The site's place in the grid (node ``FIRST_NODE_ID + index``).
        settings: Its name, roster and identity key, and its minimum of sites.
        contribute: Its input to each secure sum.
        num_chunks: m_i, reported at the plan (sizes the central range check).
        requests: Every secure sum it contributed to, in order.
        references: The noisy vector a release-first select sum carried, by release.
    """

    index: int
    settings: StandInSettings
    contribute: Contribute
    num_chunks: int = 1
    records: StandInRecords = field(default_factory=StandInRecords)
    requests: list[SecureSumRequest] = field(default_factory=list)
    references: dict[str, np.ndarray] = field(default_factory=dict)
    graph_draws: list[str] = field(default_factory=list)

    def accept_plan(
        self, plan: ReleasePlan, *, run_id: int, centre: ActivationCentre | None = None
    ) -> PlanAccept:
        """Accept ``plan`` (no policy, no ledger, no centre check) and report m_i."""
        self.records.by_release[plan.release_id] = StandInRecord(plan, self.num_chunks)
        num_layers, num_heads, head_dim = STAND_IN_SHAPE
        return PlanAccept(
            release_id=plan.release_id,
            site_name=self.settings.name,
            num_chunks=self.num_chunks,
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            prompt_template_sha256="0" * 64,
            instruction_sha256="0" * 64,
            dpmtv_version="0.1.0",
        )

    def contribution(
        self, request: SecureSumRequest, *, run_id: int, ranges: SumRanges | None = None
    ) -> list[np.ndarray]:
        """The test's input to this sum."""
        self.requests.append(request)
        return self.contribute(self.index, request)

    def store_reference(
        self, release_id: str, heads: HeadSet, values: np.ndarray, *, run_id: int
    ) -> None:
        """Keep the noisy vector a select sum carried."""
        self.references[release_id] = np.array(values)

    def touch(self, run_id: int) -> None:
        """Nothing to note: a stand-in has no idle releases."""

    def note_graph_draw(self, release_id: str, *, run_id: int) -> None:
        """Count the draw (a stand-in has no draw limit; ``client.release.site.Site`` has one)."""
        self.graph_draws.append(release_id)


def stand_in_sites(
    folder: Path,
    num_sites: int,
    contribute: Contribute,
    *,
    num_chunks: Sequence[int] | None = None,
    min_sites: int = 2,
) -> list[StandInSite]:
    """``num_sites`` stand-ins named ``site-<i>``, one roster naming them all, a key each."""
    names = [f"site-{index}" for index in range(num_sites)]
    keys = {name: SigningKey.generate() for name in names}
    roster = folder / "roster.toml"
    roster.write_text(Roster("stand-in", {n: k.verify_key for n, k in keys.items()}).to_toml())
    chunks = list(num_chunks) if num_chunks is not None else [1] * num_sites
    return [
        StandInSite(
            index=index,
            settings=StandInSettings(
                name=name,
                roster=roster,
                identity_key=keys[name].save(folder / f"{name}.identity.key"),
                min_sites=min_sites,
            ),
            contribute=contribute,
            num_chunks=chunks[index],
        )
        for index, name in enumerate(names)
    ]


def stand_in_apps(sites: Sequence[StandInSite]) -> list[ClientApp]:
    """The site service's real ClientApp for each stand-in (give them to the grid in order)."""
    # Imported here: the site service loads torch, which tests of the grid alone do not need.
    from client.service.handlers import build_site_app
    from client.service.sum_stages import SiteSums

    return [build_site_app(cast("Site", site), SiteSums(cast("Site", site))) for site in sites]


def advertised_keys(grid: InProcessGrid, plan: ReleasePlan) -> dict[int, KeyAdvert]:
    """Send the plan to every node; the signed keys that came back with an acceptance."""
    replies = Exchange(grid, timeout=60.0).broadcast(
        "plan", PlanRequest(plan=plan), grid.get_node_ids(), PlanAccept, f"{plan.release_id}-plan"
    )
    return {
        node: answer.keys
        for node, answer in replies.answers.items()
        if isinstance(answer, PlanAccept) and answer.keys is not None
    }

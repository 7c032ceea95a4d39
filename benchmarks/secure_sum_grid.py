"""One secure sum through an in-process grid: ours (handlers on both sides) and Flower's SecAgg+.

Both run over ``server.simulation.InProcessGrid`` (messages copied record by record, no
sockets), so the figures compare the two protocols with their message handling:

* **ours**: the coordinator's ``server.secure_sum.SecureSumSession`` against every site's real
  handlers (``client.service.handlers.build_site_app`` with ``client.secure_sum.SiteSums``),
  whose site is a :class:`SumOnlySite` (no model, no ledger: a fixed vector per site) — the
  graph nonce round, masked inputs, survivor signatures and the unmask, roster-checked;
* **Flower's**: its stock ``SecAggPlusWorkflow`` (under ``DefaultWorkflow`` and ``FedAvg``,
  the only way flwr 1.42 reaches it) against a ``ClientApp`` with ``secaggplus_mod`` (its own
  key agreement per sum, four round trips, its MT19937 mask expansion), with the same number
  of shares and threshold as ours where its ring allows.

Benchmark code only: nothing here is product code.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from dpmtv_common.crypto import SigningKey
from dpmtv_common.roster import Roster
from protocol import PROTOCOL_VERSION, PlanAccept, ReleasePlan, SecureSumRequest
from protocol.plan import ReleaseOrder, SelectionMode
from protocol.secure_sum import SumInstructions, ranges_for
from protocol.sum_graph import graph_shape
from server.messaging import Exchange
from server.secure_sum import SecureSumSession
from server.simulation import InProcessGrid, make_server_context

__all__ = ["time_flower_sum", "time_our_sum_on_grid"]

MINIMUM = 3
BOUND = 64.0


@dataclass(frozen=True)
class _Settings:
    name: str
    roster: Path
    identity_key: Path
    min_sites: int = MINIMUM
    min_honest: int = 2
    secagg_min_threshold_fraction: float = 0.5


@dataclass(frozen=True)
class _Record:
    plan: ReleasePlan
    num_chunks: int = 64

    @property
    def release_id(self) -> str:
        return self.plan.release_id


@dataclass
class _Records:
    by_release: dict[str, _Record] = field(default_factory=dict)

    def require(self, release_id: str) -> _Record:
        return self.by_release[release_id]

    def open_records(self) -> list[_Record]:
        return list(self.by_release.values())


@dataclass
class SumOnlySite:
    """What ``SiteSums`` asks of a site, for a secure sum alone: a fixed vector, no ledger."""

    settings: _Settings
    vector: np.ndarray
    records: _Records = field(default_factory=_Records)

    def accept_plan(self, plan: ReleasePlan, *, run_id: int) -> PlanAccept:
        self.records.by_release[plan.release_id] = _Record(plan)
        return PlanAccept(
            release_id=plan.release_id,
            site_name=self.settings.name,
            num_chunks=64,
            num_layers=1,
            num_heads=1,
            head_dim=self.vector.size,
            prompt_template_sha256="0" * 64,
            instruction_sha256="0" * 64,
            dpmtv_version="bench",
        )

    def contribution(self, request: Any, *, run_id: int, ranges: Any = None) -> list[np.ndarray]:
        return [self.vector, np.array([64.0])]

    def note_graph_draw(self, release_id: str, *, run_id: int) -> None:
        return None

    def touch(self, run_id: int) -> None:
        return None


def _plan(release_id: str) -> ReleasePlan:
    from datetime import UTC, datetime

    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id=release_id,
        task="bench",
        model_fingerprint="sha256:" + "0" * 64,
        epsilon=1.0,
        delta=1e-5,
        shots=4,
        clip_norm=1.0,
        selection=SelectionMode.ALL,
        order=ReleaseOrder.SELECT_FIRST,
        num_selected_heads=1,
        public_heads=None,
        selection_share=0.3,
        score_top_r=1,
        min_sites=MINIMUM,
        max_chunks_per_site=None,
        created=datetime.now(UTC).isoformat(),
    )


def time_our_sum_on_grid(sites: int, dimension: int, seed: int) -> tuple[float, float, float]:
    """(seconds, CPU seconds, max |error|) of one of our secure sums, plan acceptance excluded."""
    from client.release.site import Site
    from client.service.handlers import build_site_app
    from client.service.sum_stages import SiteSums
    from protocol import PlanRequest

    rng = np.random.default_rng([seed, sites, dimension])
    inputs = [rng.uniform(-BOUND, BOUND, size=dimension) for _ in range(sites)]
    with tempfile.TemporaryDirectory(prefix="dpmtv-bench-grid-") as tmp:
        folder = Path(tmp)
        keys = {f"s{i}": SigningKey.generate() for i in range(sites)}
        roster = folder / "roster.toml"
        roster.write_text(Roster("bench", {n: k.verify_key for n, k in keys.items()}).to_toml())
        stand_ins = [
            SumOnlySite(_Settings(name, roster, key.save(folder / f"{name}.key")), inputs[i])
            for i, (name, key) in enumerate(keys.items())
        ]
        apps = [build_site_app(cast(Site, s), SiteSums(cast(Site, s))) for s in stand_ins]
        grid = InProcessGrid(apps, num_nodes=sites)
        plan = _plan(f"bench-{seed}")
        exchange = Exchange(grid, timeout=600.0)
        replies = exchange.broadcast(
            "plan", PlanRequest(plan=plan), grid.get_node_ids(), PlanAccept, "p"
        )
        adverts = {
            n: a.keys for n, a in replies.answers.items() if isinstance(a, PlanAccept) and a.keys
        }
        ranges = ranges_for(BOUND * 64, sites)
        request = SecureSumRequest(
            release_id=plan.release_id, stage="extract", heads=None, clip_norm=1.0, score_top_r=None
        )
        started, started_cpu = time.perf_counter(), time.process_time()
        session = SecureSumSession(exchange, plan.release_id, adverts, min_sites=MINIMUM)
        result = session.run_sum(SumInstructions(sum_index=0, request=request, ranges=ranges))
        seconds, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    expected = np.sum(inputs, axis=0)
    return seconds, cpu, float(np.max(np.abs(result.total[:-1] - expected)))


def time_flower_sum(sites: int, dimension: int, seed: int) -> tuple[float, float, str]:
    """(seconds, CPU seconds) of one stock Flower SecAgg+ round, and its shares, threshold."""
    from flwr.app import Context, Message
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    logging.getLogger("flwr").setLevel(logging.ERROR)
    app = ClientApp(mods=[secaggplus_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        values = np.random.default_rng([seed, context.node_id]).uniform(-8, 8, size=dimension)
        result = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([values]), 1, {})
        return Message(fitres_to_recorddict(result, keep_input=False), reply_to=msg)

    shape = graph_shape(sites, minimum=MINIMUM)
    shares: int | float = 1.0 if shape.complete else shape.degree + 1
    threshold: int | float = 0.67 if shape.complete else shape.threshold
    grid = InProcessGrid(app, num_nodes=sites)
    strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=sites,
        min_available_clients=sites,
        initial_parameters=ndarrays_to_parameters([np.zeros(dimension)]),
    )
    legacy = LegacyContext(
        context=make_server_context(), config=ServerConfig(num_rounds=1), strategy=strategy
    )
    workflow = DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold)
    )
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    started, started_cpu = time.perf_counter(), time.process_time()
    workflow(grid, legacy)
    seconds, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    label = "all, 0.67" if shape.complete else f"{shares}, {threshold}"
    return seconds, cpu, label

"""Flower 1.42 SecAgg+ workflow, fixed, plus the legacy strategy that captures its result.

Re-exported by ``server.secagg``; see that module for how the pieces connect.
"""

from __future__ import annotations

from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid

__all__ = ["CaptureStrategy", "RobustSecAggPlusWorkflow"]


class RobustSecAggPlusWorkflow(SecAggPlusWorkflow):
    """``SecAggPlusWorkflow`` that survives sites lost before their key shares went out.

    Two flwr 1.42 bugs are fixed (notes/flower.md §2.4, §2.6):

    * A site that drops in stage 0 (setup) or 1 (share keys) stays in ``sampled_node_ids``
      and in its neighbours' neighbourhoods, so at unmask the coordinator asks the others for
      that site's key share, which they never received: every site raises ``KeyError``, the
      secret cannot be rebuilt and the whole sum is lost. After stages 0 and 1 this class
      restricts ``sampled_node_ids`` and every neighbourhood to the sites that completed the
      stage, then re-checks the reconstruction threshold on what is left. Such a site never
      masked anything, so forgetting it is exact; sites lost later (collect, unmask) are
      handled by Flower as before.
    * The collect stage appends every error reply to ``failures`` twice; one copy is kept.
    """

    def setup_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        """Run Flower's setup stage, then forget the sites that did not answer it."""
        super().setup_stage(grid, context, state)
        if not state.nid_to_neighbours:  # halted before the protocol started (no/one site)
            return False
        return self.forget_dropped_sites(state)

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        """Run Flower's share-keys stage, then forget the sites that did not complete it."""
        super().share_keys_stage(grid, context, state)
        return self.forget_dropped_sites(state)

    def collect_masked_vectors_stage(
        self, grid: Grid, context: LegacyContext, state: WorkflowState
    ) -> bool:
        """Run Flower's collect stage, keeping one failure per error reply."""
        before = len(state.failures)
        proceed: bool = super().collect_masked_vectors_stage(grid, context, state)
        added = state.failures[before:]
        # Flower loops over the replies twice and appends each error in both loops.
        state.failures[before:] = added[: len(added) // 2]
        return proceed

    def forget_dropped_sites(self, state: WorkflowState) -> bool:
        """Restrict the protocol to ``state.active_node_ids``; False when it must halt."""
        alive = set(state.active_node_ids)
        if len(alive) < 2:
            # Halt: a one-site sum is public, and with no site left Flower's threshold check
            # passes vacuously, so it would run on and crash at unmask (IndexError).
            return False
        state.sampled_node_ids = alive
        state.nid_to_neighbours = {
            node_id: neighbours & alive
            for node_id, neighbours in state.nid_to_neighbours.items()
            if node_id in alive
        }
        enough: bool = self._check_threshold(state)
        return enough


class CaptureStrategy(Strategy):
    """Legacy strategy that chooses the sites of a secure sum and keeps its result.

    What the sites are sent at collect is set by ``server.secagg.SecureSumRound.finish``.

    SecAgg+ replaces every FitRes' parameters by the unmasked aggregate before calling
    :meth:`aggregate_fit`, so this strategy only records it, with the surviving sites. It
    returns no parameters, so Flower writes nothing into the run's state or history.
    """

    def __init__(self, node_ids: set[int]) -> None:
        self.node_ids = frozenset(node_ids)
        self.aggregate: Parameters | None = None
        self.survivor_ids: list[int] = []
        self.failures: list[BaseException] = []

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """Start from no parameters (a secure sum has no global model)."""
        return None

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Choose the sites; what they get at collect is set after setup (``SecureSumRound``)."""
        proxies = client_manager.all().values()
        return [
            (proxy, FitIns(parameters, {})) for proxy in proxies if proxy.node_id in self.node_ids
        ]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Record the unmasked aggregate (an average over survivors) and who survived."""
        self.aggregate = results[0][1].parameters if results else None
        self.survivor_ids = sorted(proxy.node_id for proxy, _ in results)
        self.failures = [item for item in failures if isinstance(item, BaseException)]
        return None, {}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Evaluate nothing."""
        return []

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """Evaluate nothing."""
        return None, {}

    def evaluate(
        self, server_round: int, parameters: Parameters
    ) -> tuple[float, dict[str, Scalar]] | None:
        """Evaluate nothing."""
        return None

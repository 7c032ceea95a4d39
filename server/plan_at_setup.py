"""The release plan carried by the first secure sum's SecAgg+ setup message: no plan round trip.

How this connects
-----------------
``server.coordinator.Coordinator.plan_stage`` calls :func:`send_plan_at_setup` when
:func:`plan_folds_into_setup` holds. It opens the release's first secure sum
(``server.secagg.SecureSumRound``) and runs only SecAgg+'s setup stage, with the plan
attached to every site's setup message; each site's service checks and reserves the plan
before it makes its SecAgg+ keys (``client.service.handlers.plan_at_setup_mod``) and answers
with its ``PlanAccept`` beside its public keys. The open round is handed to
``server.federated_sums.FederatedSums``, whose first sum finishes it (share keys, collect,
unmask). A deployed release saves one round trip: one SuperNode idle poll and one
``flwr-clientapp`` start per site (docs/benchmarks/deployment.md).

When it applies: SecAgg+'s setup fixes the integer range of the sum, so the coordinator must
size it before any site has answered. In central noise mode the plan's cap on chunks a site
(``max_chunks_per_site``) bounds every coordinate a site can send (``cap * max(C, 1)``), so it
can. Without a cap, and in distributed mode (whose grid depends on the model's shape, which
the coordinator learns from the sites' answers), the plan keeps its own round trip.
"""

from __future__ import annotations

import logging

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.serverapp import Grid

from dpmtv_common.errors import ConfigError, DpmtvError
from protocol import (
    MESSAGE_RECORD_KEY,
    NoiseMode,
    PlanAccept,
    PlanRequest,
    ReleasePlan,
    expect,
    message_to_record,
)
from server.messaging import Replies
from server.prompt_grid import site_label
from server.secagg import SecureSumRound, SecureSumSettings, install_secure_mask_prg
from server.secagg_neighbourhood import neighbourhood

__all__ = ["plan_folds_into_setup", "send_plan_at_setup"]

_log = logging.getLogger(__name__)
FIRST_ROUND_ID = 1


def plan_folds_into_setup(plan: ReleasePlan) -> bool:
    """Whether the plan can ride on the first secure sum's setup (see the module)."""
    return plan.noise_mode is NoiseMode.CENTRAL and plan.max_chunks_per_site is not None


def send_plan_at_setup(
    grid: Grid, context: Context, plan: ReleasePlan, nodes: list[int], timeout: float
) -> tuple[Replies, SecureSumRound]:
    """Run the first secure sum's setup with the plan attached; return the answers and the round.

    Raises:
        ConfigError: The plan has no chunk cap or is not in central mode.
        InsufficientSharesError: Fewer connected sites than the plan's minimum.
    """
    if not plan_folds_into_setup(plan) or plan.max_chunks_per_site is None:
        raise _not_foldable(plan)
    install_secure_mask_prg()  # idempotent; the sites refuse any other mask expansion
    shares, threshold = neighbourhood(len(nodes))
    settings = SecureSumSettings.for_plan(
        # A site sums at most cap chunks, each clipped to C; its count reaches the cap.
        max_abs_coordinate=float(plan.max_chunks_per_site) * max(plan.clip_norm, 1.0),
        max_sites=len(nodes),
        timeout=timeout,
        num_shares=shares,
        reconstruction_threshold=threshold,
    )
    sum_round = SecureSumRound.open(
        grid,
        context,
        nodes,
        round_id=FIRST_ROUND_ID,
        settings=settings,
        min_sites=plan.min_sites,
    )
    record = message_to_record(PlanRequest(plan=plan)).config_records[MESSAGE_RECORD_KEY]
    answers = sum_round.setup((MESSAGE_RECORD_KEY, record))
    replies = _decoded(grid, answers, nodes, sum_round, plan.release_id)
    sum_round.exclude(set(nodes) - set(replies.answers))
    return replies, sum_round


def _decoded(
    grid: Grid,
    answers: dict[int, ConfigRecord | None],
    nodes: list[int],
    sum_round: SecureSumRound,
    release_id: str,
) -> Replies:
    accepted: dict[int, PlanAccept] = {}
    failures: dict[int, str] = {}
    for node in nodes:
        if node not in answers:
            failures[node] = sum_round.setup_errors.get(node, "no reply before the timeout")
            continue
        reply = answers[node]
        if reply is None:
            failures[node] = "answered the setup without an answer to the plan"
            continue
        try:
            accept = expect(RecordDict({MESSAGE_RECORD_KEY: reply}), PlanAccept)
        except DpmtvError as exc:
            failures[node] = str(exc)
            continue
        if accept.release_id != release_id:
            failures[node] = f"accepted release {accept.release_id!r}, not {release_id!r}"
            continue
        accepted[node] = accept
    for node, reason in failures.items():
        _log.warning("site %s: plan at setup failed: %s", site_label(grid, node), reason)
    return Replies(dict(accepted), failures)


def _not_foldable(plan: ReleasePlan) -> ConfigError:
    return ConfigError(
        "a plan rides on the SecAgg+ setup only in central noise mode with a chunk cap, got "
        f"noise mode {plan.noise_mode.value!r} and max_chunks_per_site "
        f"{plan.max_chunks_per_site!r}."
    )

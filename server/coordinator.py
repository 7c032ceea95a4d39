"""One release, run by the coordinator through its stages (one method a stage).

plan → [select] → extract → (noise once) → release, or abort. The privacy-relevant steps —
calibration, the Gumbel picks, the single Gaussian draw, the order — are in
``protocol.run_release``, shared with the single-holder command; this module adds what only a
federation has: the plan exchange and each site's refusal, secure sums over the surviving
sites, the consortium ledger, the signed broadcast, and the abort notice telling every site
whether noisy output exists (refund) or not (count it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid

from dpmtv_common.artifact import MANIFEST_FILE, SIGNATURE_FILE, TENSORS_FILE, write_artifact
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import ConfigError, InsufficientSharesError
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.noise import NoiseSource
from protocol import (
    CENTRE_ARRAY_KEY,
    PROTOCOL_VERSION,
    AbortNotice,
    NoiseMode,
    PlanAccept,
    PlanRequest,
    PrivacyUnit,
    ReleaseAck,
    ReleaseOrder,
    ReleaseOutcome,
    ReleasePlan,
    ReleaseRequest,
    SelectionMode,
    release_description,
    reserve_plan,
    run_release,
)
from server.federated_sums import FederatedSums
from server.messaging import Exchange, Replies
from server.prompt_grid import site_label
from server.settings import CoordinatorSettings, RunConfig

__all__ = ["Coordinator", "ReleaseReport", "build_plan"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReleaseReport:
    """What a finished release produced, for logs, tests and benchmarks."""

    plan: ReleasePlan
    outcome: ReleaseOutcome
    artifact: Path
    acknowledged: tuple[str, ...]
    stage_seconds: dict[str, float]


def build_plan(run: RunConfig, centre: ActivationCentre | None = None) -> ReleasePlan:
    """The release plan of a run config (validated by ``ReleasePlan``), pinning ``centre``."""
    public = run.heads()
    mode = NoiseMode(run.noise_mode)
    distributed = mode is NoiseMode.DISTRIBUTED
    if distributed and not run.max_chunks_per_site:
        raise ConfigError(
            "max-chunks-per-site must be > 0 in distributed noise mode, got 0: it bounds every "
            "site's sum on SecAgg+'s integer grid."
        )
    k = len(public) if public is not None else run.num_selected_heads
    selection = SelectionMode(run.selection)
    if selection is SelectionMode.PUBLIC and run.order == ReleaseOrder.RELEASE_FIRST:
        _log.warning(
            "order = release-first with public heads noises every layer, though nothing is "
            "selected after the release; select-first (the default: leave order out) releases "
            "the same heads with less noise."
        )
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id=run.resolved_release_id(),
        task=run.task,
        model_fingerprint=run.model_fingerprint,
        epsilon=run.epsilon,
        delta=run.delta,
        shots=run.shots,
        clip_norm=run.clip_norm,
        selection=selection,
        order=ReleaseOrder.named_or_default(run.order, selection),
        num_selected_heads=k,
        public_heads=public.heads if public is not None else None,
        candidate_heads=candidates.heads if (candidates := run.candidates()) else None,
        selection_share=run.selection_share,
        score_top_r=run.score_top_r or k,
        min_sites=run.min_sites,
        noise_mode=mode,
        min_honest=run.min_honest,
        max_sites=(run.max_sites or max(run.expected_sites, run.min_sites))
        if distributed
        else None,
        max_chunks_per_site=run.max_chunks_per_site or None,
        max_image_crops=run.max_image_crops or None,
        centre_sha256=None if centre is None else centre.digest(),
        privacy_unit=PrivacyUnit(run.privacy_unit),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


@dataclass
class Coordinator:
    """State of one release plus one method per stage (Flower's WorkflowState style)."""

    grid: Grid
    context: Context
    run: RunConfig
    settings: CoordinatorSettings
    noise: NoiseSource
    accepted: dict[int, PlanAccept] = field(default_factory=dict)
    exposed: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    model_dtype: str | None = None
    sums: FederatedSums | None = None
    planned: list[int] = field(default_factory=list)
    centre: ActivationCentre | None = None

    def wait_for_sites(self) -> list[int]:
        """Poll until ``expected-sites`` nodes are connected, or the timeout; then go on."""
        deadline = time.monotonic() + self.run.node_wait_timeout
        nodes = list(self.grid.get_node_ids())
        while len(nodes) < self.run.expected_sites and time.monotonic() < deadline:
            time.sleep(1.0)
            nodes = list(self.grid.get_node_ids())
        if len(nodes) < self.run.min_sites:
            raise InsufficientSharesError(
                f"connected sites must number at least min-sites={self.run.min_sites}, got "
                f"{len(nodes)} after {self.run.node_wait_timeout:g} s."
            )
        return sorted(nodes)

    def plan_stage(self, plan: ReleasePlan, nodes: list[int]) -> None:
        """Send the plan; keep the sites that accept (each reserved its own budget).

        Each acceptance carries the site's signed key for the release's secure sums (one key
        agreement a release, ``server.secure_sum``): no key round trip of its own.
        """
        self.planned = list(nodes)
        centre = {} if self.centre is None else {CENTRE_ARRAY_KEY: self.centre.flat()}
        replies = self._exchange().broadcast(
            "plan", PlanRequest(plan=plan), nodes, PlanAccept, f"{plan.release_id}-plan", centre
        )
        self.accepted = _with_keys(replies, plan.release_id)
        for node, reason in replies.failures.items():
            _log.warning(
                "site %s refused or failed the plan: %s", site_label(self.grid, node), reason
            )
        shapes = {(a.num_layers, a.num_heads, a.head_dim) for a in self.accepted.values()}
        if len(shapes) > 1:
            raise ConfigError(f"sites must share one model shape, got {sorted(shapes)}.")
        layers = {a.layout().carried_layers for a in self.accepted.values()}
        if len(layers) > 1:  # else "all heads" would differ between sites
            raise ConfigError(
                f"sites must agree on the layers that carry heads, got {sorted(layers)}."
            )
        dtypes = {a.model_dtype for a in self.accepted.values()}
        if len(dtypes) > 1:  # bfloat16 and float32 activations differ; never mix them silently
            raise ConfigError(f"sites must extract in one dtype, got {sorted(map(str, dtypes))}.")
        self.model_dtype = dtypes.pop() if dtypes else None
        _check_one_prompt_template(self.accepted.values())
        _check_one_instruction(self.accepted.values())
        versions = sorted({a.dpmtv_version for a in self.accepted.values()})
        if len(versions) > 1:  # recorded, not refused: the template digest covers the prompt
            _log.info("accepting sites run dpmtv versions %s", versions)
        if len(self.accepted) < plan.min_sites:
            raise InsufficientSharesError(
                f"accepting sites must number at least min-sites={plan.min_sites}, got "
                f"{len(self.accepted)}; refusals: {replies.failures}"
            )

    def release_stage(self, plan: ReleasePlan, ledger: PrivacyLedger) -> ReleaseOutcome:
        """Secure sums, private selection and the single Gaussian draw."""
        first = next(iter(self.accepted.values()))
        layout = first.layout()  # the sites agree on it (plan_stage)
        sums = FederatedSums(
            self._exchange(),
            plan,
            {node: accept.num_chunks for node, accept in self.accepted.items()},
            {node: accept.keys for node, accept in self.accepted.items() if accept.keys},
            first.head_dim,
            layout,
        )

        def on_first_noise() -> None:
            ledger.mark_exposed(plan.release_id)
            self.exposed = True

        self.sums = sums  # its sites narrow with every secure sum: who is still answering
        return run_release(
            plan,
            sums=sums,
            layout=layout,
            noise=self.noise,
            on_first_noise=on_first_noise,
            centre=self.centre,
        )

    def broadcast_stage(self, plan: ReleasePlan, outcome: ReleaseOutcome) -> tuple[Path, list[str]]:
        """Sign the artifact, keep a copy, and send it to every site that accepted."""
        if self.settings.signing_key is None:
            raise ConfigError("the coordinator needs DPMTV_SERVER_SIGNING_KEY to sign artifacts.")
        first = next(iter(self.accepted.values()))  # one digest of each: plan_stage refused others
        path = write_artifact(
            self.settings.artifacts_dir / plan.release_id,
            heads=outcome.heads,
            values=np.asarray(outcome.values),
            release=release_description(
                plan,
                outcome,
                model_dtype=self.model_dtype,
                prompt_template_sha256=first.prompt_template_sha256,
                instruction_sha256=first.instruction_sha256,
                dpmtv_versions=[a.dpmtv_version for a in self.accepted.values()],
            ),
            signing_key=SigningKey.load(self.settings.signing_key),
        )
        request = ReleaseRequest(
            release_id=plan.release_id,
            manifest_json=(path / MANIFEST_FILE).read_text(),
            tensors=(path / TENSORS_FILE).read_bytes(),
            signature=(path / SIGNATURE_FILE).read_bytes(),
        )
        replies = self._exchange().broadcast(
            "release", request, self._survivors(), ReleaseAck, f"{plan.release_id}-release"
        )
        for node, reason in replies.failures.items():
            _log.warning("site %s did not store the artifact: %s", node, reason)
        acks = [a.site_name for a in replies.answers.values() if isinstance(a, ReleaseAck)]
        return path, sorted(acks)

    def abort_stage(self, plan: ReleasePlan, reason: str) -> None:
        """Tell every site sent the plan whether noisy output exists (count) or not (refund).

        Not only the sites whose acceptance arrived: a site whose reply was lost may have
        reserved; a site that never did answers with a refusal, which changes nothing.
        """
        notice = AbortNotice(
            release_id=plan.release_id, reason=reason[:500], noisy_output=self.exposed
        )
        self._exchange().broadcast(
            "abort", notice, self.planned, AbortNotice, f"{plan.release_id}-abort"
        )

    def _survivors(self) -> list[int]:
        # Sites lost in a secure sum are not waited for again: they resolve their own
        # reservations (nothing sent: refund) and can fetch the artifact from a peer.
        alive = self.sums.sites if self.sums is not None else self.accepted
        return [node for node in self.accepted if node in alive]

    def _exchange(self) -> Exchange:
        return Exchange(self.grid, self.run.stage_timeout)

    def timed(self, stage: str, started: float) -> None:
        """Record how long ``stage`` took."""
        self.seconds[stage] = time.monotonic() - started


def run_coordinated_release(
    grid: Grid, context: Context, run: RunConfig, settings: CoordinatorSettings, noise: NoiseSource
) -> ReleaseReport:
    """Plan → secure sums and noise → signed broadcast; abort notices on any failure."""
    centre = run.centre()
    plan = build_plan(run, centre)
    coordinator = Coordinator(grid, context, run, settings, noise, centre=centre)
    started = time.monotonic()
    nodes = coordinator.wait_for_sites()
    coordinator.timed("wait", started)
    with PrivacyLedger.open(settings.ledger_path, settings.budget) as ledger:
        reserve_plan(ledger, plan)
        try:
            started = time.monotonic()
            coordinator.plan_stage(plan, nodes)
            coordinator.timed("plan", started)
            started = time.monotonic()
            outcome = coordinator.release_stage(plan, ledger)
            coordinator.timed("sums+noise", started)
            started = time.monotonic()
            path, acks = coordinator.broadcast_stage(plan, outcome)
            coordinator.timed("broadcast", started)
        except BaseException as exc:
            _finish_failed(coordinator, plan, ledger, exc)
            raise
        ledger.commit(plan.release_id)
    _log.info("release %s: %d sites acknowledged", plan.release_id, len(acks))
    return ReleaseReport(plan, outcome, path, tuple(acks), dict(coordinator.seconds))


def _finish_failed(
    coordinator: Coordinator, plan: ReleasePlan, ledger: PrivacyLedger, exc: BaseException
) -> None:
    """Count the release if noise was drawn (fail closed), else refund; tell the sites."""
    if coordinator.exposed:
        ledger.commit(plan.release_id)
    else:
        ledger.abort(plan.release_id, f"aborted before any noisy output: {exc!r}"[:500])
    if coordinator.planned:  # the sites that accepted are among them
        try:
            coordinator.abort_stage(plan, f"{type(exc).__name__}: {exc}")
        except Exception:  # the original failure matters more than a lost notice
            _log.exception("abort notice could not be sent for %s", plan.release_id)


def _with_keys(replies: Replies, release_id: str) -> dict[int, PlanAccept]:
    """The acceptances that carry this release's key, advertised for the node that sent it."""
    accepted: dict[int, PlanAccept] = {}
    for node, answer in replies.answers.items():
        if not isinstance(answer, PlanAccept):
            continue
        keys = answer.keys
        if keys is None or keys.node_id != node or keys.release_id != release_id:
            replies.failures[node] = "accepted without this release's secure-sum key for its node"
            continue
        accepted[node] = answer
    return accepted


def _check_one_prompt_template(accepts: Iterable[PlanAccept]) -> None:
    """Refuse sites that render prompts with different chat templates.

    The fingerprint covers a template shipped in the model directory, not one an adapter
    (dpmtv's or a plugin's) supplies; under two templates the same chunk is another prompt,
    and the sites' activations would not add up to one task vector.
    """
    sites = _sites_by_digest(accepts, lambda accept: accept.prompt_template_sha256)
    if len(sites) > 1:
        raise ConfigError(
            f"sites must render prompts with one chat template, got prompt_template_sha256 "
            f"values {sites}; ship one chat_template.jinja with every site's model, or "
            "run one dpmtv version and adapter plugin at every site."
        )


def _check_one_instruction(accepts: Iterable[PlanAccept]) -> None:
    """Refuse sites whose prompts carry different task instructions.

    The instruction comes from each site's dataset, outside the fingerprint; under two
    instructions the same chunk is another prompt, and the sites' activations would not add
    up to one task vector (nor match the queries of a site that uses the other).
    """
    sites = _sites_by_digest(accepts, lambda accept: accept.instruction_sha256)
    if len(sites) > 1:
        raise ConfigError(
            f"sites must prompt with one task instruction, got instruction_sha256 values "
            f"{sites}; give every site's dataset.json the same 'instruction' (or none)."
        )


def _sites_by_digest(
    accepts: Iterable[PlanAccept], digest: Callable[[PlanAccept], str]
) -> dict[str, list[str]]:
    """The names of the sites that reported each digest, both sorted (for the refusal)."""
    sites: dict[str, list[str]] = {}
    for accept in accepts:
        sites.setdefault(digest(accept), []).append(accept.site_name)
    return {value: sorted(names) for value, names in sorted(sites.items())}

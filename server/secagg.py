"""Coordinator side of the secure sum: Flower SecAgg+ callable many times from one ServerApp.

How this connects
-----------------
``server.app`` (a Message-API ``@app.main()``) calls :func:`secure_sum` once per stage that
needs a sum over sites (``select``: score vectors; ``extract``: clipped activations), each
with its own ``round_id``. A call runs Flower's four SecAgg+ round trips (setup, share keys,
collect masked vectors, unmask) against the sites' ``ClientApp``, whose ``train`` handler is
wrapped by Flower's ``secaggplus_mod`` and answers with ``client.secagg.secure_sum_reply``.
The coordinator learns only the sum over the surviving sites (and who survived), never a
site's vector; it then adds the one DP noise draw (``dpmtv_common.privacy``).

Flower 1.42 reaches SecAgg+ only through the legacy ``LegacyContext`` + ``Strategy`` +
``FitIns`` path, so :func:`secure_sum` builds a private ``LegacyContext`` (an empty state:
neither the un-noised aggregate nor anything else is written into the caller's ``Context``)
and a capturing legacy strategy, and runs :class:`RobustSecAggPlusWorkflow`, which fixes
the early-dropout halt. It turns Flower's weighted *average* into a *sum*: every site sends
weight 1, ``max_weight`` is 1 (no pre-scaling), and the average is multiplied by the number
of survivors. :class:`SecureSumSettings` refuses ranges under which the modular sum could
wrap; sites refuse coordinates that Flower would clip (``client.secagg``).

Mask expansion: :func:`install_secure_mask_prg` replaces Flower's 32-bit-seeded MT19937
(flwr #7522) by ChaCha20 (``dpmtv_common.crypto.mask_prg``) in this process. The sites must
run the same expansion (``client.secagg.install_secure_mask_prg``); the coordinator announces
its choice in the FitIns config and a site refuses a mismatch, so a half-installed consortium
fails loudly instead of returning noise. Threat model: honest-but-curious coordinator (Flower
implements no consistency check against a malicious one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import (
    FitIns,
    NDArrayInt,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common.recorddict_compat import fitins_to_recorddict
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.secure_aggregation import secaggplus_workflow as flwr_workflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid

from dpmtv_common.aliases import Float64Array
from dpmtv_common.crypto import mask_prg, shamir
from dpmtv_common.errors import ConfigError, InsufficientSharesError
from server._attaching_grid import AttachingGrid
from server._secagg_settings import SecureSumSettings
from server._secagg_workflow import CaptureStrategy, RobustSecAggPlusWorkflow

__all__ = [
    "RobustSecAggPlusWorkflow",
    "SecureSumResult",
    "SecureSumRound",
    "SecureSumSettings",
    "install_secure_mask_prg",
    "mask_prg_in_use",
    "secure_sum",
]

_log = logging.getLogger(__name__)

# The global that flwr's workflow module imported from secaggplus_utils and calls at unmask.
_PATCHED_NAME = "pseudo_rand_gen"
# The name it imported from flwr.common.secure_aggregation.crypto.shamir and calls at unmask.
_SHAMIR_NAME = "combine_shares"


@dataclass(frozen=True)
class SecureSumResult:
    """The outcome of one secure sum.

    Attributes:
        arrays: Per array sent by the sites, the float64 sum over the surviving sites
            (exact up to ``settings.quantization_error_bound(num_sites)`` per coordinate).
        num_sites: How many sites' vectors are in the sum.
        site_ids: Node ids of those sites (to add up their public chunk counts).
        failures: Error replies received (a site's refusal, a crash); silent dropouts
            (timeouts) appear only as missing ``site_ids``.
    """

    arrays: list[Float64Array]
    num_sites: int
    site_ids: tuple[int, ...]
    failures: tuple[BaseException, ...]


def secure_sum(
    grid: Grid,
    context: Context,
    node_ids: Iterable[int],
    config: Mapping[str, Scalar],
    *,
    round_id: int,
    settings: SecureSumSettings,
    min_sites: int,
    broadcast: Sequence[npt.NDArray[Any]] = (),
) -> SecureSumResult | None:
    """Securely sum the arrays the sites return for ``config``; learn only the total.

    Args:
        grid: The ServerApp's grid.
        context: The ServerApp's context (read, never written).
        node_ids: The sites to include (at most ``settings.max_sites``).
        config: Plaintext instructions for the sites' handler (the FitIns config).
        round_id: Distinct per secure sum within a run (becomes the message group id).
        settings: The validated SecAgg+ parameters.
        min_sites: Fewest surviving sites (>= 2) whose sum may be released.
        broadcast: Arrays every site receives in the clear with ``config`` (the FitIns
            parameters of the collect stage), e.g. a noisy vector to score against; they
            save a round trip and are never part of the sum.

    Returns:
        The sum, or None when SecAgg+ halted without a result (too few sites left at some
        stage to rebuild the masks); the caller must then abort the release.

    Raises:
        ConfigError: On bad arguments, more sites than ``settings.max_sites``, or Flower's
            weak mask PRG in use while ``settings.allow_weak_mask_prg`` is False.
        InsufficientSharesError: If fewer than ``min_sites`` sites are offered or survive.
    """
    sum_round = SecureSumRound.open(
        grid, context, node_ids, round_id=round_id, settings=settings, min_sites=min_sites
    )
    sum_round.setup()
    return sum_round.finish(config, broadcast)


class SecureSumRound:
    """One secure sum run in two calls, so its first message can carry more than SecAgg+'s.

    :meth:`setup` runs SecAgg+'s setup stage (optionally with a record attached to every
    message, whose replies it returns: the release plan rides here); :meth:`finish` sets the
    instructions and runs share keys, collect and unmask. :func:`secure_sum` is both in one.
    """

    def __init__(
        self,
        grid: Grid,
        legacy: LegacyContext,
        strategy: CaptureStrategy,
        settings: SecureSumSettings,
        min_sites: int,
    ) -> None:
        self.grid = grid
        self.legacy = legacy
        self.strategy = strategy
        self.settings = settings
        self.min_sites = min_sites
        self.workflow = _workflow(settings)
        self.state = WorkflowState()
        self._alive: bool | None = None  # None: setup not run yet
        self.setup_errors: dict[int, str] = {}  # site -> why its setup failed (attached runs)

    @classmethod
    def open(
        cls,
        grid: Grid,
        context: Context,
        node_ids: Iterable[int],
        *,
        round_id: int,
        settings: SecureSumSettings,
        min_sites: int,
    ) -> SecureSumRound:
        """Check the arguments; nothing is sent yet (see :func:`secure_sum`)."""
        _fit_config({}, settings)  # refuse a weak mask PRG before anything is sent
        sites = _checked_sites(node_ids, settings, min_sites)
        strategy = CaptureStrategy(sites)
        legacy = _legacy_context(grid, context, sites, strategy, round_id)
        return cls(grid, legacy, strategy, settings, min_sites)

    def setup(
        self, attach: tuple[str, ConfigRecord] | None = None
    ) -> dict[int, ConfigRecord | None]:
        """Run the setup stage; return, by site that answered, its reply record under the key.

        None for a site that answered the setup without that record (it stays in the sum
        unless :meth:`exclude` removes it); sites that failed are in ``setup_errors``.
        """
        if self._alive is not None:
            raise ConfigError("setup must run once a secure sum, got a second call.")
        grid: Grid = self.grid if attach is None else AttachingGrid(self.grid, *attach)
        self._alive = self.workflow.setup_stage(grid, self.legacy, self.state)
        if not isinstance(grid, AttachingGrid):
            return {}
        self.setup_errors = dict(grid.errors)
        return dict(grid.replies)

    def exclude(self, node_ids: Iterable[int]) -> None:
        """Leave sites out after setup (they masked nothing yet: forgetting them is exact)."""
        if not self._alive:
            return
        self.state.active_node_ids -= set(node_ids)
        self._alive = self.workflow.forget_dropped_sites(self.state)

    @property
    def active_sites(self) -> set[int]:
        """Sites still in the sum."""
        return set(self.state.active_node_ids)

    def finish(
        self, config: Mapping[str, Scalar], broadcast: Sequence[npt.NDArray[Any]] = ()
    ) -> SecureSumResult | None:
        """Send ``config`` (and ``broadcast``) at collect; run the remaining stages."""
        if self._alive is None:
            raise ConfigError("finish must follow setup, got no setup.")
        if not self._alive:
            return None
        instructions = _instructions(_fit_config(config, self.settings), broadcast)
        self.state.nid_to_fitins = {
            node: fitins_to_recorddict(instructions, True) for node in self.state.nid_to_fitins
        }
        stages = (
            self.workflow.share_keys_stage,
            self.workflow.collect_masked_vectors_stage,
            self.workflow.unmask_stage,
        )
        for stage in stages:
            if not stage(self.grid, self.legacy, self.state):
                _log.info("secure sum halted: too few sites left to rebuild the masks")
                return None
        return self._result()

    def _result(self) -> SecureSumResult | None:
        strategy = self.strategy
        if strategy.aggregate is None:
            return None
        survivors = tuple(strategy.survivor_ids)
        if len(survivors) < self.min_sites:
            raise InsufficientSharesError(
                f"surviving sites must number at least min_sites={self.min_sites}, got "
                f"{len(survivors)} of {len(self.strategy.node_ids)}: abort this release."
            )
        averages = parameters_to_ndarrays(strategy.aggregate)
        sums = [np.asarray(average, dtype=np.float64) * len(survivors) for average in averages]
        return SecureSumResult(sums, len(survivors), survivors, tuple(strategy.failures))


def install_secure_mask_prg() -> None:
    """Make this process's SecAgg+ workflow expand masks with ChaCha20 (idempotent).

    Patches the name ``pseudo_rand_gen`` in
    ``flwr.server.workflow.secure_aggregation.secaggplus_workflow`` (imported there from
    ``flwr.common.secure_aggregation.secaggplus_utils``; the unmask stage calls it for the
    private mask of every survivor and the pairwise masks of every dropped site). Flower's
    ``SecAggWorkflow`` subclasses this workflow and is covered too. Sites must call
    ``client.secagg.install_secure_mask_prg()``, or the masks do not cancel.

    The unmask stage's ``combine_shares`` is replaced too, by
    ``dpmtv_common.crypto.shamir.combine_shares``: the same reconstruction bit for bit
    (sites running Flower's own sharing interoperate), hundreds of times faster.
    """
    vars(flwr_workflow)[_PATCHED_NAME] = _chacha20_pseudo_rand_gen
    vars(flwr_workflow)[_SHAMIR_NAME] = shamir.combine_shares


def mask_prg_in_use() -> str:
    """Return the name of the mask expansion this process's SecAgg+ workflow runs."""
    installed = vars(flwr_workflow)[_PATCHED_NAME] is _chacha20_pseudo_rand_gen
    return mask_prg.MASK_PRG_NAME if installed else mask_prg.FLOWER_PRG_NAME


def _chacha20_pseudo_rand_gen(
    seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]
) -> list[NDArrayInt]:
    """Stand in for Flower's ``pseudo_rand_gen``, with its signature."""
    return mask_prg.expand_mask(seed, num_range, dimensions_list)


def _checked_sites(
    node_ids: Iterable[int], settings: SecureSumSettings, min_sites: int
) -> set[int]:
    offered = list(node_ids)
    sites = set(offered)
    if len(sites) != len(offered):
        raise ConfigError(f"node_ids must be distinct, got {sorted(offered)!r}.")
    if not isinstance(min_sites, int) or isinstance(min_sites, bool) or min_sites < 2:
        raise ConfigError(
            f"min_sites must be an int >= 2 (a one-site sum is public), got {min_sites!r}."
        )
    if len(sites) > settings.max_sites:
        raise ConfigError(
            f"node_ids must number at most settings.max_sites={settings.max_sites} (else the "
            f"modular sum may wrap), got {len(sites)}. Raise max_sites in the settings."
        )
    if len(sites) < min_sites:
        raise InsufficientSharesError(
            f"node_ids must number at least min_sites={min_sites}, got {len(sites)}."
        )
    return sites


def _fit_config(config: Mapping[str, Scalar], settings: SecureSumSettings) -> dict[str, Scalar]:
    if mask_prg.MASK_PRG_CONFIG_KEY in config:
        raise ConfigError(
            f"config must not set the reserved key {mask_prg.MASK_PRG_CONFIG_KEY!r}, "
            f"got {config[mask_prg.MASK_PRG_CONFIG_KEY]!r}."
        )
    prg = mask_prg_in_use()
    if prg != mask_prg.MASK_PRG_NAME and not settings.allow_weak_mask_prg:
        raise ConfigError(
            f"the SecAgg+ mask PRG must be {mask_prg.MASK_PRG_NAME!r}, got {prg!r} (flwr "
            f"#7522). Call server.secagg.install_secure_mask_prg() at ServerApp start, or set "
            f"allow_weak_mask_prg=True in SecureSumSettings (tests only)."
        )
    return {**config, mask_prg.MASK_PRG_CONFIG_KEY: prg}


def _instructions(config: Mapping[str, Scalar], arrays: Sequence[npt.NDArray[Any]]) -> FitIns:
    """What every site is sent at collect: the config and, in the clear, ``arrays``."""
    # Flower's own "no parameters" when there are none, as its setup stage sends.
    empty = Parameters(tensors=[], tensor_type="")
    return FitIns(ndarrays_to_parameters(list(arrays)) if arrays else empty, dict(config))


def _legacy_context(
    grid: Grid, context: Context, sites: set[int], strategy: CaptureStrategy, round_id: int
) -> LegacyContext:
    if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
        raise ConfigError(f"round_id must be an int >= 0, got {round_id!r}.")
    manager = SimpleClientManager()
    for node_id in sorted(sites):
        manager.register(GridClientProxy(node_id=node_id, grid=grid, run_id=grid.run.run_id))
    # A fresh state, so Flower cannot leave the un-noised aggregate in the caller's Context.
    private = Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=dict(context.node_config),
        state=RecordDict(),
        run_config=dict(context.run_config),
    )
    legacy = LegacyContext(
        private, config=ServerConfig(num_rounds=1), strategy=strategy, client_manager=manager
    )
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({"current_round": round_id})
    legacy.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    return legacy


def _workflow(settings: SecureSumSettings) -> RobustSecAggPlusWorkflow:
    return RobustSecAggPlusWorkflow(
        num_shares=settings.num_shares,
        reconstruction_threshold=settings.reconstruction_threshold,
        max_weight=1.0,  # every site sends weight 1: no pre-scaling, the ratio is exactly 1
        clipping_range=float(settings.clipping_range),  # the mod demands a float
        quantization_range=settings.quantization_range,
        modulus_range=settings.modulus_range,
        timeout=settings.timeout,
    )

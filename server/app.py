"""The coordinator's Flower ``ServerApp``: wiring only (see ``server.coordinator``).

``flwr run`` starts it with the run config of ``[tool.flwr.app.config]`` (overridden by
``--run-config``); the coordinator's own secrets come from ``DPMTV_SERVER_*`` variables.
One run makes one release.
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
from server.coordinator import run_coordinated_release
from server.secagg import install_secure_mask_prg
from server.settings import CoordinatorSettings, RunConfig

__all__ = ["app"]

_log = logging.getLogger(__name__)

install_secure_mask_prg()  # ChaCha20 mask expansion; the sites refuse any other
app = ServerApp()


def _log_through_flower() -> None:
    """Give our loggers Flower's handlers, so INFO lines reach ``flwr log`` and ``--stream``.

    A deployed ``flwr-serverapp`` process configures only the ``flwr`` logger; without this,
    the release summary below (m, σ, ε, sites, stage timings) was never seen by the operator.
    """
    package = logging.getLogger("server")
    if package.handlers:
        return  # already configured, by us or by whoever embeds the app
    for handler in logging.getLogger("flwr").handlers:
        package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one release with the production noise source (no seed can reach it)."""
    _log_through_flower()
    run = RunConfig.from_context(dict(context.run_config))
    noise = secure_noise()
    require_cryptographic(noise)
    report = run_coordinated_release(grid, context, run, CoordinatorSettings(), noise)
    outcome = report.outcome
    _log.info(
        "released %d heads (m=%d chunks, sigma=%.4g, epsilon=%.4g %s) to %s; artifact %s; "
        "stage seconds: %s",
        len(outcome.heads),
        outcome.num_chunks,
        outcome.noise_std,
        outcome.calibration.bound.epsilon,
        outcome.calibration.bound.accountant,
        ", ".join(report.acknowledged),
        report.artifact,
        ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in report.stage_seconds.items()),
    )

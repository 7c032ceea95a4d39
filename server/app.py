"""The coordinator's Flower ``ServerApp``: wiring only (see ``server.coordinator``).

``flwr run`` starts it with the run config of ``[tool.flwr.app.config]`` (overridden by
``--run-config``); the coordinator's own secrets come from ``DPMTV_SERVER_*`` variables.
One run makes one release, and leaves one summary line: what was released to which sites
(by the names they registered with), or why not and what the consortium ledger then holds.
The line goes to ``flwr log`` and to the coordinator's release journal, ``<ledger>.releases.log``
beside the consortium ledger (``DPMTV_SERVER_LEDGER_PATH``): after ``flwr stop`` the SuperLink
revokes the run's token at once, so the ServerApp's last words never reach ``flwr log``, and
the journal is where the operator finds them.

Flower's grid is wrapped in :class:`server.prompt_grid.PromptGrid` (replies collected within
~0.1 s instead of 3 s; silent sites given up within seconds).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from dpmtv_common.errors import DpmtvError
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
from server.coordinator import ReleaseReport, run_coordinated_release
from server.prompt_grid import PromptGrid, StragglerPolicy
from server.settings import CoordinatorSettings, RunConfig

__all__ = ["app", "journal_path"]

_log = logging.getLogger(__name__)

app = ServerApp()

_SITES_RESOLVE = (
    "each site resolves its own reservation by its state machine (nothing sent: refund; "
    "anything sent: counted) when its service has seen no message for idle_release_seconds"
)


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
    # Fix the release id now, so a failed or stopped run can still be named in the log.
    run = run.model_copy(update={"release_id": run.resolved_release_id()})
    noise = secure_noise()
    require_cryptographic(noise)
    settings = CoordinatorSettings()
    prompt = PromptGrid(grid, stragglers=StragglerPolicy())
    try:
        report = run_coordinated_release(prompt, context, run, settings, noise)
    except BaseException as exc:  # flwr stop ends here too (a 401 or SystemExit): record it
        line = (
            f"release {run.release_id} {_failure(exc)}; consortium ledger: "
            f"{_ledger_state(settings, run.release_id)}; {_SITES_RESOLVE}."
        )
        _log.error(line)
        _journal(settings, line)
        raise
    line = _summary(report)
    _log.info(line)
    _journal(settings, line)


def _failure(exc: BaseException) -> str:
    """STOPPED when the SuperLink revoked the run (flwr stop, SuperLink restart), else FAILED."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status == 401 or isinstance(exc, SystemExit | KeyboardInterrupt):
        return (
            "STOPPED (the SuperLink ended the run: flwr stop, or the SuperLink restarted; "
            f"{type(exc).__name__})"
        )
    return f"FAILED ({type(exc).__name__}: {str(exc)[:300]})"


def journal_path(settings: CoordinatorSettings) -> Path:
    """The coordinator's release journal: one line per release, beside the consortium ledger."""
    return settings.ledger_path.with_name(settings.ledger_path.name + ".releases.log")


def _journal(settings: CoordinatorSettings, line: str) -> None:
    try:
        path = journal_path(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as journal:
            journal.write(f"{datetime.now(UTC).isoformat(timespec='seconds')} {line}\n")
    except OSError:  # the record is a courtesy: the ledger itself is already resolved
        _log.exception("the release journal could not be written")


def _summary(report: ReleaseReport) -> str:
    outcome = report.outcome
    bound = outcome.bound  # central: the calibration's; distributed: at t honest shares
    plan = report.plan
    epsilon = (
        f"{bound.epsilon:.4g} per {plan.privacy_unit.value} {bound.accountant}, "
        f"{plan.noise_mode.value}"
    )
    return (
        f"release {report.plan.release_id} COMMITTED: {len(outcome.heads)} heads "
        f"(m={outcome.num_chunks} chunks, sigma={outcome.noise_std:.4g}, epsilon={epsilon})"
        f" released to {', '.join(report.acknowledged) or 'no site'}; artifact "
        f"{report.artifact}; stage seconds: "
        + ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in report.stage_seconds.items())
    )


def _ledger_state(settings: CoordinatorSettings, release_id: str) -> str:
    """The consortium ledger's state of ``release_id`` (committed = counted, aborted = refunded)."""
    if not settings.ledger_path.exists():
        return "nothing reserved"  # opening would create an empty ledger
    try:
        with PrivacyLedger.open(settings.ledger_path, settings.budget) as ledger:
            states = {entry.release_id: entry.state for entry in ledger.releases()}
    except (DpmtvError, OSError) as exc:
        return f"unreadable ({exc})"
    state = states.get(release_id)
    return "nothing reserved" if state is None else str(state.value)

"""The coordinator's Flower ``ServerApp``: wiring only (see ``server.coordinator``).

``flwr run`` starts it with the run config of ``[tool.flwr.app.config]`` (overridden by
``--run-config``); the coordinator's own secrets come from ``DPMTV_SERVER_*`` variables.
One run makes one release, and leaves one summary line in ``flwr log``: what was released
to which sites (by the names they registered with), or why not and what the consortium
ledger then holds. Flower's grid is wrapped in :class:`server.prompt_grid.PromptGrid`
(replies collected within ~0.1 s instead of 3 s; silent sites given up within seconds).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from dpmtv_common.errors import DpmtvError
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
from server.coordinator import ReleaseReport, run_coordinated_release
from server.prompt_grid import PromptGrid, StragglerPolicy
from server.secagg import install_secure_mask_prg
from server.settings import CoordinatorSettings, RunConfig

__all__ = ["app"]

_log = logging.getLogger(__name__)

install_secure_mask_prg()  # ChaCha20 mask expansion; the sites refuse any other
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
    with _record_stop(run.release_id):
        try:
            report = run_coordinated_release(prompt, context, run, settings, noise)
        except BaseException as exc:  # flwr stop arrives as SystemExit: record it, re-raise
            _log.error(
                "release %s FAILED (%s: %s); consortium ledger: %s; %s.",
                run.release_id,
                type(exc).__name__,
                str(exc)[:300],
                _ledger_state(settings, run.release_id),
                _SITES_RESOLVE,
            )
            raise
    _log.info(_summary(report))


def _summary(report: ReleaseReport) -> str:
    outcome = report.outcome
    bound = outcome.calibration.bound if outcome.calibration is not None else None
    epsilon = f"{bound.epsilon:.4g} {bound.accountant}" if bound is not None else "n/a"
    return (
        f"release {report.plan.release_id} COMMITTED: {len(outcome.heads)} heads "
        f"(m={outcome.num_chunks} chunks, sigma={outcome.noise_std:.4g}, epsilon={epsilon})"
        f" released to {', '.join(report.acknowledged) or 'no site'}; artifact "
        f"{report.artifact}; stage seconds: "
        + ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in report.stage_seconds.items())
    )


def _ledger_state(settings: CoordinatorSettings, release_id: str) -> str:
    """The consortium ledger's state of ``release_id`` (committed = counted, aborted = refunded)."""
    try:
        with PrivacyLedger.open(settings.ledger_path, settings.budget) as ledger:
            states = {entry.release_id: entry.state for entry in ledger.releases()}
    except (DpmtvError, OSError) as exc:
        return f"unreadable ({exc})"
    state = states.get(release_id)
    return "nothing reserved" if state is None else str(state.value)


@contextlib.contextmanager
def _record_stop(release_id: str) -> Iterator[None]:
    """Log a line when Flower stops the run (``flwr stop``: SIGINT/SIGTERM), then let it stop.

    Flower's own handler exits the process within 5 s; the line comes first, so the record
    survives even if the coordinator's abort notice cannot reach the sites any more.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread (embedded use)
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_stop(signum: int, frame: FrameType | None) -> None:
        _log.warning(
            "release %s STOPPED by %s (flwr stop or shutdown); the coordinator resolves its "
            "ledger entry (refund if no noise was drawn, else counted); %s.",
            release_id,
            signal.Signals(signum).name,
            _SITES_RESOLVE,
        )
        handler = previous[signal.Signals(signum)]
        if callable(handler):
            handler(signum, frame)
        elif handler != signal.SIG_IGN:
            raise KeyboardInterrupt  # the default action: stop, through the cleanup above

    for sig in previous:
        signal.signal(sig, on_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, _as_handler(handler))


def _as_handler(handler: object) -> Callable[[int, FrameType | None], object] | int:
    if callable(handler) or isinstance(handler, int):
        return handler
    return signal.SIG_DFL

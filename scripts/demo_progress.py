"""Progress lines for scripts/demo: no phase stays silent for longer than a heartbeat.

On a pretrained decoder and 2 cores, a phase of the demo (public choices, the federated
release, the local evaluation) runs for minutes. :class:`Heartbeat` prints, every ``every``
seconds while a phase runs, its name, its latest step and the seconds it has taken; the
steps come from the demo itself and from the sites' and coordinator's own log lines (plan
accepted, contributed to a secure sum, acknowledged), through :class:`StepHandler`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["Heartbeat", "StepHandler"]


class Heartbeat:
    """Prints the running phase, its latest step and its elapsed seconds, every ``every`` s."""

    def __init__(self, every: float = 20.0, out: TextIO | None = None) -> None:
        self.every = every
        self.out = out if out is not None else sys.stdout
        self._step = ""
        self._lock = threading.Lock()

    def step(self, text: str) -> None:
        """Name what the running phase is doing now (shown at the next beat)."""
        with self._lock:
            self._step = " ".join(text.split())[:120]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Beat while the block runs; stop at its end, whatever happens."""
        self.step("")
        started = time.monotonic()
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.every):
                with self._lock:
                    doing = self._step or "working"
                elapsed = time.monotonic() - started
                print(f"      ... {name}: {doing} ({elapsed:.0f} s)", file=self.out, flush=True)

        thread = threading.Thread(target=beat, name="demo-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


class StepHandler(logging.Handler):
    """Feeds INFO log lines of the sites and the coordinator to a heartbeat as its steps."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        super().__init__(level=logging.INFO)
        self.heartbeat = heartbeat

    def emit(self, record: logging.LogRecord) -> None:
        """Take the record's message as the current step."""
        self.heartbeat.step(record.getMessage())

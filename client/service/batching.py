"""Batched generation across requests: a bounded queue and one worker that schedules rows.

How this connects: the HTTP endpoint's side in the service (:mod:`client.service.http_backend`)
turns each chat request into one :class:`~client.service.preparation.RowRequest` (its parsed
prompt, the release's patch or none, its sampling settings) and hands it to :class:`Batcher`
with a sink that receives the row's tokens. One worker thread prepares the requests waiting
in its queue together (:func:`~client.service.preparation.prepare_rows`: one processor call for
those that tokenise alike, each cut back into its own :class:`~client.service.rows.Row`), then
runs the rows under the service's model lock (the lock every other use of the model takes, so
no release's hooks ever see a served row) in one of three modes:

- ``continuous`` (the default where the family allows it): rows join the running batch at the
  next decoding step and leave when they finish (:mod:`client.service.decoding`), up to
  ``rows`` at once; no row waits for another's answer to end, and no pass runs empty rows.
- ``passes``: for families the continuous batch cannot step, the waiting rows (up to ``rows``)
  go through one ``generate()`` call together (:mod:`client.service.passes`); rows that
  arrive meanwhile wait for the next pass.
- ``invariant`` (``batch_invariant=True``, a site's choice): passes of one row, so each answer
  is bit-identical to plain ``generate()`` on its prompt whatever the load, at the price of
  every batching gain.

**When rows start.** A prefill (its own forward pass) costs nearly as much for one row as for
several, so rows are started in groups, and rows that ask together stay together:

- With rows running, waiting rows join at the next step, unless every running row ends within
  the join horizon: then they start with the next batch, in step with the rows that are ending
  (whose clients often ask again at once). Running rows never wait. The horizon is what the
  worker measured (:func:`~client.service.pass_costs.join_horizon`): as many steps as the
  joining rows' prefill costs every row in waiting, at least ``join_horizon``; so a batch that
  a late arrival split into two out-of-step groups comes back into step instead of paying a
  prefill per group every cycle.
- With none running, waiting rows start once they fill the free rows, or once ``gather_s`` has
  passed (counted from the later of the oldest's arrival and the last batch's end), or at once
  if none of them was waiting for that batch to end and no request is being parsed. A request
  being parsed is announced (:meth:`Batcher.expect`), so rows that arrive together start
  together.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from client.models import LoadedModel
from client.service.decoding import BatchStats, ContinuousBatch, steps_continuously
from client.service.pass_costs import join_horizon
from client.service.passes import run_pass
from client.service.preparation import RowRequest, prepare_rows
from client.service.rows import Row, RowSink, Ticket
from dpmtv_common.errors import ConfigError, ServiceError

__all__ = ["BatchStats", "Batcher", "OverloadedError"]

_log = logging.getLogger(__name__)

Mode = Literal["continuous", "passes", "invariant"]


class OverloadedError(ServiceError):
    """The queue of waiting rows is full: the caller should retry later."""


@dataclass
class _Pending:
    """A request waiting for the worker to prepare it."""

    request: RowRequest
    sink: RowSink
    prepared: Future[Row]
    queued: float


class Batcher:
    """A bounded queue of rows and the one worker thread that generates them.

    Args:
        loaded: The site's model (shared: every use of it takes ``model_lock``).
        model_lock: The lock that serialises every use of the model in this process.
        rows: Most rows generated at once.
        max_queue: Rows that may wait; one more is refused with :class:`OverloadedError`.
        gather_s: How long rows about to start may wait for others (see the module docstring).
        join_horizon: Rows do not join a running batch whose rows all end within this many
            steps, nor within the horizon the measured pass costs give (module docstring):
            they start with the next one.
        batch_invariant: Answer each row alone (see the module docstring).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        model_lock: threading.Lock,
        *,
        rows: int,
        max_queue: int,
        gather_s: float = 0.05,
        join_horizon: int = 2,
        batch_invariant: bool = False,
    ) -> None:
        if not 0 <= gather_s <= 1:
            raise ConfigError(f"gather_s must be within [0, 1] seconds, got {gather_s}.")
        if rows < 1:
            raise ConfigError(f"rows must be >= 1, got {rows}.")
        if join_horizon < 0:
            raise ConfigError(f"join_horizon must be >= 0, got {join_horizon}.")
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}.")
        self.loaded = loaded
        self.mode: Mode = (
            "invariant"
            if batch_invariant
            else "continuous"
            if steps_continuously(loaded)
            else "passes"
        )
        self.rows = 1 if batch_invariant else rows
        self.max_queue = max_queue
        self.gather_s = gather_s
        self.join_horizon = join_horizon
        self.stats = BatchStats()
        self._model_lock = model_lock
        self._queue: collections.deque[Ticket] = collections.deque()
        self._pending: list[_Pending] = []  # requests not yet prepared, in arrival order
        self._ready = threading.Condition()
        self._stopped = False
        self._expected = 0  # rows announced by expect() and not yet submitted
        # When the last batch's final step (or the last pass) began and ended (monotonic s):
        # rows queued before it began waited for that end; rows queued later came after it.
        self._ended = (0.0, 0.0)
        self._thread = threading.Thread(target=self._run, name="dpmtv-batcher", daemon=True)

    @property
    def depth(self) -> int:
        """Rows waiting now (prepared or not)."""
        return len(self._queue) + len(self._pending)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail the rows still waiting, let the running ones finish, and stop the worker."""
        with self._ready:
            self._stopped = True
            waiting, pending = list(self._queue), self._pending
            self._queue.clear()
            self._pending = []
            self._ready.notify_all()
        for ticket in waiting:
            ticket.sink.fail(ServiceError("the service is stopping; the row was not run."))
        for item in pending:
            item.prepared.set_exception(_stopping())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def expect(self) -> None:
        """Announce a row being prepared: rows waiting to start wait for it (``gather_s``)."""
        with self._ready:
            self._expected += 1

    def cancel_expected(self) -> None:
        """Withdraw an announced row that will not come (its request failed)."""
        with self._ready:
            self._expected = max(0, self._expected - 1)
            self._ready.notify_all()

    def submit(
        self, item: Row | RowRequest, sink: RowSink, *, expected: bool = False
    ) -> Future[Row]:
        """Queue a prepared row, or a request the worker prepares with those waiting beside it.

        The row's tokens go to ``sink`` from the worker thread. A request whose preparation
        fails (a prompt too long for the model, images its processor refuses) is not queued:
        its future raises that error and its sink is never called, so the caller answers it
        as a bad request, as if it had prepared it itself.

        Args:
            item: The prepared row, or the request to prepare.
            sink: Receives its tokens.
            expected: The row was announced with :meth:`expect` (counted off either way).

        Returns:
            The row: done at once for a row; for a request, once the worker has prepared it
            (the future cannot be cancelled: the row may already be running).

        Raises:
            OverloadedError: ``max_queue`` rows already wait, or the batcher is stopped.
        """
        prepared: Future[Row] = Future()
        prepared.set_running_or_notify_cancel()
        with self._ready:
            if expected:
                self._expected = max(0, self._expected - 1)
                self._ready.notify_all()
            if self._stopped:
                raise OverloadedError("the service is stopping: it takes no new rows.")
            if self.depth >= self.max_queue:
                raise OverloadedError(
                    f"queued rows must stay below {self.max_queue}, got a full queue; retry later."
                )
            if isinstance(item, Row):
                self._queue.append(Ticket(item, sink, time.monotonic()))
            else:
                self._pending.append(_Pending(item, sink, prepared, time.monotonic()))
            self._ready.notify()
        if isinstance(item, Row):
            prepared.set_result(item)
        return prepared

    def _prepare_pending(self) -> None:
        """Prepare every request waiting, together; queue their rows, answer their futures."""
        with self._ready:
            pending, self._pending = self._pending, []
        if not pending:
            return
        started = time.monotonic()
        try:
            results = prepare_rows([item.request for item in pending])
        except Exception as exc:  # a defect, not a request's fault: fail these, keep serving
            _log.warning("preparing %d requests failed: %s", len(pending), exc)
            results = [exc] * len(pending)
        seconds = time.monotonic() - started
        self.stats.prepared += len(pending)
        self.stats.prepare_calls += 1
        self.stats.prepare_seconds += seconds
        self.stats.worker_seconds += seconds
        with self._ready:
            stopped = self._stopped
            if not stopped:
                rows = zip(pending, results, strict=True)
                self._queue.extend(
                    Ticket(row, item.sink, item.queued)
                    for item, row in rows
                    if isinstance(row, Row)
                )
                self._queue = collections.deque(sorted(self._queue, key=lambda t: t.queued))
        for item, result in zip(pending, results, strict=True):
            if isinstance(result, Row) and not stopped:
                item.prepared.set_result(result)
            else:
                item.prepared.set_exception(
                    result if isinstance(result, Exception) else _stopping()
                )

    def _take(self, running: int = 0, steps_left: int = 0) -> list[Ticket] | None:
        """The rows to start now (oldest first, up to ``rows - running``); None: stop.

        See the module docstring for when. With rows running this never blocks (they step
        meanwhile); with none, it blocks until rows can start. While requests wait to be
        prepared it returns none at once: the worker prepares them first.

        Args:
            running: Rows running now.
            steps_left: Steps the longest of them may still take.
        """
        with self._ready:
            while not self._stopped:
                if self._pending:  # the worker prepares them first, with those announced
                    wait = self._wait_for_announced(running)
                    if wait <= 0:
                        return []
                    self._ready.wait(wait)
                    continue
                room = self.rows - running
                mates = self._mates() if room > 0 else []
                if running:
                    if not mates:
                        return []
                    horizon = join_horizon(self.stats.costs, joining=min(room, len(mates)),
                                           running=running, floor=self.join_horizon)  # fmt: skip
                    late = steps_left <= horizon  # they start with the next batch
                    return [] if late else self._pop(mates[:room])
                if not mates:
                    self._ready.wait()
                    continue
                began, ended = self._ended
                opened = max(mates[0].queued, ended)
                waited_for_end = mates[0].queued < began
                now = time.monotonic()
                if (
                    len(mates) >= room
                    or now - opened >= self.gather_s
                    or not (self._expected or waited_for_end)
                ):
                    return self._pop(mates[:room])
                self._ready.wait(opened + self.gather_s - now)
            return [] if running else None

    def _wait_for_announced(self, running: int) -> float:
        """Seconds to wait for announced requests before preparing those waiting (0: none).

        With nothing running, requests announced (:meth:`expect`) but not yet submitted are
        waited for, up to ``gather_s`` from the oldest waiting one's arrival, so that rows
        that arrive together are prepared in one processor call, not one call each as they
        trickle in. With rows running, the waiting ones are prepared at once: they join at
        the next step.
        """
        if running or not self._expected:
            return 0.0
        return self._pending[0].queued + self.gather_s - time.monotonic()

    def _pop(self, tickets: list[Ticket]) -> list[Ticket]:
        for ticket in tickets:
            self._queue.remove(ticket)
        return tickets

    def _mates(self) -> list[Ticket]:
        """The queued rows that can start together, oldest first.

        All of them for the continuous batch (it prefills each stack key apart); a pass takes
        the rows whose image tensors stack with the oldest row's.
        """
        if self.mode == "continuous" or not self._queue:
            return list(self._queue)
        key = self._queue[0].row.stack_key
        return [t for t in self._queue if t.row.stack_key == key]

    def _run(self) -> None:
        if self.mode == "continuous":
            self._run_continuous()
            return
        while True:
            self._prepare_pending()
            if (tickets := self._take()) is None:
                return
            if not tickets:
                continue
            started = time.monotonic()
            try:
                run_pass(self.loaded, self._model_lock, tickets, self.stats)
            except Exception as exc:  # one pass's failure fails its rows, not the service
                _log.warning("generation failed for %d rows: %s", len(tickets), exc)
                self.stats.failures += 1
                for ticket in tickets:
                    ticket.sink.fail(exc)
            self._ended = (started, time.monotonic())
            self.stats.worker_seconds += time.monotonic() - started

    def _run_continuous(self) -> None:
        batch = ContinuousBatch(self.loaded, self._model_lock, self.stats)
        while True:
            self._prepare_pending()
            if (tickets := self._take(batch.size, batch.steps_left)) is None:
                return
            started, ran = time.monotonic(), bool(tickets) or batch.size > 0
            try:
                if tickets:
                    batch.join(tickets)  # each row joins, or is failed
                batch.step()
            except Exception as exc:  # a failed step fails the running rows, not the service
                _log.warning("a decoding step failed for %d rows: %s", batch.size, exc)
                self.stats.failures += 1
                batch.fail_all(exc)
            if ran and batch.size == 0:
                self._ended = (started, time.monotonic())
            self.stats.worker_seconds += time.monotonic() - started


def _stopping() -> ServiceError:
    return ServiceError("the service is stopping; the request was not run.")

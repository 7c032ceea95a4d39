"""How dpmtv's processes use CPU threads: sized to the cores they have, and never spinning.

torch's CPU kernels run on an OpenMP pool. GNU OpenMP's default wait policy lets idle pool
threads spin for a while before sleeping; on cores shared with other processes (a laptop,
a CI runner, five sites on one host) the spinning threads take the cores the work needs, and
a simulated release ran about twice as slow as with ``OMP_WAIT_POLICY=PASSIVE``. OpenMP reads
the policy once, when torch loads it, so it must be in the environment before ``import
torch``; torch also sizes its pool from ``OMP_NUM_THREADS`` at that moment.

Every entry point (``scripts/demo``, the benchmarks, ``dpmtv-site`` and its service, the test
suite) calls :func:`apply_thread_policy` once, first. This module imports neither torch nor
numpy, so calling it costs nothing and changes no import order.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from dpmtv_common.errors import ConfigError

__all__ = ["ThreadPolicy", "apply_thread_policy"]

_WAIT_POLICY = "OMP_WAIT_POLICY"
_NUM_THREADS = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadPolicy:
    """What :func:`apply_thread_policy` put in force.

    Attributes:
        wait_policy: ``OMP_WAIT_POLICY`` (``PASSIVE`` unless the environment said otherwise).
        threads: torch's intra-op thread count.
    """

    wait_policy: str
    threads: int


def apply_thread_policy(threads: int | None = None) -> ThreadPolicy:
    """Make torch's thread pool sleep when idle, and size it; call before importing torch.

    Args:
        threads: torch's intra-op thread count. None keeps ``OMP_NUM_THREADS`` when the
            environment sets it, and otherwise uses every core this process may run on.

    A wait policy already in the environment is kept (an operator with dedicated cores may
    choose ``ACTIVE``). A later call may change the thread count (``dpmtv-site serve
    --threads``); the wait policy can only be set before torch is loaded.

    Raises:
        ConfigError: ``threads`` or ``OMP_NUM_THREADS`` is not a positive integer, or torch
            was imported before the wait policy was set (its pool may already spin).
    """
    torch = sys.modules.get("torch")
    if torch is not None and _WAIT_POLICY not in os.environ:
        raise ConfigError(
            "apply_thread_policy must run before torch is imported, got torch already "
            "loaded without OMP_WAIT_POLICY. Call it first in the entry point."
        )
    wait_policy = os.environ.setdefault(_WAIT_POLICY, "PASSIVE")
    count = _thread_count(threads)
    os.environ[_NUM_THREADS] = str(count)
    if torch is not None and torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return ThreadPolicy(wait_policy=wait_policy, threads=count)


def _thread_count(threads: int | None) -> int:
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive integer, got {threads!r}.")
        return threads
    given = os.environ.get(_NUM_THREADS) or None  # "OMP_NUM_THREADS=" means unset
    if given is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else _cpus()
    try:
        count = int(given)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"OMP_NUM_THREADS must be a positive integer, got {given!r}.")
    return count


def _cpus() -> int:
    return os.cpu_count() or 1

"""How a ``maskprior fit`` ended, as its exit code says: the contract between a run and whatever started it.

A study launcher (a local process, a SLURM job, a Ray task) reads the exit code of the run's command
and records the run's status from it; the run itself also writes the status into its ``result.json``.
"""

from __future__ import annotations

import signal

OK = 0
#: A non-finite training loss stopped the run (the message names the step and the loss).
EXIT_DIVERGED = 3
#: Conventional shell codes: 128 + the signal number. The run saved ``last.ckpt`` before exiting.
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143
EXIT_SIGINT = 128 + signal.SIGINT  # 130

#: The statuses of a run that ended with a result (its metrics are read; a study does not run it again).
FINISHED = ("ok", "diverged")

INTERRUPTED_CODES = frozenset({EXIT_SIGTERM, EXIT_SIGINT, 128 + getattr(signal, "SIGUSR1", 10),
                               128 + getattr(signal, "SIGUSR2", 12), 128 + getattr(signal, "SIGHUP", 1)})


def status_from_returncode(returncode: int) -> str:
    """``ok``, ``diverged``, ``interrupted`` (resumable from ``last.ckpt``) or ``failed``."""
    if returncode == OK:
        return "ok"
    if returncode == EXIT_DIVERGED:
        return "diverged"
    if returncode in INTERRUPTED_CODES or returncode in (-signal.SIGTERM, -signal.SIGINT):
        return "interrupted"
    return "failed"

"""Launchers: what executes a study's runs (local processes, in-process, SLURM through submitit, Ray).

Every launcher executes the same self-contained command per run, ``cell_command(run.dir)``
(``python -m lightning_maskprior.study.cell <run_dir>``). The study has written ``<run_dir>/run.json``
before launching; the cell reads it, fits (resuming from ``last.ckpt`` when there is one), tests, and
writes ``<run_dir>/result.json`` itself. A launcher therefore only starts commands, waits, and reports
what each run's ``result.json`` says (``finished_result`` writes one for a cell that died before it could).

A launcher reads from the study: ``parallel`` (most runs at a time), ``threads_per_run``
(OMP_NUM_THREADS), ``gpus_per_run`` (None: the launcher's default) and ``launcher_options`` (its own
settings, e.g. a SLURM partition; it validates them in ``__init__`` and raises StudyError naming a bad one).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_maskprior.study.cell import start_child, write_json
from lightning_maskprior.study.spec import LAUNCHERS

if TYPE_CHECKING:
    from lightning_maskprior.study.spec import Run, Study

#: Called once per run that ended while ``Launcher.run`` was active (ok, failed, diverged or interrupted),
#: with the run's result (the dict in its result.json), from the thread that called ``run``, one call at a time.
OnResult = Callable[["Run", dict], None]


class Launcher:
    """Executes runs' cells; subclasses implement ``run`` and ``stop``.

    Args:
        study: The validated study; ``__init__`` must be cheap (no jobs, no cluster calls) and raise
            StudyError for options this launcher cannot honour.
    """

    #: True when the launcher calls the cell in the study's own process (then ``parallel`` must be 1).
    in_process: bool = False

    def __init__(self, study: Study) -> None:
        self.study = study

    def run(self, runs: list[Run], on_result: OnResult) -> None:
        """Execute every run (its run.json is written), at most ``study.parallel`` at a time; block until all
        have ended or ``stop`` was called. ``on_result(run, result)`` follows every run that ended. If an
        exception (e.g. the study's Interrupted on SIGTERM) escapes, live runs are stopped first."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the study's log: how runs are executed (concurrency, threads, devices, queue)."""
        return f"up to {self.study.parallel} at a time"

    def stop(self) -> None:
        """End every live run (SIGTERM: a run saves ``last.ckpt`` and records itself as interrupted), wait for
        them, and start no more. Safe to call twice, from another thread, or after ``run`` raised."""
        raise NotImplementedError


def cell_command(run_dir: Path) -> list[str]:
    """The one command that executes a run whose ``run.json`` is written: fit (or resume), test, result.json."""
    return [sys.executable, "-m", "lightning_maskprior.study.cell", str(run_dir)]


#: How long a cell (or a cell's fit) gets to save ``last.ckpt`` and exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 80.0

def start_cell(command: list[str], env: dict[str, str], ignore: tuple[str, ...] = (), **popen_kwargs: Any
               ) -> subprocess.Popen:
    """Start a cell ``command`` (``cell_command(run_dir)``), stdout and stderr appended to ``<run_dir>/cell.log``."""
    with open(Path(command[-1]) / "cell.log", "a") as log:
        return start_child(command, ignore, stdout=log, stderr=subprocess.STDOUT, env=env, **popen_kwargs)


def has_exited(process: subprocess.Popen) -> bool:
    """Whether the child has ended, without reaping it or taking Popen's lock (safe in a signal handler that
    interrupted ``process.wait()``)."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def end_cell(process: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the cell (it saves ``last.ckpt``, records itself as interrupted and exits), SIGKILL it after
    ``timeout`` seconds. Usable from a signal handler."""
    if has_exited(process):
        return
    try:
        os.kill(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while not has_exited(process):
        if time.time() > deadline:
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = float("inf")
        time.sleep(0.1)


def finished_result(run: Run, returncode: int | None, error: str = "") -> dict:
    """The result of a run whose cell has ended: its result.json, or (a cell killed before writing one, e.g.
    out of memory, a node lost) a result written now from the cell's exit code and ``error``."""
    result = run.load_result()
    if run.owns(result):
        return result
    from lightning_maskprior.run.status import status_from_returncode

    status = "failed" if returncode is None else status_from_returncode(returncode)
    status = "failed" if status == "ok" else status  # exit 0 but no result.json: the cell did not finish
    result = {"task": run.task.name, "init": run.init.label, "init_method": run.init.name, "seed": run.seed,
              "key": run.key(), "commands": [], "seconds": 0.0, "status": status, "stage": "cell",
              "returncode": returncode, "metrics": {},
              "error": error or f"the cell ended (exit code {returncode}) without writing {run.result_path}"}
    write_json(run.result_path, result)
    return result


def get_launcher(name: str) -> type[Launcher]:
    """The launcher class registered as ``name`` (imports its module now)."""
    if name not in LAUNCHERS:
        from lightning_maskprior.study.spec import StudyError

        raise StudyError(f"launcher: unknown launcher {name!r}; expected one of {sorted(LAUNCHERS)}")
    module, _, cls = LAUNCHERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)

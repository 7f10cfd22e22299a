"""Local launchers: each run's cell as a process on this machine (``local``), or called in this process
(``inprocess``, one at a time: for debugging and fast tests).

``local`` runs up to ``parallel`` cells at a time. With ``gpus_per_run`` > 0 (the default when CUDA is
present: 1) the CUDA devices are cut into disjoint slots of that many, and a run starts only when a slot
is free: it sees just its slot's devices (``CUDA_VISIBLE_DEVICES``). With 0 it sees none.
Every cell gets ``OMP_NUM_THREADS=threads_per_run``.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from lightning_maskprior.study.launchers import Launcher, OnResult, cell_command, finished_result, start_cell
from lightning_maskprior.study.spec import Run, Study, StudyError

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 60  # a run gets this long to save last.ckpt after SIGTERM before it is killed


def _cuda_devices() -> list[str]:
    """This machine's CUDA devices as CUDA_VISIBLE_DEVICES names: the ones it already lists, else 0..n-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001  (no usable CUDA: no devices)
        return []


class LocalLauncher(Launcher):
    """Cells as child processes of the study, in disjoint device slots; they die with the study.

    Args:
        study: The study; uses ``parallel``, ``threads_per_run`` and ``gpus_per_run``.
    """

    def __init__(self, study: Study) -> None:
        super().__init__(study)
        devices = _cuda_devices()
        gpus = study.gpus_per_run if study.gpus_per_run is not None else (1 if devices else 0)
        if gpus > len(devices):
            raise StudyError(f"gpus_per_run: each run asks for {gpus} CUDA device(s) but this machine has "
                             f"{len(devices)} ({','.join(devices) or 'none'}); use gpus_per_run: 0 for CPU runs")
        self.gpus_per_run = gpus
        self.hidden_gpus = gpus == 0 and bool(devices)  # CPU runs on a GPU machine: hide the devices
        self.slots = [tuple(devices[i:i + gpus]) for i in range(0, len(devices) - gpus + 1, gpus)] if gpus else []
        self.concurrency = min(study.parallel, len(self.slots)) if gpus else study.parallel
        self.live: dict[subprocess.Popen, tuple[Run, tuple[str, ...] | None]] = {}
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def describe(self) -> str:
        """One line for the study's log: concurrency, threads and devices."""
        text = f"{self.concurrency} at a time, OMP_NUM_THREADS={self.study.threads_per_run} per run"
        if self.gpus_per_run:
            text += f", {self.gpus_per_run} GPU(s) per run from slots {[','.join(s) for s in self.slots]}"
        return text

    def environment(self, slot: tuple[str, ...] | None) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.study.threads_per_run), PYTHONUNBUFFERED="1")
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot)
        elif self.hidden_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def _start(self, run: Run, slot: tuple[str, ...] | None) -> None:
        with self.lock:
            if self.stopping.is_set():
                return
            # Started from the thread that runs the loop (PDEATHSIG follows the starting thread) and in a
            # session of its own: a Ctrl-C in the terminal reaches the study only, which stops the cells.
            process = start_cell(cell_command(run.dir), self.environment(slot), start_new_session=True)
            self.live[process] = (run, slot)

    def run(self, runs: list[Run], on_result: OnResult) -> None:
        queue = list(runs)
        free = list(self.slots)
        redone: set[str] = set()
        try:
            while True:
                while queue and len(self.live) < self.concurrency and not self.stopping.is_set():
                    slot = free.pop(0) if self.gpus_per_run else None
                    self._start(queue.pop(0), slot)
                with self.lock:
                    ended = [(p, *self.live.pop(p)) for p in list(self.live) if p.poll() is not None]
                for process, run, slot in ended:
                    if slot is not None:
                        free.append(slot)
                    if not run.run_path.is_file() and run.name not in redone and not self.stopping.is_set():
                        # Its directory vanished while it ran (deleted by hand, a cleaned scratch disk): run it
                        # again from the start, once, rather than stop the study.
                        from lightning_maskprior.study.cell import prepare_run

                        redone.add(run.name)
                        prepare_run(run, self.study.threads_per_run)
                        print(f"{run.name}: its directory vanished while it ran; running it again", flush=True)
                        queue.append(run)
                        continue
                    error = _log_tail(run.dir / "cell.log")
                    on_result(run, finished_result(run, process.returncode, error))
                if not self.live and (not queue or self.stopping.is_set()):
                    return
                if not ended:
                    time.sleep(POLL_SECONDS)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            processes = list(self.live)
        for process in processes:
            if process.poll() is None:
                process.terminate()  # the cell passes SIGTERM on to its fit, which saves last.ckpt
        deadline = time.time() + STOP_GRACE_SECONDS
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _log_tail(path: Path, lines: int = 25) -> str:
    from lightning_maskprior.study.cell import tail

    return tail(path, lines)


class InProcessLauncher(Launcher):
    """Calls each cell in this process, one after another (fit and test call the CLI in-process too)."""

    in_process = True

    def __init__(self, study: Study) -> None:
        super().__init__(study)
        self.stopping = threading.Event()

    def describe(self) -> str:
        return "one at a time, in this process"

    def run(self, runs: list[Run], on_result: OnResult) -> None:
        from lightning_maskprior.study.cell import run_cell

        for run in runs:
            if self.stopping.is_set():
                return
            on_result(run, run_cell(run.dir, in_process=True))

    def stop(self) -> None:
        self.stopping.set()

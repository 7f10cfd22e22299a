"""``launcher: ray``: each run's cell as one Ray task, retried (and resumed from its checkpoint) when a node dies.

The study file's ``ray:`` mapping (see ``RayLauncher.OPTIONS``; ``launcher_options`` override it)::

    launcher: ray       # or: maskprior study -c <study>.yaml --launcher ray
    ray: {address: auto, num_cpus: 8, num_gpus: 1, max_retries: 3}

Every run is one task ``ray.remote(num_cpus=..., num_gpus=..., max_retries=..., retry_exceptions=False)``
that executes the cell command as a child process and returns its exit code; the run's result is the cell's
``<run_dir>/result.json``. A run that fails is a result (the task returns its exit code), not an exception,
so only a lost worker or node makes Ray run the task again; the new attempt's cell finds ``last.ckpt``
in the run directory and resumes. The run directories (``out_dir``) must be on a filesystem that every node
of the Ray cluster sees under the same path, and every node needs this package installed in the same
Python environment (the task imports this module).

``address``: ``null`` starts a Ray instance on this machine for the study (its CPUs: ``parallel`` x
``num_cpus``, so ``parallel`` runs at a time) and shuts it down at the end; ``auto`` joins the cluster
started with ``ray start`` on this node; ``ray://<head>:10001`` connects through Ray Client
(``pip install "ray[client]"``). A process that already called ``ray.init`` keeps its connection.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from lightning_maskprior.study.launchers import (
    STOP_TIMEOUT_S,
    Launcher,
    OnResult,
    cell_command,
    end_cell,
    finished_result,
    start_cell,
)

INSTALL_HINT = 'pip install "lightning-maskprior[cluster]" (or: pip install ray)'
def _processes_of(run_dir: Path) -> list[int]:
    """PIDs of this host's processes executing ``run_dir`` (its cell, fit or test; Linux's /proc)."""
    pids, target = [], str(run_dir)
    proc = Path("/proc")
    if not proc.is_dir():
        return pids
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and target in argv and any("lightning_maskprior" in a for a in argv):
            pids.append(int(entry.name))
    return pids


def _wait_for_orphans(run_dir: Path, timeout: float = STOP_TIMEOUT_S) -> None:
    """A retried task: when its worker died, Ray killed the first attempt's cell, and the cell's fit got SIGTERM
    (PDEATHSIG) and may still be saving ``last.ckpt``. Wait for such processes on this host before resuming."""
    deadline = time.time() + timeout
    while _processes_of(run_dir) and time.time() < deadline:
        time.sleep(0.5)


def execute_cell(run_dir: str, threads: int) -> int:
    """The Ray task: run the cell of ``run_dir`` as a child process and return its exit code.

    ``ray.cancel`` raises KeyboardInterrupt here (between two polls): the cell is stopped with SIGTERM (it
    saves ``last.ckpt`` and records itself as interrupted) before the task ends. If the worker dies, the cell's
    fit gets SIGTERM (Ray kills the worker's children; PDEATHSIG) and saves ``last.ckpt``; Ray's retry resumes.
    """
    run_dir_path = Path(run_dir)
    _wait_for_orphans(run_dir_path)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")  # Ray sets CUDA_VISIBLE_DEVICES
    process = start_cell(cell_command(run_dir_path), env)
    try:
        while process.poll() is None:  # not wait(): Ray's cancel interrupts Python code, not a blocking wait
            time.sleep(0.2)
        return process.returncode
    except BaseException:
        end_cell(process)
        process.wait()
        raise


class RayLauncher(Launcher):
    """Runs the cells as Ray tasks (one per run, all submitted at once; Ray schedules them by resources).

    Args:
        study: The study; reads ``launcher_options`` (the study file's ``ray:`` mapping, ``OPTIONS``),
            ``gpus_per_run`` (the default of ``num_gpus``) and, for a Ray instance started here, ``parallel``.
            It sets ``study.threads_per_run`` to the tasks' OMP_NUM_THREADS (``num_cpus``).
    """

    OPTIONS: dict[str, tuple[str, Any]] = {
        "address": ("null: a Ray instance on this machine for this study; auto: the running cluster; "
                    "ray://<head>:10001: Ray Client", None),
        "num_cpus": ("CPUs per run (Ray resource; also the cell's OMP_NUM_THREADS)", 1),
        "num_gpus": ("GPUs per run (Ray resource; fractions share a GPU); default gpus_per_run, else 0", None),
        "max_retries": ("how many times a task is run again after its worker or node died", 3),
        "runtime_env": ("Ray runtime_env for the tasks, e.g. {env_vars: {HF_HOME: /shared/hf}}", None),
    }

    @classmethod
    def validate(cls, options: dict[str, Any] | None) -> dict[str, Any]:
        """The options with defaults filled in; StudyError naming the first bad key."""
        from lightning_maskprior.study.spec import StudyError

        given = dict(options or {})
        unknown = sorted(set(given) - set(cls.OPTIONS))
        if unknown:
            raise StudyError(f"ray: unknown key(s) {unknown}; expected some of "
                             f"{sorted(cls.OPTIONS)}")
        opts = {k: given.get(k, default) for k, (_, default) in cls.OPTIONS.items()}
        if opts["address"] is not None and not isinstance(opts["address"], str):
            raise StudyError(f"ray.address: null, 'auto' or 'ray://<head>:<port>', "
                             f"got {opts['address']!r}")
        for key in ("num_cpus", "num_gpus"):
            value = opts[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise StudyError(f"ray.{key}: must be a number >= 0, got {value!r}")
        value = opts["max_retries"]
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise StudyError(f"ray.max_retries: an integer >= 0 (-1: forever), got {value!r}")
        if opts["runtime_env"] is not None and not isinstance(opts["runtime_env"], dict):
            raise StudyError(f"ray.runtime_env: must be a mapping, got {opts['runtime_env']!r}")
        return opts

    def __init__(self, study) -> None:
        super().__init__(study)
        from lightning_maskprior.study.spec import StudyError

        try:
            import ray  # noqa: F401
        except ImportError:
            raise StudyError(f"launcher ray needs ray: {INSTALL_HINT}") from None
        self.options = self.validate(getattr(study, "launcher_options", None))
        gpus = self.options["num_gpus"]
        self.num_gpus = gpus if gpus is not None else (getattr(study, "gpus_per_run", None) or 0)
        self.num_cpus = self.options["num_cpus"]
        self.threads = max(1, int(self.num_cpus))
        study.threads_per_run = self.threads  # the cells' OMP_NUM_THREADS (run.json), not this machine's cores
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.live: dict[Any, Any] = {}  # ObjectRef -> run

    def describe(self) -> str:
        """One line for the study's log."""
        address = self.options["address"]
        where = "a Ray instance on this machine" if address is None else f"the Ray cluster at {address}"
        return (f"one Ray task per run on {where}, {self.num_cpus} CPU(s) (OMP_NUM_THREADS={self.threads}) and "
                f"{self.num_gpus} GPU(s) per run, max_retries {self.options['max_retries']}")

    def init_kwargs(self) -> dict[str, Any]:
        """``ray.init``'s arguments for this study."""
        address = self.options["address"]
        if address is None:  # a private instance, sized so that ``parallel`` runs fit at once
            kwargs: dict[str, Any] = {"address": "local", "include_dashboard": False, "log_to_driver": False,
                                      "num_cpus": max(1, int(self.study.parallel * max(self.num_cpus, 1)))}
        else:  # an existing cluster (or Ray Client): its own settings stand
            kwargs = {"address": address}
        if self.options["runtime_env"] is not None:
            kwargs["runtime_env"] = dict(self.options["runtime_env"])
        return kwargs

    def run(self, runs: list, on_result: OnResult) -> None:
        if not runs:
            return
        import ray

        started = False
        try:
            if not ray.is_initialized():
                ray.init(**self.init_kwargs())
                started = True
            task = ray.remote(execute_cell)
            options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                       "max_retries": self.options["max_retries"], "retry_exceptions": False}
            with self.lock:
                if self.stopping.is_set():
                    return
                self.live = {task.options(**options, name=f"maskprior:{run.name}").remote(str(run.dir), self.threads):
                             run for run in runs}
            while True:
                with self.lock:
                    pending = list(self.live)
                if not pending or self.stopping.is_set():
                    return
                ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
                if not ready:  # sleep here, not inside Ray: a signal handler's exception stays what it is
                    time.sleep(0.5)
                for ref in ready:
                    with self.lock:
                        run = self.live.pop(ref, None)
                    if run is not None:
                        on_result(run, self._result(ref, run))
        except BaseException as err:
            self.stop()
            if isinstance(err, SystemError) and isinstance(err.__cause__, BaseException):
                raise err.__cause__ from None  # a signal handler's exception (the study's Interrupted) inside Ray
            raise
        finally:
            if started:
                ray.shutdown()

    def _result(self, ref, run) -> dict:
        import ray

        returncode, error = None, ""
        try:
            returncode = ray.get(ref)
        except Exception as err:  # noqa: BLE001  (a task lost more often than max_retries, or cancelled)
            error = f"Ray task: {type(err).__name__}: {err}"[-4000:]
        if not isinstance(returncode, int):
            returncode = None
        if not error and returncode != 0:
            from lightning_maskprior.study.cell import tail

            error = tail(Path(run.dir) / "cell.log")
        return finished_result(run, returncode, error)

    def stop(self) -> None:
        """Cancel every task: a running one stops its cell with SIGTERM (``last.ckpt`` is saved, the run is
        recorded as interrupted); a queued one never starts."""
        with self.lock:
            self.stopping.set()
            refs = list(self.live)
            self.live = {}
        if not refs:
            return
        import ray

        if not ray.is_initialized():
            return
        for ref in refs:
            try:
                ray.cancel(ref, force=False)
            except Exception:  # noqa: BLE001  (finished meanwhile)
                pass
        _, left = ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S + 10)
        for ref in left:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001
                pass

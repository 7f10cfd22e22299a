"""``launcher: slurm``: each run's cell as one SLURM job (a job array) through submitit, requeued on preemption.

The study file's ``slurm:`` mapping (see ``SlurmLauncher.OPTIONS``; ``launcher_options`` override it) becomes
submitit's parameters::

    launcher: slurm     # or: maskprior study -c <study>.yaml --launcher slurm
    slurm: {partition: gpu, gpus_per_node: 1, cpus_per_task: 8, mem_gb: 32, time: 720}

All runs are submitted at once as one array (``array_parallelism`` of them running at a time); each job runs
``CellJob(run_dir)``, which executes the cell command as a child process. The run directories (``out_dir``)
and the Python environment must be on a filesystem every node sees.

Preemption and time limits: SLURM (and submitit's ``--signal``, USR2 by default) tells the job; submitit calls
``CellJob.checkpoint``, which sends SIGTERM to the cell (its fit saves ``last.ckpt`` and exits 143) and
returns a ``DelayedSubmission`` of the same cell, so submitit requeues the job (``scontrol requeue``). The
requeued job runs the cell again, which finds ``last.ckpt`` and resumes (its fit command gets ``--ckpt_path``).
The cell and its children ignore submitit's signal, so only the job decides what happens on it.

``cluster: local`` runs the same jobs with submitit's LocalExecutor on this machine (no SLURM needed): for
trying a study file and for the tests. There the jobs get SIGTERM through submitit's controller, and the
job passes it on to its cell, as SLURM would deliver it to every process of the job.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from lightning_maskprior.run.status import INTERRUPTED_CODES
from lightning_maskprior.study.launchers import (
    STOP_TIMEOUT_S,
    Launcher,
    OnResult,
    cell_command,
    end_cell,
    finished_result,
    has_exited,
    start_cell,
)

try:  # the optional extra: pip install "lightning-maskprior[cluster]"
    from submitit.helpers import Checkpointable, DelayedSubmission
except ImportError:  # pragma: no cover - exercised only without the extra
    Checkpointable, DelayedSubmission = object, None  # type: ignore[assignment,misc]

INSTALL_HINT = 'pip install "lightning-maskprior[cluster]" (or: pip install submitit)'

#: A cell that stopped on a SIGTERM it got from SLURM directly (preemption) waits this long for submitit's
#: requeue signal, which follows the SIGTERM; without one (scancel, or no requeue) the job ends as interrupted.
REQUEUE_WAIT_S = 30.0


# ------------------------------------------------------------------------------------- inside the job
class CellJob(Checkpointable):
    """What each SLURM job runs: ``CellJob(threads)(run_dir, cell_command(run_dir))`` executes the run's cell as
    a child process and returns its exit code; the run's result is the cell's ``<run_dir>/result.json``.
    It is pickled by value (see ``SlurmLauncher.run``): the job process imports submitit only, not torch.

    On preemption or time-out submitit calls ``checkpoint(run_dir)``: the cell is stopped with SIGTERM (its fit
    saves ``last.ckpt``) and the returned ``DelayedSubmission`` of this same callable is what the requeued
    job runs, so the cell resumes from ``last.ckpt``.

    Args:
        threads: OMP_NUM_THREADS of the cell (None: leave the job's environment as it is).
        requeue_wait_s: See ``REQUEUE_WAIT_S``.
    """

    def __init__(self, threads: int | None = None, requeue_wait_s: float = REQUEUE_WAIT_S) -> None:
        self.threads = threads
        self.requeue_wait_s = requeue_wait_s
        self._process: subprocess.Popen | None = None
        self._checkpointing = False
        self._stopping = False

    def __getstate__(self) -> dict[str, Any]:  # pickled for the (re)submission: no live process
        return {"threads": self.threads, "requeue_wait_s": self.requeue_wait_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def _preempt_signal(self) -> str:
        from submitit.core.job_environment import JobEnvironment

        return JobEnvironment.USR_SIG  # e.g. "USR2"; the cell ignores it, this process handles it

    def __call__(self, run_dir: str, command: list[str]) -> int:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if os.environ.get("SUBMITIT_EXECUTOR") == "local":
            # No cgroup delivers a stop to every process here: pass the controller's SIGTERM on to the cell.
            signal.signal(signal.SIGTERM, self._forward_stop)
        self._process = start_cell(command, env, ignore=(f"SIG{self._preempt_signal()}",))
        returncode = self._process.wait()
        if returncode in INTERRUPTED_CODES | {-signal.SIGTERM} and not (self._checkpointing or self._stopping):
            # SLURM's SIGTERM reached the cell directly (preemption or scancel); on preemption submitit's
            # signal follows at once and ``checkpoint`` requeues this job (exiting from inside this sleep).
            deadline = time.time() + self.requeue_wait_s
            while time.time() < deadline and not self._checkpointing:
                time.sleep(0.2)
        return returncode

    def _forward_stop(self, signum: int, frame: Any = None) -> None:
        self._stopping = True
        if self._process is not None and not has_exited(self._process):
            os.kill(self._process.pid, signal.SIGTERM)

    def checkpoint(self, run_dir: str, command: list[str]) -> DelayedSubmission:
        """Stop the cell (SIGTERM: ``last.ckpt`` is saved) and hand submitit the same cell to requeue."""
        self._checkpointing = True
        if self._process is not None:
            end_cell(self._process)
        return DelayedSubmission(CellJob(self.threads, self.requeue_wait_s), run_dir, command)


# ----------------------------------------------------------------------------------- the study's side
def _positive_int(value: Any, key: str, allow_zero: bool = False) -> int:
    from lightning_maskprior.study.spec import StudyError

    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StudyError(f"slurm.{key}: must be an integer >= {low}, got {value!r}")
    return value


class SlurmLauncher(Launcher):
    """Runs the cells as SLURM jobs through submitit (one job per run, one array per study).

    Args:
        study: The study; reads ``launcher_options`` (the study file's ``slurm:`` mapping, ``OPTIONS``),
            ``gpus_per_run`` (the default of ``gpus_per_node``) and, with ``cluster: local``, ``parallel`` and
            ``threads_per_run``. It sets ``study.threads_per_run`` to the jobs' OMP_NUM_THREADS.
    """

    #: key -> (what it is, default). None: not passed to submitit (SLURM's / the cluster's default).
    OPTIONS: dict[str, tuple[str, Any]] = {
        "cluster": ("slurm (sbatch through submitit) or local (submitit's LocalExecutor on this machine)", "slurm"),
        "partition": ("SLURM partition", None),
        "gpus_per_node": ("GPUs per job (one run); default gpus_per_run, else 0", None),
        "cpus_per_task": ("CPUs per job; also the cell's OMP_NUM_THREADS (default 1 on SLURM)", None),
        "mem_gb": ("memory per job in GB", None),
        "time": ("time limit per job in minutes (a requeued job gets it again)", 240),
        "array_parallelism": ("most jobs of the array running at once (default: all; local: parallel)", None),
        "job_name": ("SLURM job name", "maskprior"),
        "log_folder": ("submitit's folder for job scripts, pickles and logs (default <out_dir>/submitit)", None),
        "additional_parameters": ("extra #SBATCH options, e.g. {account: abc, qos: high, constraint: a100}", {}),
        "setup": ("shell lines run in the job before the cell, e.g. ['module load cuda', 'source .venv/bin/activate']",
                  []),
        "signal_delay_s": ("seconds between the requeue signal and the time limit (time to save last.ckpt)", 120),
        "max_num_timeout": ("how many times a job that hits its time limit is requeued", 3),
        "poll_s": ("seconds between checks of the jobs' states", None),
    }
    ALIASES = {"slurm_additional_parameters": "additional_parameters", "name": "job_name", "timeout_min": "time",
               "partition_name": "partition"}

    @classmethod
    def validate(cls, options: dict[str, Any] | None) -> dict[str, Any]:
        """The options with defaults filled in; StudyError naming the first bad key."""
        from lightning_maskprior.study.spec import StudyError

        given = {cls.ALIASES.get(k, k): v for k, v in (options or {}).items()}
        unknown = sorted(set(given) - set(cls.OPTIONS))
        if unknown:
            raise StudyError(f"slurm: unknown key(s) {unknown}; expected some of "
                             f"{sorted(cls.OPTIONS)}")
        opts = {k: given.get(k, default) for k, (_, default) in cls.OPTIONS.items()}
        if opts["cluster"] not in ("slurm", "local"):
            raise StudyError(f"slurm.cluster: 'slurm' or 'local', got {opts['cluster']!r}")
        for key in ("gpus_per_node",):
            if opts[key] is not None:
                _positive_int(opts[key], key, allow_zero=True)
        for key in ("cpus_per_task", "time", "array_parallelism"):
            if opts[key] is not None:
                _positive_int(opts[key], key)
        for key in ("signal_delay_s", "max_num_timeout"):
            _positive_int(opts[key], key, allow_zero=True)
        for key in ("mem_gb", "poll_s"):
            value = opts[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise StudyError(f"slurm.{key}: must be a positive number, got {value!r}")
        for key in ("partition", "job_name", "log_folder"):
            if opts[key] is not None and not isinstance(opts[key], str | os.PathLike):
                raise StudyError(f"slurm.{key}: must be a string, got {opts[key]!r}")
        if not isinstance(opts["additional_parameters"], dict):
            raise StudyError(f"slurm.additional_parameters: must be a mapping of sbatch options, "
                             f"got {opts['additional_parameters']!r}")
        setup = opts["setup"]
        if isinstance(setup, str):
            setup = [setup]
        if not isinstance(setup, list) or not all(isinstance(line, str) for line in setup):
            raise StudyError(f"slurm.setup: must be a list of shell lines, got {opts['setup']!r}")
        opts["setup"] = setup
        return opts

    def __init__(self, study) -> None:
        super().__init__(study)
        from lightning_maskprior.study.spec import StudyError

        if DelayedSubmission is None:
            raise StudyError(f"launcher slurm needs submitit: {INSTALL_HINT}")
        self.options = self.validate(getattr(study, "launcher_options", None))
        self.local = self.options["cluster"] == "local"
        gpus = self.options["gpus_per_node"]
        self.gpus = gpus if gpus is not None else (getattr(study, "gpus_per_run", None) or 0)
        cpus = self.options["cpus_per_task"]
        self.threads = cpus if cpus is not None else (study.threads_per_run if self.local else 1)
        study.threads_per_run = self.threads  # the cells' OMP_NUM_THREADS (run.json), not this machine's cores
        self.poll_s = self.options["poll_s"] or (1.0 if self.local else 15.0)
        self.log_folder = Path(self.options["log_folder"] or study.out_dir / "submitit").expanduser().resolve()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.live: list[tuple[Any, Any]] = []  # (submitit job, run)

    def describe(self) -> str:
        """One line for the study's log."""
        o = self.options
        where = "submitit's LocalExecutor on this machine" if self.local else f"SLURM partition {o['partition']}"
        return (f"one job per run on {where}, {self.gpus} GPU(s) and OMP_NUM_THREADS={self.threads} per job, "
                f"time {o['time']} min, logs in {self.log_folder}")

    # ------------------------------------------------------------------------------------ submission
    def executor(self):
        """The submitit executor with this study's parameters (creates the log folder)."""
        import submitit

        from lightning_maskprior.study.spec import StudyError

        o = self.options
        if self.local:
            executor = submitit.LocalExecutor(self.log_folder, max_num_timeout=o["max_num_timeout"])
            executor.update_parameters(timeout_min=o["time"], gpus_per_node=self.gpus, tasks_per_node=1, nodes=1,
                                       signal_delay_s=o["signal_delay_s"])
            return executor
        if shutil.which("sbatch") is None:
            raise StudyError("launcher slurm: no sbatch on this machine; run the study on a SLURM login node, or "
                             "set slurm.cluster: local to try it here")
        executor = submitit.AutoExecutor(self.log_folder, cluster="slurm", slurm_max_num_timeout=o["max_num_timeout"])
        params: dict[str, Any] = {
            "name": o["job_name"], "timeout_min": o["time"], "nodes": 1, "tasks_per_node": 1,
            "gpus_per_node": self.gpus, "cpus_per_task": o["cpus_per_task"], "mem_gb": o["mem_gb"],
            "slurm_partition": o["partition"], "slurm_signal_delay_s": o["signal_delay_s"],
            "slurm_additional_parameters": dict(o["additional_parameters"]) or None,
            "slurm_setup": list(o["setup"]) or None,
        }
        if o["array_parallelism"] is not None:
            params["slurm_array_parallelism"] = o["array_parallelism"]
        executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
        return executor

    def run(self, runs: list, on_result: OnResult) -> None:
        if not runs:
            return
        executor = self.executor()
        job_fn = CellJob(self.threads)
        queue = list(runs)
        limit = (self.options["array_parallelism"] or self.study.parallel) if self.local else len(queue)
        try:
            if not self.local:  # one array: SLURM queues the jobs and runs array_parallelism at a time
                with self.lock:
                    if self.stopping.is_set():
                        return
                    jobs = executor.map_array(job_fn, [str(run.dir) for run in queue],
                                              [cell_command(run.dir) for run in queue])
                    self.live = list(zip(jobs, queue, strict=True))
                queue = []
            while True:
                while queue and len(self.live) < limit:
                    with self.lock:
                        if self.stopping.is_set():
                            break
                        run = queue.pop(0)
                        self.live.append((executor.submit(job_fn, str(run.dir), cell_command(run.dir)), run))
                with self.lock:
                    finished = [job.done() for job, _ in self.live]
                    ended = [pair for pair, done in zip(self.live, finished, strict=True) if done]
                    self.live = [pair for pair, done in zip(self.live, finished, strict=True) if not done]
                for job, run in ended:
                    on_result(run, self._result(job, run))
                if self.stopping.is_set() or (not self.live and not queue):
                    return
                if not ended:
                    time.sleep(self.poll_s)
        except BaseException:
            self.stop()
            raise

    def _result(self, job, run) -> dict:
        """The run's result.json; a job that ended without one (killed, requeued too often) gets one now."""
        returncode, error = None, ""
        try:
            returncode = job.result()
        except Exception as err:  # noqa: BLE001  (submitit's UncompletedJobError / FailedJobError)
            error = f"SLURM job {job.job_id}: {err}"[-4000:]
        if not isinstance(returncode, int):
            returncode = None
        if not error and returncode != 0:
            from lightning_maskprior.study.cell import tail

            error = tail(run.dir / "cell.log")
        return finished_result(run, returncode, error)

    def stop(self) -> None:
        """Stop every live job: its cell gets SIGTERM, saves ``last.ckpt`` and records itself as interrupted."""
        with self.lock:
            self.stopping.set()
            live = list(self.live)
        for job, _ in live:
            try:
                if self.local:
                    if job._process is not None and job._process.poll() is None:
                        job._process.send_signal(signal.SIGTERM)  # the controller passes it on to the job
                else:
                    job.cancel(check=False)  # scancel: SLURM sends SIGTERM to every process of the job
            except Exception:  # noqa: BLE001  (a job that already ended)
                pass
        deadline = time.time() + STOP_TIMEOUT_S + 10
        while live and time.time() < deadline:
            live = [(job, run) for job, run in live if not job.done()]
            if live:
                time.sleep(0.5)
        for job, _ in live:  # still running after the grace period
            try:
                job.cancel(check=False)
            except Exception:  # noqa: BLE001
                pass

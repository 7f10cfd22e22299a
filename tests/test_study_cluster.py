"""``maskprior study`` on existing engines: SLURM through submitit (its LocalExecutor here) and Ray (a local
instance), end to end on tiny runs. Each gives the same table as the local launcher, also when a run is
preempted and requeued (SLURM) or its worker dies and the task is retried (Ray): the run resumes from its
``last.ckpt``. Needs the ``cluster`` extra (``pip install -e ".[cluster]"``); skipped without it.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, TINY_BOOLEAN
from lightning_maskprior.study import StudyError, load_study, run_study
from lightning_maskprior.study.launchers import get_launcher

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the runs' processes in /proc")

# 150 one-step epochs: a few seconds of training, long enough to interrupt a run in the middle.
TINY = [
    *TINY_BOOLEAN,
    "--trainer.max_epochs", "150", "--trainer.check_val_every_n_epoch", "10",
    "--trainer.enable_model_summary", "false", "--trainer.callbacks", "null",
]
TIMEOUT_S = 300


def tiny_study(out_dir: Path, launcher: str, options: dict | None = None) -> dict:
    """2parity x (default, mask) x seed 0: two runs, fit only (the cell's test stage is launcher-independent)."""
    return {
        "tasks": [{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")}],
        "inits": ["default", "mask"],
        "seeds": [0],
        "seed_args": ["--seed_everything", "--data.init_args.seed"],
        "args": TINY,
        "metrics": [{"tag": "val/mse", "label": "MSE", "paper": "mse"},
                    {"tag": "val/acc", "label": "acc %", "scale": 100, "digits": 2, "paper": "acc"}],
        "paper_tables": ["1"],
        "test": False,
        "parallel": 2,
        "threads_per_run": 1,
        "gpus_per_run": 0,
        "launcher": launcher,
        launcher: options or {},  # the study file's `slurm:` / `ray:` mapping (ignored by the local launcher)
        "out_dir": str(out_dir),
    }


def numeric_table(out_dir: Path) -> dict[str, dict[str, float | None]]:
    """table.csv's numbers (mean, std, n, paper of every init and metric), per task."""
    with open(out_dir / "table.csv") as f:
        return {row.pop("task"): {k: (float(v) if v else None) for k, v in row.items()} for row in csv.DictReader(f)}


def results(out_dir: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(out_dir)): json.loads(p.read_text()) for p in out_dir.glob("*/*/*/result.json")}


# ------------------------------------------------------------------------------------ processes in /proc
def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def cell_pid(run_dir: Path) -> int | None:
    """The live cell process of ``run_dir`` (python -m lightning_maskprior.study.cell <run_dir>)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            argv = _cmdline(int(entry.name))
            if "lightning_maskprior.study.cell" in argv and str(run_dir) in argv:
                return int(entry.name)
    return None


def wait_for(condition, what: str, timeout: float = TIMEOUT_S, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def training_started(run_dir: Path) -> bool:
    """An epoch checkpoint exists: the fit is in its training loop (its SIGTERM handler is installed)."""
    return any(run_dir.glob("lightning_logs/version_*/checkpoints/epoch=*.ckpt"))


class StudyThread(threading.Thread):
    """``run_study`` in the background, so the test can signal its runs' processes meanwhile."""

    def __init__(self, study: dict) -> None:
        super().__init__(daemon=True)
        self.study, self.lines, self.error, self.failed = load_study(study), [], None, None

    def run(self) -> None:
        try:
            self.failed = run_study(self.study, log=lambda line, **kw: self.lines.append(line))
        except BaseException as err:  # noqa: BLE001  (re-raised in finish)
            self.error = err

    def finish(self) -> int:
        self.join(TIMEOUT_S)
        assert not self.is_alive(), "the study did not finish:\n" + "\n".join(self.lines)
        if self.error is not None:
            raise self.error
        return self.failed


@pytest.fixture(scope="module")
def submitit_installed():
    """Skips (before the costly fixtures) without submitit."""
    return pytest.importorskip("submitit")


@pytest.fixture(scope="module")
def local_table(tmp_path_factory):
    """The local launcher's table for the tiny study: what every engine must reproduce."""
    out = tmp_path_factory.mktemp("local") / "out"
    assert run_study(load_study(tiny_study(out, "local")), log=lambda line, **kw: None) == 0
    assert all(r["status"] == "ok" for r in results(out).values())
    return numeric_table(out)


# -------------------------------------------------------------------------------- options (no runs)
def test_cluster_launcher_options_are_checked(tmp_path):
    pytest.importorskip("submitit")
    pytest.importorskip("ray")
    for launcher, options, message in [
        ("slurm", {"partitoin": "gpu"}, "slurm: unknown key(s) ['partitoin']"),
        ("slurm", {"cluster": "pbs"}, "slurm.cluster"),
        ("slurm", {"time": "1h"}, "slurm.time"),
        ("slurm", {"additional_parameters": ["--qos=high"]}, "slurm.additional_parameters"),
        ("ray", {"num_gpu": 1}, "ray: unknown key(s) ['num_gpu']"),
        ("ray", {"num_cpus": -1}, "ray.num_cpus"),
        ("ray", {"address": 6379}, "ray.address"),
    ]:
        study = load_study(tiny_study(tmp_path / "out", launcher, options))
        with pytest.raises(StudyError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            get_launcher(launcher)(study)
    ray_launcher = get_launcher("ray")(load_study(tiny_study(tmp_path / "out", "ray", {"num_cpus": 2})))
    assert ray_launcher.init_kwargs()["num_cpus"] == 4  # a local instance: parallel (2) runs of 2 CPUs
    assert ray_launcher.study.threads_per_run == 2  # the cells' OMP_NUM_THREADS follow num_cpus
    joined = get_launcher("ray")(load_study(tiny_study(tmp_path / "out", "ray", {"address": "auto"})))
    assert joined.init_kwargs()["address"] == "auto" and "num_cpus" not in joined.init_kwargs()
    # launcher_options (e.g. given on the command line) override the study file's mapping.
    study = tiny_study(tmp_path / "out", "ray", {"address": "auto", "num_cpus": 2})
    study["launcher_options"] = {"num_cpus": 3}
    assert get_launcher("ray")(load_study(study)).options == {**joined.options, "num_cpus": 3}
    with pytest.raises(StudyError, match=r"ray: expected dict\[str, typing.Any\] or null, got .*auto"):
        load_study({**tiny_study(tmp_path / "out", "ray"), "ray": ["auto"]})


def test_slurm_options_become_the_sbatch_script(tmp_path, monkeypatch):
    """The study file's knobs as submitit writes them into the job array's sbatch script (no SLURM needed)."""
    pytest.importorskip("submitit")
    import shutil

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}" if name in ("srun", "sbatch")
                        else real_which(name, *a, **k))
    options = {"partition": "gpu", "gpus_per_node": 1, "cpus_per_task": 8, "mem_gb": 32, "time": 720,
               "array_parallelism": 16, "job_name": "table1", "setup": ["source .venv/bin/activate"],
               "slurm_additional_parameters": {"account": "abc", "qos": "high"}}
    launcher = get_launcher("slurm")(load_study(tiny_study(tmp_path / "out", "slurm", options)))
    executor = launcher.executor()
    executor._executor.parameters["map_count"] = 4  # what map_array sets for an array of 4 runs
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    for line in ["#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --mem=32GB", "#SBATCH --time=720", "#SBATCH --array=0-3%4", "#SBATCH --job-name=table1",
                 "#SBATCH --account=abc", "#SBATCH --qos=high", "#SBATCH --signal=USR2@120",
                 "#SBATCH --ntasks-per-node=1", "source .venv/bin/activate"]:
        assert line in script, f"{line!r} not in\n{script}"
    assert launcher.log_folder == (tmp_path / "out" / "submitit").resolve()
    assert launcher.study.threads_per_run == 8  # OMP_NUM_THREADS = cpus_per_task


# ------------------------------------------------------------------------- SLURM (submitit's LocalExecutor)
@pytest.mark.slow  # about 2.5 minutes: a preempted, requeued SLURM job end to end
def test_slurm_launcher_requeues_preempted_runs_and_matches_the_local_table(tmp_path, submitit_installed, local_table):
    """Both runs are interrupted mid-training as SLURM would: one preempted (SIGTERM to every process, then
    submitit's USR2), one at its time limit (USR2 only: the job's checkpoint() stops the cell). submitit
    requeues both, the cells resume from last.ckpt, and the table equals the local launcher's."""
    from submitit.core.job_environment import JobEnvironment

    requeue_signal = JobEnvironment._usr_sig()  # USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise
    out = tmp_path / "out"
    study = StudyThread(tiny_study(out, "slurm", {"cluster": "local", "time": 15}))
    study.start()
    preempted, timed_out = out / "2parity/default/seed0", out / "2parity/mask/seed0"
    for run_dir in (preempted, timed_out):
        wait_for(lambda run_dir=run_dir: training_started(run_dir), f"{run_dir} to train")
    cells = {run_dir: cell_pid(run_dir) for run_dir in (preempted, timed_out)}
    jobs = {run_dir: _ppid(pid) for run_dir, pid in cells.items()}
    assert all(cells.values()) and all("submitit.core._submit" in " ".join(_cmdline(j)) for j in jobs.values())
    # SLURM's preemption: SIGTERM to every process of the job (submitit's job process ignores it; here, with no
    # SLURM, a SIGTERM to the job is the study's stop, so only the cell gets it), then submitit's signal.
    os.kill(cells[preempted], signal.SIGTERM)
    time.sleep(0.5)
    os.kill(jobs[preempted], requeue_signal)  # ...then submitit's signal: checkpoint and requeue
    os.kill(jobs[timed_out], requeue_signal)  # time limit: only submitit's signal
    assert study.finish() == 0

    by_run = results(out)
    assert all(r["status"] == "ok" for r in by_run.values()), by_run
    for name in ("2parity/default/seed0", "2parity/mask/seed0"):
        result = by_run[name]
        assert result["attempts"] == 2 and "--ckpt_path" in result["commands"][0], result
        assert result["resumed_from"].endswith("last.ckpt")
    logs = "".join(p.read_text() for p in (out / "submitit").glob("*_log.*"))
    assert logs.count("Requeued job") == 2 and "this job is preempted" in logs
    assert numeric_table(out) == local_table


# ----------------------------------------------------------------------------------- Ray (a local instance)
@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance for the module (starting one takes seconds); the launcher joins it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 1024**2)
    yield ray
    ray.shutdown()


@pytest.mark.slow  # about 1.5 minutes: a lost Ray worker end to end
def test_ray_launcher_retries_a_lost_worker_and_matches_the_local_table(tmp_path, ray_instance, local_table):
    """One Ray task per run; the worker of one run is killed mid-training (as when a node dies): Ray runs the
    task again, the new cell resumes from the last.ckpt the old one saved, and the table equals the local one."""
    out = tmp_path / "out"
    study = StudyThread(tiny_study(out, "ray", {"num_cpus": 1, "max_retries": 2}))
    study.start()
    lost = out / "2parity/mask/seed0"
    wait_for(lambda: training_started(lost), f"{lost} to train")
    cell = cell_pid(lost)
    worker = _ppid(cell)
    assert "ray" in " ".join(_cmdline(worker)).lower()
    # Ray kills the dead worker's children (the cell); the cell's fit gets SIGTERM (PDEATHSIG), saves last.ckpt.
    os.kill(worker, signal.SIGKILL)
    assert study.finish() == 0

    by_run = results(out)
    assert all(r["status"] == "ok" for r in by_run.values()), by_run
    resumed = by_run["2parity/mask/seed0"]
    assert "--ckpt_path" in resumed["commands"][0] and resumed["resumed_from"].endswith("last.ckpt"), resumed
    assert "--ckpt_path" not in by_run["2parity/default/seed0"]["commands"][0]
    assert numeric_table(out) == local_table

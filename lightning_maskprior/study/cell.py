"""One run of a study as one self-contained command: ``python -m lightning_maskprior.study.cell <run_dir>``.

The study writes ``<run_dir>/run.json`` (the fit arguments, whether to test, the run's key, the threads).
The cell fits (resuming from ``lightning_logs/version_*/checkpoints/last.ckpt`` when the directory holds
one), tests the final checkpoint, and writes ``<run_dir>/result.json`` atomically, wherever it runs (a local
process, a SLURM job, a Ray task), so ``maskprior study --table_only true`` builds the table from it. The fit
also saves ``<run_dir>/attention_maps.npz`` (callbacks/attention_record.py: attention at the start and the end
of training), and result.json records the precision the fit ran in.
Fit and test run as child processes that get the cell's SIGTERM / SIGINT (they save ``last.ckpt``) and
die with it. The cell's exit code is the run's (lightning_maskprior.run.status): 0 ok, 3 diverged,
143 / 130 interrupted, anything else failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_maskprior.run import atomic
from lightning_maskprior.run.rundir import RunDir, StudyRunDir
from lightning_maskprior.run.status import FINISHED, status_from_returncode

if TYPE_CHECKING:
    from lightning_maskprior.study.spec import Run

STDERR_TAIL_LINES = 25
CELL_LOCK_WAIT_SECONDS = 120  # a cell of a study that was just stopped may still be saving its last.ckpt


# Runs in the child between fork and the command (an exec trampoline, not a ``preexec_fn``, which is unsafe in
# threaded processes such as Ray workers): ignore the signals named in argv[1] (an ignored signal stays ignored
# across exec), ask Linux to SIGTERM this process when the process argv[2] dies (even by SIGKILL), then exec.
_TRAMPOLINE = """\
import os, signal, sys
for name in filter(None, sys.argv[1].split(',')):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
if sys.platform.startswith('linux'):
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(sys.argv[2]):
        sys.exit(143)  # the starter died before prctl took effect: nobody would stop this process
os.execv(sys.argv[3], sys.argv[3:])
"""


def start_child(command: list[str], ignore: tuple[str, ...] = (), **popen_kwargs: Any) -> subprocess.Popen:
    """``Popen(command)`` whose process gets SIGTERM when this process dies, even by SIGKILL (Linux PDEATHSIG).

    ``command[0]`` is the executable's path (e.g. ``sys.executable``). ``ignore``: signal names the child
    and everything it starts ignore (e.g. ``("SIGUSR2",)``, submitit's requeue signal). The signal fires when
    the *thread* that started the child exits, so start children from a thread that outlives them.
    """
    return subprocess.Popen([sys.executable, "-c", _TRAMPOLINE, ",".join(ignore), str(os.getpid()), *command],
                            **popen_kwargs)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically: a reader sees the whole file or none (a cell killed mid-write leaves no half file)."""
    atomic.write_text(path, json.dumps(data, indent=2))  # makes the directory: a deleted run directory comes back


def record_args(path: Path) -> list[str]:
    """CLI options appending to the fit's ``trainer.callbacks`` an AttentionRecord writing ``path``
    (named here, not imported: the cell stays free of torch and Lightning)."""
    spec = {"class_path": "lightning_maskprior.callbacks.AttentionRecord", "init_args": {"path": str(path)}}
    return [f"--trainer.callbacks+={json.dumps(spec)}"]


def persistence_args(options: dict[str, Any] | None) -> list[str]:
    """CLI options appending a PriorPersistence with ``options`` (the study's ``persistence``) to the fit's
    callbacks; none without options. A config's own PriorPersistence comes first and is the one that measures."""
    if options is None:
        return []
    spec = {"class_path": "lightning_maskprior.callbacks.PriorPersistence", "init_args": options}
    return [f"--trainer.callbacks+={json.dumps(spec)}"]


@contextlib.contextmanager
def cell_lock(run_dir: Path, wait: float | None = None):
    """Hold the run directory's lock, waiting up to ``wait`` seconds (default CELL_LOCK_WAIT_SECONDS) for a cell
    still executing the run (one of a stopped study, or an old job of a requeued one); RuntimeError if it does
    not end."""
    from filelock import FileLock, Timeout

    wait = CELL_LOCK_WAIT_SECONDS if wait is None else wait
    lock = FileLock(StudyRunDir(run_dir).lock, timeout=wait)
    try:
        lock.acquire()
    except Timeout:
        raise RuntimeError(f"{run_dir} is still being executed by another process after {wait:.0f} s "
                           f"(it holds {StudyRunDir(run_dir).lock}); stop it first") from None
    try:
        yield
    finally:
        lock.release()


def read_json(path: Path) -> dict | None:
    """A JSON object from ``path``; None when the file is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def prepare_run(run: Run, threads: int | None = None) -> str:
    """Make ``run.dir`` ready for its cell and write its ``run.json``; say what was there.

    Returns ``"new"``; ``"resume"``: an interrupted run of the same fingerprint (same command and config
    contents, wherever the configs lie) whose checkpoint is kept, the cell continues it; or ``"redo"``: the
    directory was deleted (another run, a failed run retried, a run killed before its first checkpoint, or no
    run.json: an older layout).
    """
    state = "new"
    if run.dir.exists():
        try:
            with cell_lock(run.dir):  # a cell still saving its checkpoint finishes first
                previous, result = read_json(run.run_path), run.load_result()
                unfinished = result is None or (run.owns(result) and result.get("status") == "interrupted")
                files = StudyRunDir(run.dir)
                resumable = files.resume_checkpoint() is not None or files.fit_done.is_file()
                if run.owns(previous) and unfinished and resumable:
                    state = "resume"
                else:
                    shutil.rmtree(run.dir)
                    state = "redo"
        except RuntimeError as err:
            from lightning_maskprior.study.spec import StudyError

            raise StudyError(f"{run.name}: {err}") from None
    run.dir.mkdir(parents=True, exist_ok=True)
    write_json(run.run_path, {"name": run.name, "task": run.task.name, "init": run.init.label,
                              "init_method": run.init.name, "seed": run.seed, "key": run.key(), "fit": run.fit_args(),
                              "test": run.study.test, "threads": threads, "persistence": run.study.persistence,
                              "skip_test_if": run.skip_test_if})
    return state



def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last ``lines`` lines of a text file ("" if it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


class _Children:
    """The cell's live child (fit or test) and the signal that asked the cell to stop, if any."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.signal: int | None = None

    def forward(self, signum: int, frame: Any = None) -> None:
        """Signal handler: remember the signal and pass it on to the child (it saves last.ckpt and exits).
        SIGINT stays SIGINT (exit 130); anything else (SIGTERM, SIGHUP) becomes SIGTERM (exit 143)."""
        signum = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        self.signal = signum
        with contextlib.suppress(Exception):
            if self.process is not None and self.process.poll() is None:
                self.process.send_signal(signum)


def _run_child(args: list[str], files: StudyRunDir, stage: str, threads: int | None, children: _Children | None,
               append: bool) -> int:
    """``maskprior <args>`` as a child process (or in this process when ``children`` is None); its stdout and
    stderr go to the run directory's ``<stage>.out`` / ``<stage>.err``. Returns the exit code."""
    mode = "a" if append else "w"
    with open(files.output(stage, "out"), mode) as out, open(files.output(stage, "err"), mode) as err:
        if children is None:
            return _run_in_process(args, out, err)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if children.signal is not None:  # asked to stop before this stage started
            return 128 + children.signal
        process = start_child([sys.executable, "-m", "lightning_maskprior.cli", *args], stdout=out, stderr=err,
                              env=env, start_new_session=True)
        children.process = process
        if children.signal is not None:  # a signal came between the check above and Popen
            children.forward(children.signal)
        try:
            return process.wait()
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            children.process = None


def _run_in_process(args: list[str], out, err) -> int:
    from lightning_maskprior.run.cli import main

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_info:
            code = exit_info.code
            return code if isinstance(code, int) else (0 if code is None else 1)
        except Exception:
            traceback.print_exc(file=err)
            return 1
    return 0


def _unless_signalled(rc: int, children: _Children | None) -> int:
    """A stage that exited 0 after the cell was asked to stop may have been cut short: count it interrupted."""
    if rc == 0 and children is not None and children.signal is not None:
        return 128 + children.signal
    return rc


def run_cell(run_dir: Path, in_process: bool = False, children: _Children | None = None) -> dict:
    """Execute the run prepared in ``run_dir`` (fit or resume, then test); write and return its result.

    ``in_process``: call the CLI in this process (the inprocess launcher; no signals are forwarded).
    """
    run_dir = Path(run_dir).resolve()
    with cell_lock(run_dir):
        return _run_cell(run_dir, in_process, children)


def _run_cell(run_dir: Path, in_process: bool, children: _Children | None) -> dict:
    files = StudyRunDir(run_dir)
    spec = read_json(files.run_record)
    if spec is None:
        raise FileNotFoundError(f"{files.run_record} is missing or unreadable; the study writes it before "
                                "launching the cell")
    children = None if in_process else (children or _Children())
    start = time.time()
    from lightning_maskprior.study.spec import format_command, same_run

    previous = read_json(files.result)
    interrupted = same_run(previous, spec["key"], spec["name"]) and previous.get("status") == "interrupted"
    earlier = previous if interrupted else {}
    result: dict[str, Any] = {
        "task": spec["task"], "init": spec["init"], "init_method": spec["init_method"], "seed": spec["seed"],
        "key": spec["key"], "commands": [], "host": socket.gethostname(), "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "threads": spec.get("threads"),
        "started_at": start, "attempts": earlier.get("attempts", 1) + 1 if earlier else 1,
    }
    fit_record = read_json(files.fit_done)
    if same_run(fit_record, spec["key"], spec["name"]):  # fitted before; the test was stopped
        rc, stage, fit_dir = 0, "fit", RunDir(fit_record["log_dir"])
        result["commands"].append(fit_record["command"])
    else:
        # Measurements outside the run's key: attention maps at the start and the end, the study's persistence.
        fit_args = [*spec["fit"], *record_args(files.maps), *persistence_args(spec.get("persistence"))]
        ckpt = files.resume_checkpoint()
        if ckpt is not None:
            fit_args += ["--ckpt_path", str(ckpt)]
            result["resumed_from"] = str(ckpt)
        result["commands"].append(format_command(fit_args))
        rc = _run_child(fit_args, files, "fit", spec.get("threads"), children, append=ckpt is not None)
        stage, fit_dir = "fit", (RunDir.of_checkpoint(ckpt) if ckpt is not None else files.fit_dir())
        rc = _unless_signalled(rc, children)
        if rc == 0 and fit_dir is not None:  # only a fit that ran to its end is not redone
            write_json(files.fit_done, {"key": spec["key"], "log_dir": str(fit_dir.path),
                                        "command": result["commands"][-1]})
    error = tail(files.output("fit", "err")) if rc != 0 else ""
    stopped = spec.get("skip_test_if")  # a file the fit writes when it stops for good early (a pruned trial's)
    if rc == 0 and spec.get("test", True) and not (stopped and Path(stopped).is_file()):
        stage = "test"
        try:
            ckpt = fit_dir.find_checkpoint() if fit_dir is not None else None
        except FileNotFoundError:
            ckpt = None
        if ckpt is None:
            rc, error = 1, f"no checkpoint found under {run_dir} to test"
        else:
            test_args = test_command(fit_dir, ckpt, run_dir)
            result["commands"].append(format_command(test_args))
            rc = _run_child(test_args, files, "test", spec.get("threads"), children, append=False)
            rc = _unless_signalled(rc, children)
            error = tail(files.output("test", "err")) if rc != 0 else ""
    status = status_from_returncode(rc)
    result["precision"] = fit_dir.precision(default=None) if fit_dir is not None else None
    end = time.time()
    result.update(status=status, stage=stage, returncode=rc, ended_at=end,
                  seconds=round(earlier.get("seconds", 0.0) + end - start, 1))
    if status in FINISHED:
        from lightning_maskprior.run.scalars import last_scalars

        result["metrics"] = last_scalars(run_dir)
    else:
        result["metrics"] = {}
    if status == "interrupted":  # stopped from outside: its stderr's last line (a warning, say) is no cause
        result["error"] = f"interrupted during {stage} (exit code {rc}); running the study again resumes it"
    elif status != "ok":
        result["error"] = error or f"exit code {rc}"
    write_json(files.result, result)
    return result


def test_command(fit_dir: RunDir, ckpt: Path, run_dir: Path) -> list[str]:
    """``maskprior test`` of a fitted run, as its record says it trained: its config.yaml, then each option a resume
    changed (changes.yaml) at its last value."""
    changed = [f"--{option}={_flow(value)}" for option, value in fit_dir.changed_options().items()]
    return ["test", "-c", str(fit_dir.config_path), *changed, "--ckpt_path", str(ckpt),
            "--trainer.default_root_dir", str(run_dir)]


def _flow(value: Any) -> str:
    """A config value as one command-line word, in YAML (``0.0005``, ``constant``, ``[0.9, 0.99]``, ``null``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_maskprior.study.cell <run_dir>``: run the cell, exit with the run's exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        print("usage: python -m lightning_maskprior.study.cell <run_dir>  (a directory holding run.json)",
              file=sys.stderr)
        return 2
    children = _Children()
    for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, children.forward)
    result = run_cell(Path(argv[0]), children=children)
    return int(result["returncode"]) if 0 <= int(result["returncode"]) < 256 else 1


if __name__ == "__main__":
    sys.exit(main())

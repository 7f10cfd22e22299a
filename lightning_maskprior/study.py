"""``maskprior study``: a grid of tasks x init methods x seeds, each an ordinary ``maskprior fit`` (+ ``test``).

    maskprior study -c configs/study/boolean_cpu.yaml
    maskprior study -c configs/study/boolean_cpu.yaml --parallel 2 --out_dir runs/my_study
    maskprior study --help

Every run gets its own directory ``<out_dir>/<task>/<init>/seed<k>/`` with its TensorBoard logs,
checkpoint, console output and a ``result.json``. A run with a ``result.json`` from the same
command is finished and skipped when the study is run again, so an interrupted study continues
where it stopped. A run that fails is recorded with the tail of its stderr; the study goes on.
While it runs, a study holds ``<out_dir>/.study.lock``, so a second study in the same directory fails
at once instead of deleting the first one's unfinished runs.
At the end (and after every run) the study writes ``table.md`` / ``table.csv`` (mean +- std over
seeds, the paper's numbers beside ours), ``results.csv`` (one row per run) and PNG plots.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_maskprior import paper_results

STDERR_TAIL_LINES = 25
MAX_PERSISTENCE_PLOTS = 16


class StudyError(ValueError):
    """A study file that cannot run; the message names the offending entry."""


# ---------------------------------------------------------------------------------------- the study file
@dataclass
class Metric:
    tag: str  # TensorBoard tag read from the run, e.g. test/acc
    label: str  # column name in the table
    scale: float = 1.0  # multiply before printing (100 for accuracies in %)
    digits: int = 4  # decimals printed
    paper: str | None = None  # key of the paper's number in paper_results.TABLES ("acc", "mse", ...)


@dataclass
class TaskEntry:
    name: str
    configs: list[Path]
    args: list[str]
    metrics: list[Metric]
    curves: list[str]
    paper: str  # task key in paper_results.TABLES


@dataclass
class InitEntry:
    name: str  # the registered init method (model.init)
    label: str  # its column / directory name
    configs: list[Path]
    args: list[str]


@dataclass
class Study:
    path: Path | None
    title: str
    tasks: list[TaskEntry]
    inits: list[InitEntry]
    seeds: list[int]
    out_dir: Path
    test: bool = True
    parallel: int = 1
    threads_per_run: int = 1
    seed_args: list[str] = field(default_factory=lambda: ["--seed_everything"])
    args: list[str] = field(default_factory=list)
    paper_tables: list[str] = field(default_factory=list)
    retry_failed: bool = True
    launcher: str = "subprocess"

    def runs(self) -> list[Run]:
        """Every cell, seed by seed: a study stopped early has the first seeds of every task and init."""
        return [Run(self, task, init, seed) for seed in self.seeds for task in self.tasks for init in self.inits]


def build_parser():
    """The ``maskprior study`` argument parser: every key of a study file is an option here."""
    import argparse

    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Keeps the description's line breaks (the examples)."""

    parser = ArgumentParser(prog="maskprior study", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-c", "--config", action=ActionConfigFile,
        help="The study file (YAML) holding the options below.")
    parser.add_argument("--title", type=str | None, default=None, help="Heading of table.md (default: the file name).")
    parser.add_argument(
        "--tasks", type=list[str | dict[str, Any]], default=[],
        help="The table's rows. Each entry is a config path (the row is named after the file) or a mapping: "
        "name (row name and directory), config (one path or a list, composed like repeated -c), "
        "args (extra CLI overrides for this task, e.g. ['--trainer.max_epochs', '2']), metrics (this row's "
        "metrics, replacing the top-level ones), curves (this row's curve tags), paper (the task's key in the "
        "paper's tables; default: name). Relative paths are looked up from the working directory, then from "
        "the study file's directory and its parents.",
    )
    parser.add_argument(
        "--inits", type=list[str | dict[str, Any]], default=[],
        help="The table's columns: init method names (registered in lightning_maskprior.inits, checked before "
        "any run) or mappings: name (the init method), label (column and directory name; default name), "
        "config (init configs to compose, e.g. configs/init/mask.yaml), args (extra overrides, e.g. "
        "['--model.init_options', '{open_value: 5, closed_value: -5}']). Each run gets --model.init <name>.",
    )
    parser.add_argument("--seeds", type=list[int], default=[],
        help="Seeds; each run passes its seed to every option in seed_args.")
    parser.add_argument(
        "--seed_args", type=list[str], default=["--seed_everything"],
        help="CLI options that receive the run's seed (e.g. also --data.init_args.seed to vary the data order).",
    )
    parser.add_argument(
        "--metrics", type=list[str | dict[str, Any]], default=[],
        help="Numbers in each cell: TensorBoard tags (last value of the run) or mappings: tag (e.g. test/acc), "
        "label (column text; default the tag), scale (e.g. 100 for percent), digits (decimals, default 4), paper "
        "(the metric's key in the paper's table, e.g. acc, mse, seq_acc). Tasks may override.",
    )
    parser.add_argument(
        "--curves", type=list[str], default=["val/acc"],
        help="Tags plotted over training per init method (mean over seeds, min-max band), one PNG per task "
        "and tag. Tags under persistence/ are plotted too whenever the runs logged them.",
    )
    parser.add_argument(
        "--paper_tables", type=list[str | int], default=[],
        help="The paper's tables to put beside ours, searched in order (1, 2, 3, 4, 6; see "
        "lightning_maskprior/paper_results.py). Empty: no paper column.",
    )
    parser.add_argument("--args", type=list[str], default=[], help="CLI overrides given to every run.")
    parser.add_argument("--test", type=bool, default=True,
        help="Run `maskprior test` on the final checkpoint after each fit.")
    parser.add_argument("--out_dir", type=str | None, default=None,
        help="Where runs and tables go (default: runs/study/<study file name>). One study at a time per "
             "directory: a second one fails naming the process that holds <out_dir>/.study.lock.")
    parser.add_argument("--parallel", type=int, default=1, help="How many runs at a time.")
    parser.add_argument(
        "--threads_per_run", type=int | None, default=None,
        help="OMP_NUM_THREADS of each run (default: CPU cores / parallel, at most an OMP_NUM_THREADS you set).",
    )
    parser.add_argument("--retry_failed", type=bool, default=True, help="Rerun runs that failed last time.")
    parser.add_argument(
        "--launcher", type=str, default="subprocess",
        help="subprocess: each run is a `maskprior` process (isolated, the default). inprocess: runs call the CLI "
        "inside this process, one at a time (for debugging and tests).",
    )
    parser.add_argument("--dry_run", type=bool, default=False,
        help="Validate the study and print the runs' commands; run nothing.")
    parser.add_argument("--table_only", type=bool, default=False,
        help="Rebuild tables and plots from finished runs; run nothing.")
    return parser


def _resolve_path(value: Any, where: str, bases: list[Path]) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise StudyError(f"{where}: config must be a path, got {value!r}")
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [base / path for base in bases]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise StudyError(f"{where}: config {str(value)!r} does not exist (looked for {looked})")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _check_keys(entry: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise StudyError(f"{where}: unknown keys {unknown}; expected some of {sorted(allowed)}")


def _check_args(value: Any, where: str) -> list[str]:
    args = _as_list(value)
    if not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in args):
        raise StudyError(f"{where}: args must be a list of strings, got {value!r}")
    return [str(a) for a in args]


def _safe_name(name: str, where: str) -> str:
    if not name or not re.fullmatch(r"[A-Za-z0-9_.+=-]+", name) or name in (".", ".."):
        raise StudyError(f"{where}: name {name!r} must be non-empty letters, digits, '_', '-', '.', '+', '='")
    return name


def _parse_metrics(values: list, where: str) -> list[Metric]:
    metrics = []
    for i, value in enumerate(values):
        at = f"{where}[{i}]"
        if isinstance(value, str):
            value = {"tag": value}
        if not isinstance(value, dict) or not isinstance(value.get("tag"), str) or "/" not in value["tag"]:
            raise StudyError(f"{at}: a metric is a TensorBoard tag like 'test/acc' or a mapping with one, "
                             f"got {value!r}")
        _check_keys(value, {"tag", "label", "scale", "digits", "paper"}, at)
        try:
            scale, digits = float(value.get("scale", 1.0)), int(value.get("digits", 4))
        except (TypeError, ValueError) as err:
            raise StudyError(f"{at}: scale must be a number and digits an integer: {err}") from err
        if digits < 0:
            raise StudyError(f"{at}: digits must be >= 0, got {digits}")
        metrics.append(Metric(value["tag"], str(value.get("label", value["tag"])), scale, digits, value.get("paper")))
    return metrics


def load_study(cfg: Any, path: Path | None = None, known_inits: set[str] | None = None) -> Study:
    """Validate a parsed study (namespace or dict) and resolve its paths; raise StudyError naming the entry.

    ``known_inits``: the init methods that exist (default: lightning_maskprior.inits.INIT_METHODS, read now,
    so methods registered by any installed code count).
    """
    cfg = cfg.as_dict() if hasattr(cfg, "as_dict") else dict(cfg)
    if known_inits is None:
        import lightning_maskprior.module  # noqa: F401  (imports every module that registers inits)
        from lightning_maskprior.inits import INIT_METHODS

        known_inits = set(INIT_METHODS)
    bases = [Path.cwd()]
    if path is not None:
        bases += [Path(path).resolve().parent, *Path(path).resolve().parent.parents]
    name = Path(path).stem if path is not None else "study"

    seeds = cfg.get("seeds") or []
    if not seeds:
        raise StudyError("seeds: give at least one seed, e.g. seeds: [0, 1, 2]")
    for i, seed in enumerate(seeds):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise StudyError(f"seeds[{i}]: a seed is a non-negative integer, got {seed!r}")
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"seeds: {seeds} repeats a seed")
    seed_args = _check_args(cfg.get("seed_args", ["--seed_everything"]), "seed_args")
    if not all(a.startswith("--") for a in seed_args):
        raise StudyError(f"seed_args: each entry is a CLI option like --seed_everything, got {seed_args}")

    top_metrics = _parse_metrics(_as_list(cfg.get("metrics")), "metrics")
    curves = [str(c) for c in _as_list(cfg.get("curves", ["val/acc"]))]
    paper_tables = [str(t) for t in _as_list(cfg.get("paper_tables"))]
    for i, table in enumerate(paper_tables):
        if table not in paper_results.TABLES:
            raise StudyError(f"paper_tables[{i}]: the paper has no table {table!r} here; expected one of "
                             f"{sorted(paper_results.TABLES)}")

    raw_tasks = cfg.get("tasks") or []
    if not raw_tasks:
        raise StudyError("tasks: give at least one task (a config path or a mapping with name and config)")
    tasks = []
    for i, entry in enumerate(raw_tasks):
        where = f"tasks[{i}]"
        if isinstance(entry, str | os.PathLike):
            entry = {"config": str(entry)}
        if not isinstance(entry, dict):
            raise StudyError(f"{where}: a task is a config path or a mapping, got {entry!r}")
        configs = _as_list(entry.get("config"))
        task_name = str(entry.get("name") or (Path(str(configs[0])).stem if configs else ""))
        where = f"tasks[{i}] ({task_name})" if task_name else where
        _check_keys(entry, {"name", "config", "args", "metrics", "curves", "paper"}, where)
        if not configs:
            raise StudyError(f"{where}: no config given")
        resolved = [_resolve_path(c, where, bases) for c in configs]
        metrics = _parse_metrics(_as_list(entry["metrics"]), f"{where}.metrics") if "metrics" in entry else top_metrics
        if not metrics:
            raise StudyError(f"{where}: no metrics to report; set metrics at the top level or in the task")
        tasks.append(TaskEntry(
            name=_safe_name(task_name, where),
            configs=resolved,
            args=_check_args(entry.get("args"), f"{where}.args"),
            metrics=metrics,
            curves=[str(c) for c in _as_list(entry.get("curves", curves))],
            paper=str(entry.get("paper", task_name)),
        ))
    _check_unique([t.name for t in tasks], "tasks")

    raw_inits = cfg.get("inits") or []
    if not raw_inits:
        raise StudyError("inits: give at least one init method, e.g. inits: [default, mask]")
    inits = []
    for i, entry in enumerate(raw_inits):
        where = f"inits[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise StudyError(f"{where}: an init is a method name or a mapping with a name, got {entry!r}")
        _check_keys(entry, {"name", "label", "config", "args"}, where)
        where = f"inits[{i}] ({entry['name']})"
        if entry["name"] not in known_inits:
            raise StudyError(f"{where}: unknown init method {entry['name']!r}; registered: {sorted(known_inits)}")
        label = str(entry.get("label", entry["name"]))
        inits.append(InitEntry(
            name=entry["name"],
            label=_safe_name(label, where),
            configs=[_resolve_path(c, where, bases) for c in _as_list(entry.get("config"))],
            args=_check_args(entry.get("args"), f"{where}.args"),
        ))
    _check_unique([init.label for init in inits], "inits (labels)")

    parallel = cfg.get("parallel", 1)
    if not isinstance(parallel, int) or parallel < 1:
        raise StudyError(f"parallel: must be a positive integer, got {parallel!r}")
    launcher = cfg.get("launcher", "subprocess")
    if launcher not in ("subprocess", "inprocess"):
        raise StudyError(f"launcher: must be 'subprocess' or 'inprocess', got {launcher!r}")
    if launcher == "inprocess" and parallel != 1:
        raise StudyError("parallel: the inprocess launcher runs one run at a time; use parallel: 1")
    threads = cfg.get("threads_per_run")
    if threads is None:
        threads = _default_threads(parallel)
    elif not isinstance(threads, int) or threads < 1:
        raise StudyError(f"threads_per_run: must be a positive integer, got {threads!r}")

    return Study(
        path=Path(path).resolve() if path is not None else None,
        title=str(cfg.get("title") or name),
        tasks=tasks,
        inits=inits,
        seeds=list(seeds),
        out_dir=Path(cfg.get("out_dir") or Path("runs") / "study" / name).resolve(),
        test=bool(cfg.get("test", True)),
        parallel=parallel,
        threads_per_run=threads,
        seed_args=seed_args,
        args=_check_args(cfg.get("args"), "args"),
        paper_tables=paper_tables,
        retry_failed=bool(cfg.get("retry_failed", True)),
        launcher=launcher,
    )


def _check_unique(names: list[str], where: str) -> None:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise StudyError(f"{where}: {repeated} appear more than once; give each entry its own name/label")


def _default_threads(parallel: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // parallel)
    user = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(user)) if user.isdigit() and int(user) > 0 else threads


# --------------------------------------------------------------------------------------------- one run
class Run:
    """One (task, init, seed) cell of the grid: its directory, its commands, its result."""

    def __init__(self, study: Study, task: TaskEntry, init: InitEntry, seed: int) -> None:
        self.study, self.task, self.init, self.seed = study, task, init, seed
        self.dir = study.out_dir / task.name / init.label / f"seed{seed}"
        self.result_path = self.dir / "result.json"

    @property
    def name(self) -> str:
        return f"{self.task.name}/{self.init.label}/seed{self.seed}"

    def fit_args(self) -> list[str]:
        args = ["fit"]
        for config in [*self.task.configs, *self.init.configs]:
            args += ["-c", str(config)]
        args += ["--model.init", self.init.name, "--trainer.enable_progress_bar", "false"]
        args += [*self.study.args, *self.task.args, *self.init.args]
        for option in self.study.seed_args:
            args += [option, str(self.seed)]
        return args + ["--trainer.default_root_dir", str(self.dir)]

    def key(self) -> dict:
        """What makes a finished run reusable: the same fit command, config file contents and test choice."""
        configs = {str(p): _file_hash(p) for p in [*self.task.configs, *self.init.configs]}
        return {"fit": self.fit_args(), "configs": configs, "test": self.study.test}

    def load_result(self) -> dict | None:
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            return None

    def is_done(self) -> bool:
        result = self.load_result()
        if result is None or result.get("key") != self.key():
            return False
        return result.get("status") == "ok" or not self.study.retry_failed


_HASHES: dict[tuple[str, float], str] = {}


def _file_hash(path: Path) -> str:
    import hashlib

    stamp = (str(path), path.stat().st_mtime)
    if stamp not in _HASHES:
        _HASHES[stamp] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return _HASHES[stamp]


def _fit_dir(run_dir: Path) -> Path | None:
    """The fit's log directory: the newest version_* under lightning_logs with a config.yaml."""
    dirs = [p.parent for p in run_dir.glob("lightning_logs/version_*/config.yaml")]
    return max(dirs, key=lambda p: p.stat().st_mtime) if dirs else None


def _final_checkpoint(log_dir: Path) -> Path | None:
    ckpts = sorted(log_dir.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    last = [p for p in ckpts if p.name == "last.ckpt"]
    return (last or ckpts or [None])[-1]


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _format_command(args: list[str]) -> str:
    import shlex

    return "maskprior " + " ".join(shlex.quote(a) for a in args)


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Interrupted(Exception):
    """The study was asked to stop (SIGTERM, SIGINT, SIGHUP)."""


class Launcher:
    """Starts the ``maskprior`` commands of runs; remembers live processes so a stop can end them."""

    def __init__(self, study: Study) -> None:
        self.study = study
        self.stopping = threading.Event()
        self.processes: set[subprocess.Popen] = set()
        self.lock = threading.Lock()

    def command(self, args: list[str], log_stem: Path) -> tuple[int, Path]:
        """Run ``maskprior <args>``; stdout and stderr go to <stem>.out / <stem>.err. Returns (rc, err path)."""
        out_path, err_path = log_stem.with_suffix(".out"), log_stem.with_suffix(".err")
        if self.study.launcher == "inprocess":
            return self._inprocess(args, out_path, err_path), err_path
        env = dict(os.environ, OMP_NUM_THREADS=str(self.study.threads_per_run), PYTHONUNBUFFERED="1")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            with self.lock:
                if self.stopping.is_set():
                    raise Interrupted
                process = subprocess.Popen([sys.executable, "-m", "lightning_maskprior.cli", *args],
                                           stdout=out, stderr=err, env=env)
                self.processes.add(process)
            try:
                rc = process.wait()
            except BaseException:  # interrupted while waiting: end the run's process too
                _end(process)
                raise
            finally:
                with self.lock:
                    self.processes.discard(process)
        if self.stopping.is_set():
            raise Interrupted
        return rc, err_path

    def _inprocess(self, args: list[str], out_path: Path, err_path: Path) -> int:
        from lightning_maskprior.cli import main

        with open(out_path, "w") as out, open(err_path, "w") as err:
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

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            processes = list(self.processes)
        for process in processes:
            _end(process)

    def execute(self, run: Run) -> dict:
        """Fit (and test) one run from scratch; write and return its result."""
        if run.dir.exists():
            shutil.rmtree(run.dir)  # a run interrupted earlier, a failed one, or one from another command
        run.dir.mkdir(parents=True)
        start = time.time()
        result: dict[str, Any] = {"task": run.task.name, "init": run.init.label, "init_method": run.init.name,
                                  "seed": run.seed, "key": run.key(), "commands": [_format_command(run.fit_args())]}
        rc, err = self.command(run.fit_args(), run.dir / "fit")
        if rc == 0 and self.study.test:
            fit_dir = _fit_dir(run.dir)
            ckpt = _final_checkpoint(fit_dir) if fit_dir else None
            if ckpt is None:
                rc, stage, error = 1, "test", f"no checkpoint found under {run.dir} to test"
            else:
                test_args = ["test", "-c", str(fit_dir / "config.yaml"), "--ckpt_path", str(ckpt),
                             "--trainer.default_root_dir", str(run.dir)]
                result["commands"].append(_format_command(test_args))
                rc, err = self.command(test_args, run.dir / "test")
                stage, error = "test", _tail(err)
        else:
            stage, error = "fit", _tail(err)
        result["seconds"] = round(time.time() - start, 1)
        if rc == 0:
            from lightning_maskprior.tensorboard import last_scalars

            result.update(status="ok", metrics=last_scalars(run.dir))
        else:
            result.update(status="failed", stage=stage, returncode=rc, error=error or f"exit code {rc}")
        tmp = run.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(run.result_path)  # atomic: a result file is complete or absent
        return result


# ------------------------------------------------------------------------------------------- the loop
def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


LOCK_NAME = ".study.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@contextlib.contextmanager
def study_lock(out_dir: Path):
    """Hold ``<out_dir>/.study.lock`` while a study runs there.

    Two studies in one directory would each take the other's unfinished runs for interrupted ones and
    delete them. A second study therefore fails at once, naming the process that holds the lock. A lock
    left behind by a process that no longer exists (a killed machine) is taken over.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = out_dir / LOCK_NAME
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pid = None
            # Our own PID in the file is stale too: containers reuse PIDs after a restart.
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                raise StudyError(
                    f"another study (process {pid}) is running in {out_dir}; wait for it to finish or stop "
                    f"it, or give this one another --out_dir (lock file: {lock})"
                ) from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        break
    else:
        raise StudyError(f"could not take the study lock {lock}")
    try:
        yield lock
    finally:
        lock.unlink(missing_ok=True)


def run_study(study: Study, log=print) -> int:
    """Run every unfinished run, then write tables and plots. Returns the number of failed runs.

    Raises StudyError when another live study holds ``<out_dir>/.study.lock``.
    """
    with study_lock(study.out_dir):
        return _run_study(study, log)


def _run_study(study: Study, log=print) -> int:
    runs = study.runs()
    todo = [run for run in runs if not run.is_done()]
    log(f"study {study.title}: {len(runs)} runs ({len(study.tasks)} tasks x {len(study.inits)} inits x "
        f"{len(study.seeds)} seeds) in {study.out_dir}")
    log(f"  {len(runs) - len(todo)} finished earlier (skipped), {len(todo)} to run, {study.parallel} at a time, "
        f"OMP_NUM_THREADS={study.threads_per_run} per run ({study.launcher})")

    launcher = Launcher(study)
    start, durations, done = time.time(), [], 0
    report_lock = threading.Lock()

    def report(run: Run, result: dict) -> None:
        nonlocal done
        with report_lock:
            done += 1
            durations.append(result["seconds"])
            remaining = len(todo) - done
            eta = statistics.mean(durations) * math.ceil(remaining / study.parallel)
            if result["status"] == "ok":
                shown = ", ".join(f"{m.tag} {result['metrics'][m.tag]:.4g}" for m in run.task.metrics
                                  if m.tag in result["metrics"])
                what = f"ok ({shown})" if shown else "ok"
            else:
                last = result["error"].strip().splitlines()[-1:] or [""]
                what = f"FAILED in {result['stage']}: {last[0][:200]}"
            log(f"[{done}/{len(todo)}] {run.name}: {what} in {_duration(result['seconds'])} | "
                f"elapsed {_duration(time.time() - start)}, ETA {_duration(eta)}", flush=True)
            write_outputs(study, plots=False)

    def work(run: Run) -> None:
        report(run, launcher.execute(run))

    def interrupt(signum, frame):
        raise Interrupted

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                previous[sig] = signal.signal(sig, interrupt)
    pool = ThreadPoolExecutor(max_workers=study.parallel) if study.parallel > 1 else None
    try:
        if pool is None:
            for run in todo:  # in the main thread: a signal interrupts the wait on the run's process
                work(run)
        else:
            pending = {pool.submit(work, run) for run in todo}
            while pending:
                finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()
    except (Interrupted, KeyboardInterrupt):
        launcher.stop()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        log(f"\ninterrupted after {done} of {len(todo)} runs; unfinished runs are redone when you rerun "
            "the same command.", flush=True)
        raise Interrupted from None
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = write_outputs(study, plots=True)
    log(f"done in {_duration(time.time() - start)}: {study.out_dir / 'table.md'}")
    if failed:
        log(f"{failed} run(s) failed; their errors are in table.md and <run>/result.json")
    return failed


# ---------------------------------------------------------------------------------------------- tables
def _stats(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample std; no std from a single value (it is undefined, not 0)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def collect(study: Study) -> dict[tuple[str, str], list[dict]]:
    """Results of finished runs (ok or failed) grouped by (task, init label)."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for run in study.runs():
        result = run.load_result()
        if result is not None and result.get("key") == run.key():
            cells.setdefault((run.task.name, run.init.label), []).append(result)
    return cells


def _paper(study: Study, task: TaskEntry, init: InitEntry, metric: Metric) -> float | None:
    if not study.paper_tables or metric.paper is None:
        return None
    return paper_results.paper_value(study.paper_tables, task.paper, init.name, metric.paper)


def table_rows(study: Study) -> list[dict[str, Any]]:
    """One row per task: for every init and metric, mean / std / n over ok seeds and the paper's number."""
    cells = collect(study)
    rows = []
    for task in study.tasks:
        row: dict[str, Any] = {"task": task.name}
        for init in study.inits:
            results = cells.get((task.name, init.label), [])
            ok = [r for r in results if r.get("status") == "ok"]
            row[(init.label, "failed")] = len(results) - len(ok)
            for metric in task.metrics:
                values = [r["metrics"][metric.tag] * metric.scale for r in ok if metric.tag in r["metrics"]]
                mean, std = _stats(values) if values else (None, None)
                row[(init.label, metric.label)] = {"mean": mean, "std": std, "n": len(values),
                                                   "paper": _paper(study, task, init, metric)}
        rows.append(row)
    return rows


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def write_outputs(study: Study, plots: bool = True) -> int:
    """Write table.md, table.csv and results.csv (and the plots); return the number of failed runs."""
    rows = table_rows(study)
    labels = {init.label: paper_results.METHOD_LABELS.get(init.name, init.label) for init in study.inits}
    metric_sets = {tuple(m.label for m in t.metrics) for t in study.tasks}
    show_paper = bool(study.paper_tables)

    lines = [f"# {study.title}", ""]
    header = ["task"]
    for init in study.inits:
        header.append(f"{labels[init.label]} (ours)")
        if show_paper:
            header.append(f"{labels[init.label]} (paper)")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task, row in zip(study.tasks, rows, strict=True):
        cells = [task.name]
        for init in study.inits:
            ours, paper = [], []
            for metric in task.metrics:
                value = row[(init.label, metric.label)]
                text = "–" if value["mean"] is None else _number(value["mean"], metric.digits)
                if value["std"] is not None:
                    text += f" ± {_number(value['std'], metric.digits)}"
                if value["mean"] is not None and value["n"] < len(study.seeds):
                    text += f" ({value['n']}/{len(study.seeds)} seeds)"
                ours.append(text)
                paper.append(_number(value["paper"], metric.digits))
            cells.append(" / ".join(ours))
            if show_paper:
                cells.append(" / ".join(paper))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for labels_of_set in sorted(metric_sets):
        tasks = [t for t in study.tasks if tuple(m.label for m in t.metrics) == labels_of_set]
        described = " / ".join(f"{m.label} [{m.tag}{f' x {m.scale:g}' if m.scale != 1 else ''}]"
                               for m in tasks[0].metrics)
        lines.append(f"- {', '.join(t.name for t in tasks)}: each cell is {described}.")
    lines.append(f"- Ours: mean ± sample std over seeds {study.seeds} (last logged value of each run).")
    if show_paper:
        titles = "; ".join(paper_results.TABLES[t]["title"] for t in study.paper_tables)
        lines.append(f"- Paper: {paper_results.PAPER}. {titles}. – where the paper has no number.")

    failures = []
    for run in study.runs():
        result = run.load_result()
        if result is not None and result.get("key") == run.key() and result.get("status") == "failed":
            failures.append((run, result))
    if failures:
        lines += ["", "## Failed runs", ""]
        for run, result in failures:
            lines += [f"### {run.name} ({result['stage']}, exit code {result['returncode']})", "", "```",
                      result["error"], "```", ""]
    (study.out_dir / "table.md").write_text("\n".join(lines) + "\n")

    with open(study.out_dir / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        columns = []
        for init in study.inits:
            for label in dict.fromkeys(m.label for t in study.tasks for m in t.metrics):
                columns.append((init.label, label))
        writer.writerow(["task"] + [f"{i}:{m}:{k}" for i, m in columns for k in ("mean", "std", "n", "paper")])
        for row in rows:
            out = [row["task"]]
            for column in columns:
                value = row.get(column) or {"mean": None, "std": None, "n": "", "paper": None}
                out += ["" if value[k] is None else value[k] for k in ("mean", "std", "n", "paper")]
            writer.writerow(out)

    with open(study.out_dir / "results.csv", "w", newline="") as f:
        tags = sorted({m.tag for t in study.tasks for m in t.metrics})
        writer = csv.writer(f)
        writer.writerow(["task", "init", "seed", "status", "seconds", *tags, "error"])
        for run in study.runs():
            result = run.load_result()
            if result is None or result.get("key") != run.key():
                writer.writerow([run.task.name, run.init.label, run.seed, "pending", "", *[""] * len(tags), ""])
                continue
            metrics = result.get("metrics", {})
            error = result.get("error", "").strip().splitlines()[-1:] or [""]
            writer.writerow([run.task.name, run.init.label, run.seed, result["status"], result.get("seconds", ""),
                             *[metrics.get(t, "") for t in tags], error[0]])
    if plots:
        write_plots(study)
    return len(failures)


# ----------------------------------------------------------------------------------------------- plots
def _mean_curve(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    by_step: dict[int, list[float]] = {}
    for points in series:
        for step, value in points:
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (steps, [statistics.mean(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
            [max(by_step[s]) for s in steps])


def write_plots(study: Study) -> list[Path]:
    """Per task: each curve tag, and every persistence/* tag, over training, one line per init method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_maskprior.tensorboard import read_scalars

    plot_dir = study.out_dir / "plots"
    plot_dir.mkdir(exist_ok=True)
    written = []
    for task in study.tasks:
        scalars: dict[str, list[dict]] = {}  # init label -> per seed {tag: points}
        for init in study.inits:
            for seed in study.seeds:
                run = Run(study, task, init, seed)
                result = run.load_result()
                if result is not None and result.get("status") == "ok" and result.get("key") == run.key():
                    scalars.setdefault(init.label, []).append(read_scalars(run.dir))
        if not scalars:
            continue
        present = {tag for seeds in scalars.values() for s in seeds for tag in s}
        persistence = sorted(t for t in present if t.startswith("persistence/"))
        # Per-layer / per-head tags can number in the hundreds: plot the summaries (persistence/<name>)
        # when the callback logs them, else the first MAX_PERSISTENCE_PLOTS tags.
        summaries = [t for t in persistence if t.count("/") == 1]
        persistence = (summaries or persistence)[:MAX_PERSISTENCE_PLOTS]
        groups = [(tag, [tag]) for tag in task.curves if tag in present]
        if persistence:
            groups.append(("persistence", persistence))
        for name, tags in groups:
            cols = min(4, len(tags))
            rows = math.ceil(len(tags) / cols)
            fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
            for ax, tag in zip(axes.flat, tags, strict=False):
                for index, init in enumerate(study.inits):
                    series = [s[tag] for s in scalars.get(init.label, []) if tag in s]
                    if not series:
                        continue
                    color = f"C{index % 10}"  # one colour per init method in every panel, even where one is missing
                    steps, mean, low, high = _mean_curve(series)
                    ax.plot(steps, mean, color=color, label=paper_results.METHOD_LABELS.get(init.name, init.label),
                            marker="o" if len(steps) <= 12 else None, markersize=3)  # a lone point shows
                    if len(series) > 1:
                        ax.fill_between(steps, low, high, color=color, alpha=0.2)
                ax.set_title(tag, fontsize=9)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
            for ax in list(axes.flat)[len(tags):]:
                ax.axis("off")
            axes.flat[0].legend(fontsize=8)
            fig.suptitle(f"{task.name} (mean over seeds, band: min-max)")
            fig.tight_layout()
            path = plot_dir / f"{task.name}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


# ------------------------------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> None:
    """``maskprior study``: parse, validate the whole study, then run it."""
    parser = build_parser()
    cfg = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    files = [p for p in (cfg.get("config") or []) if p is not None]
    path = Path(str(files[-1])) if files else None
    if path is None and not cfg.get("tasks"):
        parser.error("give a study file: maskprior study -c configs/study/<name>.yaml (see --help)")
    options = {k: v for k, v in cfg.as_dict().items() if k not in ("config", "dry_run", "table_only")}
    try:
        study = load_study(options, path)
    except StudyError as err:
        parser.error(f"{path or 'study'}: {err}")
    if cfg.dry_run:
        runs = study.runs()
        print(f"study {study.title}: {len(runs)} runs, valid; commands:")
        for run in runs:
            status = "finished" if run.is_done() else "to run"
            print(f"[{status}] {run.name}: {_format_command(run.fit_args())}")
        return
    if cfg.table_only:
        study.out_dir.mkdir(parents=True, exist_ok=True)
        write_outputs(study)
        print(study.out_dir / "table.md")
        return
    try:
        failed = run_study(study)
    except Interrupted:
        sys.exit(130)
    except StudyError as err:
        parser.error(str(err))
    print("\n" + (study.out_dir / "table.md").read_text())
    if failed:
        sys.exit(1)

"""The study file: its entries (tasks, inits, metrics), validation, and the grid of runs it defines.

``load_study`` checks the whole file before anything runs and raises StudyError naming the entry;
``check_commands`` (``--dry_run``) also parses every run's full ``maskprior fit`` command.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_maskprior.run import config_files
from lightning_maskprior.run.rundir import StudyRunDir
from lightning_maskprior.run.status import FINISHED
from lightning_maskprior.study import paper_results


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
    better: str = "higher"  # which way is better ("higher", "lower"; "none": a count, nothing bold): the table
    # bolds the best mean per task


LOWER_IS_BETTER = ("mse", "loss", "ppl", "perplexity", "error", "drift", "seconds")


def default_better(tag: str) -> str:
    """``lower`` for errors (MSE, loss, perplexity) and costs (seconds), ``higher`` for the rest (accuracies)."""
    return "lower" if any(word in tag.lower() for word in LOWER_IS_BETTER) else "higher"


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
    replace_out_dir: bool = False  # run in an out_dir that holds another study's runs (they are redone)
    results_from: list[Path] = field(default_factory=list)  # result directories whose finished rows stand for
    # runs not run here (the first directory with a row of the run's fingerprint gives it)
    launcher: str = "local"
    gpus_per_run: int | None = None  # None: the launcher's default (local: 1 when CUDA is present, else 0)
    launcher_options: dict[str, Any] = field(default_factory=dict)  # the launcher's own settings

    def runs(self) -> list[Run]:
        """Every cell, seed by seed: a study stopped early has the first seeds of every task and init."""
        return [Run(self, task, init, seed) for seed in self.seeds for task in self.tasks for init in self.inits]


def _resolve_path(value: Any, where: str, bases: list[Path]) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise StudyError(f"{where}: config must be a path, got {value!r}")
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [base / path for base in bases]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    packaged = None if path.is_absolute() else config_files.packaged(path)  # e.g. boolean/2parity.yaml
    if packaged is not None:
        return packaged.resolve()
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
        _check_keys(value, {"tag", "label", "scale", "digits", "paper", "better"}, at)
        try:
            scale, digits = float(value.get("scale", 1.0)), int(value.get("digits", 4))
        except (TypeError, ValueError) as err:
            raise StudyError(f"{at}: scale must be a number and digits an integer: {err}") from err
        if digits < 0:
            raise StudyError(f"{at}: digits must be >= 0, got {digits}")
        better = value.get("better", default_better(value["tag"]))
        if better not in ("higher", "lower", "none"):
            raise StudyError(f"{at}: better must be 'higher', 'lower' or 'none', got {better!r}")
        metrics.append(Metric(value["tag"], str(value.get("label", value["tag"])), scale, digits, value.get("paper"),
                              better))
    return metrics


def load_study(cfg: Any, path: Path | None = None, known_inits: set[str] | None = None) -> Study:
    """Validate a parsed study (namespace or dict) and resolve its paths; raise StudyError naming the entry.

    ``known_inits``: the init methods that exist (default: lightning_maskprior.inits.INIT_METHODS, read now,
    so methods registered by any installed code count); one named by import path (``my_pkg.inits:my_init``) is
    imported and checked against the init contract.
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
            from lightning_maskprior.plugins import is_import_path, resolve

            if not is_import_path(entry["name"]):
                raise StudyError(f"{where}: unknown init method {entry['name']!r}; registered: {sorted(known_inits)}, "
                                 "or module.path:function of your own")
            try:  # an init method of your own, by import path: importable here, and of the init contract
                resolve("init", entry["name"])
            except ValueError as err:
                raise StudyError(f"{where}: {err}") from None
        label = str(entry.get("label", entry["name"].rpartition(":")[2]))  # my_pkg.inits:my_init -> my_init
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
    from lightning_maskprior.study.launchers.registry import LAUNCHERS

    launcher = cfg.get("launcher", "local")
    if launcher not in LAUNCHERS:
        raise StudyError(f"launcher: unknown launcher {launcher!r}; expected one of {sorted(LAUNCHERS)}")
    if launcher == "inprocess" and parallel != 1:
        raise StudyError("parallel: the inprocess launcher runs one run at a time; use parallel: 1")
    gpus = cfg.get("gpus_per_run")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        raise StudyError(f"gpus_per_run: must be a non-negative integer (or null: the launcher's default), "
                         f"got {gpus!r}")
    options = cfg.get("launcher_options") or {}
    if not isinstance(options, dict):
        raise StudyError(f"launcher_options: must be a mapping of the launcher's settings, got {options!r}")
    own = cfg.get(launcher) if launcher in ("slurm", "ray") else None  # the study file's `slurm:` / `ray:` mapping
    if own is not None and not isinstance(own, dict):
        raise StudyError(f"{launcher}: must be a mapping of the {launcher} launcher's settings, got {own!r}")
    options = {**(own or {}), **options}  # launcher_options (e.g. on the command line) win
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
        replace_out_dir=bool(cfg.get("replace_out_dir", False)),
        results_from=_results_from(cfg.get("results_from")),
        launcher=launcher,
        gpus_per_run=gpus,
        launcher_options=dict(options),
    )


def _results_from(value: Any) -> list[Path]:
    """One result directory or a list of them (None or "": none)."""
    values = [] if value in (None, "") else [value] if isinstance(value, (str, Path)) else value
    if not isinstance(values, (list, tuple)):
        raise StudyError(f"results_from: {value!r} is neither a result directory nor a list of them")
    paths = []
    for item in values:
        path = Path(str(item)).expanduser()
        if not (path / "results.csv").is_file() or not (path / "study.json").is_file():
            raise StudyError(f"results_from: {str(item)!r} is not a study's result directory (expected one holding "
                             "study.json and results.csv, e.g. docs/results/<name>)")
        paths.append(path.resolve())
    return paths


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
        files = StudyRunDir(self.dir)
        self.result_path = files.result
        self.run_path = files.run_record  # what the cell executes, written by the study before launching

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

    def fingerprint(self) -> str:
        """The key without this machine's paths (see ``fingerprint_of``): the same run gives the same fingerprint in
        another checkout, install location, out_dir or machine, so results.csv (which records it) can stand for a
        finished run whose directory is not there."""
        return fingerprint_of(self.key(), self.name)

    def owns(self, record: dict | None) -> bool:
        """Whether a run.json / result.json / fit record was written for this run: its key has this run's
        fingerprint. Compared without paths, so a study started from another install location (the configs'
        absolute paths differ, their contents do not) keeps its finished and interrupted runs."""
        return same_run(record, self.key(), self.name)

    def load_result(self) -> dict | None:
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            return None

    def is_done(self) -> bool:
        """Finished with this key: ok or diverged (a result: rerunning diverges again), or failed and not retried.
        An interrupted run is never done: the next study resumes it."""
        result = self.load_result()
        if not self.owns(result):
            return False
        status = result.get("status")
        return status in FINISHED or (status == "failed" and not self.study.retry_failed)


_HASHES: dict[tuple[str, float], str] = {}


def fingerprint_of(key: dict, name: str) -> str:
    """A run's fingerprint from its key (``Run.key``) and name: each config file by name and parsed content
    (``config_digest``), the fit command without the configs' paths and without its last argument (the run
    directory), the run's place in the grid and the test choice."""
    import hashlib

    configs = [f"{Path(p).name}:{digest}" for p, digest in key["configs"].items()]
    args = key["fit"]
    args = [a for a, previous in zip(args, ["", *args[:-1]], strict=True) if previous != "-c"][:-1]
    text = json.dumps({"configs": configs, "fit": args, "run": name, "test": key["test"]})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def same_run(record: dict | None, key: dict, name: str) -> bool:
    """Whether ``record`` (a run.json, result.json or fit record) holds a key with the fingerprint of ``key`` for the
    run ``name``: the same run, wherever its configs lie. A record of an older layout is not."""
    theirs = record.get("key") if isinstance(record, dict) else None
    try:
        return isinstance(theirs, dict) and fingerprint_of(theirs, name) == fingerprint_of(key, name)
    except (KeyError, TypeError, ValueError):
        return False


def _file_hash(path: Path) -> str:
    stamp = (str(path), path.stat().st_mtime)
    if stamp not in _HASHES:
        _HASHES[stamp] = config_digest(path.read_text())
    return _HASHES[stamp]


def config_digest(text: str) -> str:
    """The digest of a YAML config's content: of what it parses to, so an edited comment, a re-indented list or
    reordered keys leave it (and the fingerprint of every run using the file) unchanged, while any changed value
    changes it. Text that is not YAML is digested as it is."""
    import hashlib

    import yaml

    try:
        content = json.dumps(yaml.safe_load(text), sort_keys=True, default=str)
    except yaml.YAMLError:
        content = text
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def format_command(args: list[str]) -> str:
    import shlex

    return "maskprior " + " ".join(shlex.quote(a) for a in args)


def _check_fit_config(printed: str) -> None:
    """The checks a fit makes of its parsed options before it builds anything (the trainer's, the module's, the
    init options' types and ranges), on the config ``--print_config`` printed; a ValueError naming the option."""
    import yaml

    from lightning_maskprior.module import check_module_options
    from lightning_maskprior.run.checks import check_fit_options

    config = yaml.safe_load(printed) or {}
    model = config.get("model") or {}
    check_fit_options(config.get("trainer") or {}, model)
    check_module_options(model.get("init", "default"), model.get("init_options"), model.get("lr_schedule", "cosine"),
                         model.get("warmup_steps", 0), model.get("prior_weight_decay", 0.0))


def check_commands(study: Study) -> int:
    """Parse the full ``maskprior fit`` command of every distinct (task, init) with the CLI's own parser
    (``--print_config``: parses every option and config, instantiates nothing); raise StudyError naming the
    task and init whose command does not parse (a misspelled option in a task's args, a bad value).
    Returns the number of commands checked. Seeds only change seed options, so the first seed stands for all."""
    from lightning_maskprior.run.cli import main as cli_main

    checked = 0
    for task in study.tasks:
        for init in study.inits:
            run = Run(study, task, init, study.seeds[0])
            out, err = io.StringIO(), io.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    cli_main([*run.fit_args(), "--print_config"])
                code = 0
            except SystemExit as exit_info:
                code = exit_info.code if isinstance(exit_info.code, int) else (0 if exit_info.code is None else 1)
            except Exception as error:  # noqa: BLE001  (any error is the command's, report it)
                code, err = 1, io.StringIO(f"{type(error).__name__}: {error}")
            if code != 0:
                message = err.getvalue().strip() or f"exit code {code}"
                raise StudyError(f"task {task.name} x init {init.label}: the fit command does not parse: "
                                 f"{message}\n  command: {format_command(run.fit_args())}")
            try:
                _check_fit_config(out.getvalue())
            except ValueError as error:
                raise StudyError(f"task {task.name} x init {init.label}: {error}\n  command: "
                                 f"{format_command(run.fit_args())}") from None
            checked += 1
    return checked


"""The study file: its entries (tasks, inits, metrics), validation, and the grid of runs it defines.

``load_study`` checks the whole file before anything runs and raises StudyError naming the entry;
``check_commands`` (``--dry_run``) also parses every run's full ``maskprior fit`` command.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from lightning_maskprior.run import config_files
from lightning_maskprior.run.rundir import StudyRunDir
from lightning_maskprior.run.status import FINISHED
from lightning_maskprior.study import paper_results

#: The launchers a study file's ``launcher`` may name, validated here before any is imported: name ->
#: "module:Class", imported when used (slurm needs submitit, ray needs ray).
LAUNCHERS: dict[str, str] = {
    "local": "lightning_maskprior.study.launchers.local:LocalLauncher",
    "inprocess": "lightning_maskprior.study.launchers.local:InProcessLauncher",
    "slurm": "lightning_maskprior.study.launchers.slurm:SlurmLauncher",
    "ray": "lightning_maskprior.study.launchers.ray:RayLauncher",
}


class StudyError(ValueError):
    """A study file that cannot run; the message names the offending entry."""


# ---------------------------------------------------------------------------------------- the study file
# Each option of a study file is declared once, below: a typed field with its docstring. jsonargparse reads them for
# the parsing (``study_parser``), ``maskprior study --help`` and ``--<option>.help``; the API docs read them too.
# ``load_study`` adds what a type cannot say (paths found from the study file, unique names, registered inits) and
# fills each entry's defaults that depend on others (a task's name from its config, a metric's label from its tag).
# An entry's required keys have the default None, so a mapping without one reaches load_study, which names it.
Better = Literal["higher", "lower", "none"]


@dataclass
class Metric:
    """A number in each cell of the table: the last value the run logged under a tag."""

    tag: str | None = None
    """The tag the run logged it under (its scalars file's, TensorBoard's), e.g. test/acc (required)."""
    label: str | None = None
    """Column text (default: the tag)."""
    scale: float = 1.0
    """Multiply before printing (100 for accuracies in %)."""
    digits: int = 4
    """Decimals printed."""
    paper: str | None = None
    """The metric's key in the paper's table (paper_results.TABLES: acc, mse, seq_acc, ...)."""
    better: Better | None = None
    """Which way is better: the table bolds the best mean per task (none: a count, nothing bold). Default: lower
    for errors (MSE, loss, perplexity) and costs (seconds), higher for the rest."""


LOWER_IS_BETTER = ("mse", "loss", "ppl", "perplexity", "error", "drift", "seconds")


def default_better(tag: str) -> str:
    """``lower`` for errors (MSE, loss, perplexity) and costs (seconds), ``higher`` for the rest (accuracies)."""
    return "lower" if any(word in tag.lower() for word in LOWER_IS_BETTER) else "higher"


@dataclass
class TaskEntry:
    """A row of the table: a task's configs, its own overrides and what to report of it."""

    config: list[Path] | Path | None = None
    """The task's config file(s), composed like repeated -c (required). Relative paths are looked up from the
    working directory, then from the study file's directory and its parents, then among the packaged configs."""
    name: str | None = None
    """Row name and directory (default: the first config's file name)."""
    args: list[str | int | float] = field(default_factory=list)
    """Extra CLI overrides for this task, e.g. [--trainer.max_epochs, 2]."""
    metrics: list[Metric | str | dict[str, Any]] | None = None
    """This row's metrics, replacing the study's."""
    curves: list[str] | None = None
    """This row's curve tags, replacing the study's."""
    paper: str | None = None
    """The task's key in the paper's tables (default: name)."""
    inits: list[str] | None = None
    """The labels of the study's inits this row runs (default: all); the table leaves its other cells blank."""

    def runs_init(self, label: str) -> bool:
        """Whether this row runs the init labelled ``label``."""
        return self.inits is None or label in self.inits


@dataclass
class InitEntry:
    """A column of the table: an init method, and what the study adds to its task defaults."""

    name: str | None = None
    """The init method (--model.init): a registered name or module.path:function (required)."""
    label: str | None = None
    """Column and directory name (default: name)."""
    config: list[Path] | Path | None = None
    """Init configs to compose, e.g. configs/init/mask.yaml (looked up as a task's)."""
    args: list[str | int | float] = field(default_factory=list)
    """Extra overrides, e.g. [--model.init_options, "{open_value: 5, closed_value: -5}"]."""


@dataclass
class Study:
    """A grid of tasks x init methods x seeds: every key of a study file (``maskprior study -c <file>``)."""

    title: str | None = None
    """Heading of table.md (default: the file name)."""
    tasks: list[TaskEntry | Path | dict[str, Any]] = field(default_factory=list)
    """The table's rows: task config paths (each row named after its file) or mappings of name, config, args,
    metrics, curves and paper (``--tasks.help TaskEntry`` explains each)."""
    inits: list[InitEntry | str | dict[str, Any]] = field(default_factory=list)
    """The table's columns: init methods (registered ones, or module.path:function; checked before any run) or
    mappings of name, label, config and args (``--inits.help InitEntry`` explains each). Each run gets
    --model.init <name>."""
    seeds: list[int] = field(default_factory=list)
    """Seeds; each run passes its seed to every option in seed_args."""
    seed_args: list[str] = field(default_factory=lambda: ["--seed_everything"])
    """CLI options that receive the run's seed (e.g. also --data.init_args.seed to vary the data order)."""
    metrics: list[Metric | str | dict[str, Any]] = field(default_factory=list)
    """Numbers in each cell: logged tags (the run's last value) or mappings of tag, label, scale, digits, paper
    and better (``--metrics.help Metric`` explains each). Tasks may override them."""
    curves: list[str] = field(default_factory=lambda: ["val/acc"])
    """Tags plotted over training per init method (each seed faint, the mean bold), one figure per task
    (figures/<task>_curves.png and .pdf). The persistence/ summaries are kept and drawn too whenever the runs
    logged them. Their points go to curves.csv.gz, from which `maskprior report` redraws every figure."""
    paper_tables: list[str | int] = field(default_factory=list)
    """The paper's tables to put beside ours, searched in order (1, 2, 3, 4, 6; see
    lightning_maskprior/study/paper_results.py). Empty: no paper column."""
    args: list[str | int | float] = field(default_factory=list)
    """CLI overrides given to every run."""
    test: bool = True
    """Run `maskprior test` on the final checkpoint after each fit."""
    persistence: dict[str, Any] | None = None
    """Measure the persistence of the structure in every run whose config does not: PriorPersistence's init_args,
    e.g. {every_n_steps: 100, probe_size: 64} ({} for its defaults), its probe drawn from the validation split unless
    probe_split says otherwise. The table then has the persistence score and half-life, and the figures its curves.
    A measurement, not part of a run's fingerprint: finished runs are kept when it is set or changed, and a run
    trains step for step as it would without it. A run whose config has its own PriorPersistence keeps that one."""
    out_dir: Path | None = None
    """Where runs and tables go (default: runs/study/<study file name>). One study at a time per directory: a
    second one fails naming the host and process that hold <out_dir>/.study.lock."""
    parallel: int = 1
    """How many runs at a time (at most)."""
    gpus_per_run: int | None = None
    """CUDA devices per run (local launcher: default 1 when CUDA is present, else 0). Concurrent runs get disjoint
    devices through CUDA_VISIBLE_DEVICES; with 0 a run sees none."""
    threads_per_run: int | None = None
    """OMP_NUM_THREADS of each run (default: CPU cores / parallel, at most an OMP_NUM_THREADS you set)."""
    retry_failed: bool = True
    """Rerun runs that failed last time."""
    replace_out_dir: bool = False
    """Run even if out_dir holds another study (another title or study file): its runs that differ from this
    study's are deleted and redone. Without it such an out_dir is refused, naming the study it holds."""
    results_from: list[Path] | Path | None = None
    """A result directory of this study made elsewhere (e.g. a committed docs/results/<name>, or an out_dir on
    another machine), or a list of them ('[dir1, dir2]', or '--results_from dir1 --results_from+ dir2': given twice
    without '+', the second replaces the first): each finished row there whose fingerprint (fit command
    and config contents, without paths) is the one a run here would have stands for that run, which is not run;
    its row, curves and maps go into this out_dir's result files (from the first directory that has it). A long
    grid continues this way from its data files alone, and studies run in parts (by task, by seed) join into one
    table."""
    launcher: str = "local"
    """What executes each run's cell (python -m lightning_maskprior.study.cell <run_dir>). local: a child process
    of the study. inprocess: in this process, one at a time (for debugging and tests). slurm: a SLURM job per run
    (submitit). ray: a Ray task per run."""
    launcher_options: dict[str, Any] | None = None
    """The launcher's own settings (e.g. a SLURM partition and time limit); they override the slurm or ray
    mapping. See the launcher's module."""
    slurm: dict[str, Any] | None = None
    """Settings of launcher slurm (used when launcher is slurm): cluster (slurm, or local: submitit's
    LocalExecutor here), partition, gpus_per_node, cpus_per_task, mem_gb, time (minutes), array_parallelism,
    job_name, log_folder (default <out_dir>/submitit), additional_parameters (extra #SBATCH options), setup (shell
    lines), signal_delay_s, max_num_timeout. See the docs' guide "DDP and clusters"."""
    ray: dict[str, Any] | None = None
    """Settings of launcher ray (used when launcher is ray): address (null: a Ray instance here; auto;
    ray://<head>:10001), num_cpus and num_gpus per run, max_retries (after a lost worker or node), runtime_env.
    The run directories must be on a filesystem every node sees. See the docs' guide "DDP and clusters"."""
    path: Path | None = None
    """The study file (None for a study given as a mapping); not an option of the file."""

    # After load_study: tasks, inits and metrics are entries with every default filled (TaskEntry.config and
    # InitEntry.config lists of absolute paths), paths are absolute, paper_tables strings, args strings,
    # threads_per_run set, and launcher_options hold the slurm or ray mapping too.

    def runs(self) -> list[Run]:
        """Every cell, seed by seed: a study stopped early has the first seeds of every task and init."""
        return [Run(self, task, init, seed) for seed in self.seeds for task in self.tasks for init in self.inits
                if task.runs_init(init.label)]
_documenting = 0


@contextlib.contextmanager
def field_docstrings():
    """Within it, jsonargparse reads the docstring under each field as the option's help. The setting is the
    process's: left on, the fit's parser would read the source of every class it adds (measured 4x slower)."""
    from jsonargparse import set_parsing_settings

    global _documenting
    _documenting += 1
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        yield
    finally:
        _documenting -= 1
        if not _documenting:
            set_parsing_settings(docstring_parse_attribute_docstrings=False)


def add_study_arguments(parser: Any) -> None:
    """Every option of a study file (the fields of :class:`Study`) added to ``parser``, each with its docstring as
    help; ``--tasks.help``, ``--inits.help`` and ``--metrics.help`` explain the entries' keys (parsed within
    ``field_docstrings``)."""
    with field_docstrings():
        parser.add_class_arguments(Study, as_group=False, skip={"path"})


@functools.cache
def _parser(of: type) -> Any:
    """A parser of the fields of ``of`` (Study or an entry) that raises instead of exiting: load_study's types."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    if of is Study:
        add_study_arguments(parser)
    else:
        parser.add_class_arguments(of, as_group=False)
    return parser


def _parse(of: type, values: dict, where: str | None) -> dict:
    """``values`` typed and completed by the fields of ``of``; a StudyError naming ``where`` and the key."""
    from jsonargparse import ArgumentError

    from lightning_maskprior.run.errors import one_line

    if where is not None:  # an entry: its unknown keys named beside the keys it has
        known = {f.name for f in fields(of)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise StudyError(f"{where}: unknown keys {unknown}; expected some of {sorted(known)}")
    try:
        return _parser(of).parse_object(copy.deepcopy(values)).as_dict()  # jsonargparse rewrites what it is given
    except ArgumentError as err:
        raise StudyError(f"{where}: {one_line(str(err))}" if where else one_line(str(err))) from None


def _resolve_path(value: Any, where: str, bases: list[Path]) -> Path:
    if not str(value):
        raise StudyError(f"{where}: config must be a path, got {str(value)!r}")
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


def _safe_name(name: str, where: str) -> str:
    if not name or not re.fullmatch(r"[A-Za-z0-9_.+=-]+", name) or name in (".", ".."):
        raise StudyError(f"{where}: name {name!r} must be non-empty letters, digits, '_', '-', '.', '+', '='")
    return name


def _metrics(values: list, where: str) -> list[Metric]:
    """Each metric as a Metric with its label and better filled."""
    metrics = []
    for i, value in enumerate(values):
        at = f"{where}[{i}]"
        if isinstance(value, str):
            value = {"tag": value}
        if not isinstance(value, dict) or not isinstance(value.get("tag"), str) or "/" not in value["tag"]:
            raise StudyError(f"{at}: a metric is a logged tag like 'test/acc' or a mapping with one, "
                             f"got {value!r}")
        metric = Metric(**_parse(Metric, value, at))
        if metric.digits < 0:
            raise StudyError(f"{at}: digits must be >= 0, got {metric.digits}")
        metric.label = metric.label or metric.tag
        metric.better = metric.better or default_better(metric.tag)
        metrics.append(metric)
    return metrics


def load_study(cfg: Any, path: Path | None = None) -> Study:
    """The study ``cfg`` (a study file's options: a mapping or a parsed namespace) describes, typed by the fields of
    :class:`Study`, its paths resolved (against the working directory, then ``path``'s directory and its parents)
    and checked as a whole before anything runs; a StudyError naming the entry otherwise."""
    study = Study(**_parse(Study, cfg.as_dict() if hasattr(cfg, "as_dict") else dict(cfg), None))
    study.path, bases = lookup_bases(path)
    name = Path(path).stem if path is not None else "study"
    study.title = study.title or name
    study.out_dir = Path(study.out_dir or Path("runs") / "study" / name).expanduser().resolve()

    check_seeds(study.seeds, study.seed_args)
    study.args = [str(a) for a in study.args]
    study.metrics = _metrics(study.metrics, "metrics")
    study.paper_tables = [str(t) for t in study.paper_tables]
    for i, table in enumerate(study.paper_tables):
        if table not in paper_results.TABLES:
            raise StudyError(f"paper_tables[{i}]: the paper has no table {table!r} here; expected one of "
                             f"{sorted(paper_results.TABLES)}")

    study.tasks = _tasks(study, bases)
    study.inits = _inits(study, bases)
    study.persistence = persistence_options(study.persistence)
    _check_launcher(study)
    study.results_from = _results_from(study.results_from)
    return study


def persistence_options(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """A study's (or tune's) persistence options as PriorPersistence's init_args (probe_split val unless given),
    checked by building the callback; a StudyError naming the option otherwise."""
    if options is None:
        return None
    from lightning_maskprior.callbacks import PriorPersistence

    options = {"probe_split": "val", **options}
    known = list(inspect.signature(PriorPersistence).parameters)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise StudyError(f"persistence: unknown options {unknown}; expected PriorPersistence's, some of {known}")
    try:
        PriorPersistence(**options)
    except (TypeError, ValueError) as err:
        raise StudyError(f"persistence: {err}") from None
    return options


def lookup_bases(path: Path | None) -> tuple[Path | None, list[Path]]:
    """A study or tune file's resolved path (None for options given as a mapping) and where the relative config
    paths it names are looked up: the working directory, then the file's directory and its parents (the packaged
    configs come last, in ``_resolve_path``)."""
    if path is None:
        return None, [Path.cwd()]
    path = Path(path).resolve()
    return path, [Path.cwd(), path.parent, *path.parent.parents]


def check_seeds(seeds: list[int], seed_args: list[str], error: type[Exception] = StudyError) -> None:
    """An ``error`` naming the seed or seed option that is not what a study (or a tune) runs."""
    if not seeds:
        raise error("seeds: give at least one seed, e.g. seeds: [0, 1, 2]")
    for i, seed in enumerate(seeds):
        if seed < 0:
            raise error(f"seeds[{i}]: a seed is a non-negative integer, got {seed!r}")
    if len(set(seeds)) != len(seeds):
        raise error(f"seeds: {seeds} repeats a seed")
    if not all(a.startswith("--") for a in seed_args):
        raise error(f"seed_args: each entry is a CLI option like --seed_everything, got {seed_args}")


def task_entries(values: list, bases: list[Path], of: type,
                 kind: type[StudyError] = StudyError) -> list[tuple[Any, str]]:
    """The task entries of a study or tune file (a config path, or a mapping with config, name and args), each
    typed as the dataclass ``of`` with a safe name, its config paths resolved against ``bases`` and its args as
    strings, beside the ``tasks[i] (name)`` that messages about it name. Errors are ``kind``."""
    if not values:
        raise kind("tasks: give at least one task (a config path or a mapping with name and config)")
    entries = []
    for i, entry in enumerate(values):
        entry = {"config": entry} if not isinstance(entry, dict) else entry
        configs = _as_list(entry.get("config"))
        name = str(entry.get("name") or (Path(str(configs[0])).stem if configs else ""))
        where = f"tasks[{i}] ({name})" if name else f"tasks[{i}]"
        task = of(**_parse(of, entry, where))
        if not configs:
            raise kind(f"{where}: no config given")
        task.name = _safe_name(name, where)
        task.config = [_resolve_path(c, where, bases) for c in _as_list(task.config)]
        task.args = [str(a) for a in task.args]
        entries.append((task, where))
    _check_unique([task.name for task, _ in entries], "tasks")
    return entries


def _tasks(study: Study, bases: list[Path]) -> list[TaskEntry]:
    """The study's task entries, typed and checked, their metrics, curves and paper key filled in."""
    tasks = []
    for task, where in task_entries(study.tasks, bases, TaskEntry):
        task.metrics = study.metrics if task.metrics is None else _metrics(task.metrics, f"{where}.metrics")
        if not task.metrics:
            raise StudyError(f"{where}: no metrics to report; set metrics at the top level or in the task")
        task.curves = study.curves if task.curves is None else task.curves
        task.paper = task.paper or task.name
        tasks.append(task)
    return tasks


def _inits(study: Study, bases: list[Path]) -> list[InitEntry]:
    """The study's init entries, typed and checked (each a registered method or one of the user's own), their config
    paths resolved against ``bases``."""
    if not study.inits:
        raise StudyError("inits: give at least one init method, e.g. inits: [default, mask]")
    import lightning_maskprior.module  # noqa: F401  (imports every module that registers inits)
    from lightning_maskprior.inits import get_init

    inits = []
    for i, entry in enumerate(study.inits):
        entry = {"name": entry} if isinstance(entry, str) else entry
        if not isinstance(entry.get("name"), str):
            raise StudyError(f"inits[{i}]: an init is a method name or a mapping with a name, got {entry!r}")
        where = f"inits[{i}] ({entry['name']})"
        init = InitEntry(**_parse(InitEntry, entry, where))
        try:
            get_init(init.name)  # a registered method, or module.path:function of the user's own
        except ValueError as err:
            raise StudyError(f"{where}: {err}") from None
        init.label = _safe_name(init.label or init.name.rpartition(":")[2], where)  # my_pkg.inits:band -> band
        init.config = [_resolve_path(c, where, bases) for c in _as_list(init.config)]
        init.args = [str(a) for a in init.args]
        inits.append(init)
    _check_unique([init.label for init in inits], "inits (labels)")
    for i, task in enumerate(study.tasks):
        unknown = sorted(set(task.inits or []) - {init.label for init in inits})
        if unknown or task.inits == []:
            raise StudyError(f"tasks[{i}] ({task.name}).inits: {unknown or task.inits} is not a non-empty list of "
                             f"the study's init labels {[init.label for init in inits]}")
    return inits


def _check_launcher(study: Study) -> None:
    """Check the launcher and the run options it reads (parallel, gpus_per_run, threads_per_run), and merge its own
    mapping into ``launcher_options``."""
    if study.parallel < 1:
        raise StudyError(f"parallel: must be a positive integer, got {study.parallel!r}")
    if study.launcher not in LAUNCHERS:
        raise StudyError(f"launcher: unknown launcher {study.launcher!r}; expected one of {sorted(LAUNCHERS)}")
    if study.launcher == "inprocess" and study.parallel != 1:
        raise StudyError("parallel: the inprocess launcher runs one run at a time; use parallel: 1")
    if study.gpus_per_run is not None and study.gpus_per_run < 0:
        raise StudyError(f"gpus_per_run: must be a non-negative integer (or null: the launcher's default), "
                         f"got {study.gpus_per_run!r}")
    own = getattr(study, study.launcher) if study.launcher in ("slurm", "ray") else None  # its own mapping
    study.launcher_options = {**(own or {}), **(study.launcher_options or {})}  # launcher_options win
    if study.threads_per_run is None:
        study.threads_per_run = _default_threads(study.parallel)
    elif study.threads_per_run < 1:
        raise StudyError(f"threads_per_run: must be a positive integer, got {study.threads_per_run!r}")


def _results_from(value: list[Path] | Path | None) -> list[Path]:
    """One result directory or a list of them (None: none), each holding study.json and results.csv."""
    from lightning_maskprior.run.rundir import ResultDir

    paths = []
    for item in _as_list(value):
        path = Path(item).expanduser()
        if not ResultDir.holds_results(path):
            raise StudyError(f"results_from: {str(item)!r} is not a study's result directory (expected one holding "
                             f"{ResultDir.STUDY} and {ResultDir.RESULTS}, e.g. docs/results/<name>)")
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

    @property
    def skip_test_if(self) -> str | None:
        """A file whose presence after the fit means the run is not tested (a pruned trial's); None: always tested."""
        return None

    def fit_args(self) -> list[str]:
        args = ["fit"]
        for config in [*self.task.config, *self.init.config]:
            args += ["-c", str(config)]
        args += ["--model.init", self.init.name, "--trainer.enable_progress_bar", "false"]
        args += [*self.study.args, *self.task.args, *self.init.args]
        for option in self.study.seed_args:
            args += [option, str(self.seed)]
        return args + ["--trainer.default_root_dir", str(self.dir)]

    def key(self) -> dict:
        """What makes a finished run reusable: the same fit command, composed config and test choice (``config``:
        the digest of the CLI's default configs and the run's config files merged in order, ``config_digest``)."""
        files = [*config_files.default_files(), *self.task.config, *self.init.config]
        return {"fit": self.fit_args(), "config": config_digest(files), "test": self.study.test}

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


_PARSED: dict[tuple[str, float], Any] = {}


def fingerprint_of(key: dict, name: str) -> str:
    """A run's fingerprint from its key (``Run.key``) and name: the digest of its composed config
    (``config_digest``), the fit command without its configs (``-c PATH``: how many files the config is split into
    is no part of the run) and without its last argument (the run directory), the run's place in the grid and the
    test choice."""
    import hashlib

    args = key["fit"]
    args = [a for a, previous in zip(args, ["", *args[:-1]], strict=True) if "-c" not in (a, previous)][:-1]
    text = json.dumps({"config": key["config"], "fit": args, "run": name, "test": key["test"]})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def same_run(record: dict | None, key: dict, name: str) -> bool:
    """Whether ``record`` (a run.json, result.json or fit record) holds a key with the fingerprint of ``key`` for the
    run ``name``: the same run, wherever its configs lie. A record of an older layout is not."""
    theirs = record.get("key") if isinstance(record, dict) else None
    try:
        return isinstance(theirs, dict) and fingerprint_of(theirs, name) == fingerprint_of(key, name)
    except (KeyError, TypeError, ValueError):
        return False


def config_digest(paths: list[Path]) -> str:
    """The digest of what config files compose to: their parsed YAML merged in order (``merge_configs``), so an
    edited comment, reordered keys or an option moved from one of the files to another (a task file's trainer
    option into the CLI's defaults, say) leave it unchanged, while any changed value changes it. A file that is not
    YAML counts as its text."""
    import hashlib

    content = json.dumps(composed_config(paths), sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def composed_config(paths: list[Path]) -> Any:
    """What config files compose to, as repeated ``-c`` composes them: their parsed YAML merged in order."""
    merged: Any = {}
    for path in paths:
        merged = merge_configs(merged, _parsed(Path(path)))
    return merged


def merge_configs(base: Any, later: Any) -> Any:
    """``later`` over ``base`` as repeated ``-c`` composes them: mappings key by key, a later list or scalar
    replaces."""
    if isinstance(base, dict) and isinstance(later, dict):
        merged = dict(base)
        for k, v in later.items():
            merged[k] = merge_configs(base[k], v) if k in base else v
        return merged
    return later


def _parsed(path: Path) -> Any:
    import yaml

    stamp = (str(path), path.stat().st_mtime)
    if stamp not in _PARSED:
        text = path.read_text()
        try:
            _PARSED[stamp] = yaml.safe_load(text) or {}  # an empty file changes nothing
        except yaml.YAMLError:
            _PARSED[stamp] = text
    return _PARSED[stamp]


def format_command(args: list[str]) -> str:
    import shlex

    return "maskprior " + " ".join(shlex.quote(a) for a in args)


def _check_fit_config(printed: str, tasks: dict[str, Any] | None = None) -> None:
    """The checks a fit makes of its parsed options before it trains, on the config ``--print_config`` printed: the
    trainer's and the module's options (the init options' types and ranges, the parameterisation and rank, every
    plug-in named by import path: an init, objective, structure builder or estimator), then what it checks as it
    builds its module (``module.check_run``: the structure's size against the task's tokens, a ``low_rank`` rank
    within them). ``tasks`` keeps each datamodule's TaskSpec by its config, for the next command of that task. A
    ValueError naming the option."""
    import yaml

    from lightning_maskprior.attention import DEFAULT_RANK
    from lightning_maskprior.module import build_datamodule, check_module_options, check_run
    from lightning_maskprior.run.checks import check_fit_options

    config = yaml.safe_load(printed) or {}
    model = config.get("model") or {}
    check_fit_options(config.get("trainer") or {}, model)
    check_module_options(model.get("init", "default"), model.get("init_options"), model.get("lr_schedule", "cosine"),
                         model.get("warmup_steps", 0), model.get("prior_weight_decay", 0.0),
                         model.get("parameterisation") or "full", model.get("prior_rank") or DEFAULT_RANK,
                         model.get("objective"))
    data = config.get("data") or {}
    key = json.dumps(data, sort_keys=True, default=str)
    tasks = {} if tasks is None else tasks
    if key not in tasks:
        tasks[key] = build_datamodule(data).task_spec()
    check_run(model, data, tasks[key])


def print_fit_config(args: list[str], tasks: dict | None = None) -> str:
    """The configuration a full ``maskprior fit`` command parses to (``--print_config`` with the CLI's own parser:
    every option and config is parsed, nothing is instantiated), after the checks a fit makes of its options before
    it builds anything and as it builds its module (``_check_fit_config``; ``tasks`` keeps each datamodule's task
    across calls); a ValueError with the parser's or the check's message otherwise."""
    from lightning_maskprior.run.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli_main([*args, "--print_config"])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else (0 if exit_info.code is None else 1)
    except Exception as error:  # noqa: BLE001  (any error is the command's, report it)
        code, err = 1, io.StringIO(f"{type(error).__name__}: {error}")
    if code != 0:
        raise ValueError(f"the fit command does not parse: {err.getvalue().strip() or f'exit code {code}'}")
    _check_fit_config(out.getvalue(), tasks)
    return out.getvalue()


def check_commands(study: Study) -> int:
    """Parse the full ``maskprior fit`` command of every distinct (task, init) with the CLI's own parser
    (``print_fit_config``); raise StudyError naming the task and init whose command does not parse (a misspelled
    option in a task's args, a bad value). Returns the number of commands checked. Seeds only change seed options,
    so the first seed stands for all."""
    checked, tasks = 0, {}
    for task in study.tasks:
        for init in filter(lambda init: task.runs_init(init.label), study.inits):
            run = Run(study, task, init, study.seeds[0])
            try:
                print_fit_config(run.fit_args(), tasks)
            except (ValueError, FileNotFoundError) as error:
                raise StudyError(f"task {task.name} x init {init.label}: {error}\n  command: "
                                 f"{format_command(run.fit_args())}") from None
            checked += 1
    return checked

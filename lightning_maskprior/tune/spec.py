"""The tune file: the runs a trial makes, the search space over their fit options, the objective, and the Optuna
study (sampler, pruner, storage, number of trials). ``load_tune`` checks it all before any trial runs and raises
TuneError naming the key; ``check_trial_commands`` parses every trial's fit command with the fit's own parser.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import optuna

from lightning_maskprior.run.rundir import StudyRunDir
from lightning_maskprior.study.spec import (
    InitEntry,
    Run,
    StudyError,
    _default_threads,
    _parse,
    check_seeds,
    config_digest,
    default_better,
    format_command,
    lookup_bases,
    persistence_options,
    print_fit_config,
    task_entries,
)


class TuneError(StudyError):
    """A tune file (or command line) that cannot run; the message names the offending key."""


@dataclass
class Param:
    """One dimension of the search space: the values a fit option may take."""

    type: Literal["float", "int", "categorical"] | None = None
    """float, int or categorical (default: categorical when choices are given, else float)."""
    low: float | None = None
    """The smallest value (float and int)."""
    high: float | None = None
    """The largest value (float and int); it must exceed low."""
    log: bool = False
    """Sample on a log scale (float and int; low must then be > 0)."""
    step: float | None = None
    """The spacing of the values (float and int, not with log; default: continuous floats, integers 1 apart)."""
    choices: list[Any] | None = None
    """The values of a categorical option: strings, numbers, booleans or null."""


@dataclass
class Task:
    """The runs of one task in each trial: its configs and its own overrides."""

    config: list[Path] | Path | None = None
    """The task's config file(s), composed like repeated -c, e.g. [boolean/2parity.yaml, init/mask.yaml]
    (required). Looked up as a study's are: the working directory, the tune file's directory and its parents, then
    the packaged configs."""
    name: str | None = None
    """The task's name (default: the first config's file name): its directory in a trial of several tasks."""
    args: list[str | int | float] = field(default_factory=list)
    """Extra CLI overrides for this task's runs, e.g. [--trainer.max_epochs, 2]."""


@dataclass
class Objective:
    """What a trial scores: a metric's last value in each run, averaged over the trial's runs (tasks x seeds)."""

    metric: str | None = None
    """A tag the runs log, e.g. val/ppl or test/acc (required). A test/ tag makes each run test its final
    checkpoint."""
    direction: Literal["minimize", "maximize"] | None = None
    """minimize or maximize (default: minimize for errors and costs (mse, loss, ppl, ...), maximize otherwise)."""


@dataclass
class Tune:
    """An Optuna study over runs: every key of a tune file (``maskprior tune -c <file>``)."""

    title: str | None = None
    """Heading of the trials table (default: the file name)."""
    tasks: list[Task | Path | dict[str, Any]] = field(default_factory=list)
    """The runs of each trial: task config paths or mappings of config, name and args (``--tasks.help Task``).
    Every trial runs each task with each seed."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Seeds; every trial runs each task once per seed and scores the mean."""
    seed_args: list[str] = field(default_factory=lambda: ["--seed_everything"])
    """CLI options that receive the run's seed (e.g. also --data.init_args.seed to vary the data order)."""
    args: list[str | int | float] = field(default_factory=list)
    """CLI overrides given to every run."""
    search: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The search space: fit options (any option `maskprior fit` takes, dotted, without the leading --, e.g.
    model.optimizer.init_args.lr or model.init_options.scale) mapped to how each is sampled: type (float, int or
    categorical; default categorical when choices are given, else float), low and high (the range, low < high),
    log (a log scale, low > 0), step (the spacing, not with log), choices (a categorical option's values). Each
    option is parsed by the fit's parser at both ends of its range (each choice) before any trial runs."""
    objective: Objective | dict[str, Any] | str | None = None
    """The trials' score: a metric tag (e.g. val/ppl) or a mapping of metric and direction. It is the mean over
    the trial's runs of each run's last logged value."""
    prune_on: str | None = "auto"
    """The validation tag a pruner watches during the first run of each trial (reported at every validation, by
    global step). auto: the objective's metric when it is a val/ tag, else no pruning; null: no pruning."""
    sampler: optuna.samplers.BaseSampler | None = None
    """Optuna's sampler, as class_path and init_args (e.g. {class_path: TPESampler, init_args: {seed: 0}}; default:
    TPESampler with seed 0). Each trial's sampler has the seed plus the trial's number, so workers that start
    together draw different trials, a resumed study new ones, and a study of one worker the same ones each time."""
    pruner: optuna.pruners.BasePruner | None = None
    """Optuna's pruner, as class_path and init_args (default: MedianPruner with Optuna's defaults; NopPruner for
    none). A pruned trial's fit stops cleanly at the validation that decided it."""
    n_trials: int = 10
    """The study's total number of trials (finished, pruned or failed, over every worker): rerunning with the same
    number resumes, a larger one extends. Trials whose worker died are retried and counted once."""
    storage: str | None = None
    """Where the study lives (default: sqlite:///<out_dir>/tune.db): an Optuna RDB URL (sqlite:///PATH,
    postgresql://USER:PASSWORD@HOST/DB, mysql+pymysql://...) or a path without '://', an Optuna journal file
    (e.g. tune.log on a shared filesystem). Every worker of a study names the same storage."""
    study_name: str | None = None
    """The Optuna study's name in the storage (default: the tune file's name)."""
    out_dir: Path | None = None
    """Where trials, best.yaml and the tables go (default: runs/tune/<tune file name>). Trial k is the run
    directory <out_dir>/trial_000k (with <task>/seed<s>/ beneath it when a trial makes several runs)."""
    test: bool | None = None
    """Run `maskprior test` on the final checkpoint after each fit (default: when the objective is a test/ tag)."""
    persistence: dict[str, Any] | None = None
    """PriorPersistence's init_args for every run whose config does not measure persistence, as a study's
    ``persistence`` (e.g. {every_n_steps: 100}): persistence/score becomes an objective a tune can use."""
    parallel: int = 1
    """How many runs of one trial at a time (several workers run several trials at a time)."""
    gpus_per_run: int | None = None
    """CUDA devices per run (default 1 when CUDA is present, else 0), as a study's local launcher gives them."""
    threads_per_run: int | None = None
    """OMP_NUM_THREADS of each run (default: CPU cores / parallel, at most an OMP_NUM_THREADS you set)."""
    launcher: Literal["local", "inprocess"] = "local"
    """How a trial's runs are executed: local (a child process per run, as a study's) or inprocess (in the
    worker, one at a time: for debugging)."""
    heartbeat_interval: int = 60
    """Seconds between a worker's heartbeats in an RDB storage (Optuna's heartbeat): a trial whose worker stopped
    beating is failed and retried, in its own directory, resuming from its last checkpoint."""
    grace_period: int | None = None
    """Seconds without a heartbeat after which a running trial counts as dead (default: 2 x heartbeat_interval)."""
    max_retry: int | None = 3
    """How many times a trial whose worker died (or was stopped) is retried (null: always)."""
    path: Path | None = None
    """The tune file (None for a tune given as a mapping); not an option of the file."""

    # After load_tune: tasks are Task entries with absolute config paths and string args, search holds Param
    # entries with every default filled, objective an Objective, prune_on a tag or None, test a bool, storage a URL,
    # sampler and pruner {class_path, init_args} mappings (instantiated by ``sampler_for`` / ``pruner_for``).

    def definition(self) -> dict[str, Any]:
        """What the trials of this tune mean: their runs (config contents, overrides, seeds), the search space and
        the objective. A storage's study keeps the definition of its first worker and refuses another one."""
        return {
            "tasks": [{"name": t.name, "config": config_digest(t.config), "args": t.args} for t in self.tasks],
            "seeds": self.seeds, "seed_args": self.seed_args, "args": self.args, "test": self.test,
            "search": {name: vars(param) for name, param in self.search.items()},
            "objective": vars(self.objective),
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.definition(), sort_keys=True, default=str).encode()).hexdigest()[:16]


PARAM_TYPES = ("float", "int", "categorical")


def _param(name: str, value: Any) -> Param:
    where = f"search.{name}"
    if not isinstance(value, dict):
        raise TuneError(f"{where}: expected a mapping of type, low, high, log, step or choices, got {value!r}")
    param = Param(**_parse(Param, value, where))
    if param.type is None:
        param.type = "categorical" if param.choices is not None else "float"
    if param.type == "categorical":
        if param.choices is None or not isinstance(param.choices, list) or not param.choices:
            raise TuneError(f"{where}: a categorical option needs a non-empty list of choices, got "
                            f"{param.choices!r}")
        extra = [k for k in ("low", "high", "step") if getattr(param, k) is not None] + (["log"] if param.log else [])
        if extra:
            raise TuneError(f"{where}: {', '.join(extra)} given for a categorical option; expected only choices")
        bad = [c for c in param.choices if not (c is None or isinstance(c, str | int | float | bool))]
        if bad:
            raise TuneError(f"{where}: choices must be strings, numbers, booleans or null, got {bad[0]!r}")
        return param
    if param.choices is not None:
        raise TuneError(f"{where}: choices given for a {param.type} option; expected low and high (or type: "
                        "categorical)")
    if param.low is None or param.high is None:
        raise TuneError(f"{where}: a {param.type} option needs low and high, got low={param.low!r}, "
                        f"high={param.high!r}")
    if not all(math.isfinite(v) for v in (param.low, param.high)):
        raise TuneError(f"{where}: low and high must be finite numbers, got {param.low!r} and {param.high!r}")
    if param.type == "int":
        if param.low != int(param.low) or param.high != int(param.high):
            raise TuneError(f"{where}: an int option needs integer low and high, got {param.low!r} and "
                            f"{param.high!r}")
        param.low, param.high = int(param.low), int(param.high)
        if param.step is not None and param.step != int(param.step):
            raise TuneError(f"{where}: an int option needs an integer step, got {param.step!r}")
        param.step = int(param.step) if param.step is not None else 1
    if param.low >= param.high:
        raise TuneError(f"{where}: empty range: low {param.low!r} >= high {param.high!r}; expected low < high")
    if param.log and param.low <= 0:
        raise TuneError(f"{where}: a log scale needs low > 0, got {param.low!r}")
    if param.step is not None:
        if param.step <= 0:
            raise TuneError(f"{where}: step must be > 0, got {param.step!r}")
        if param.log and not (param.type == "int" and param.step == 1):
            raise TuneError(f"{where}: step and log cannot be combined; expected one of them")
    return param


def _search(values: dict[str, Any]) -> dict[str, Param]:
    if not values:
        raise TuneError("search: give at least one option to tune, e.g. search: {model.optimizer.init_args.lr: "
                        "{low: 1e-4, high: 1e-2, log: true}}")
    search = {}
    for name, value in values.items():
        option = str(name).removeprefix("--")
        if not option or option.startswith("-") or " " in option or "=" in option:
            raise TuneError(f"search: {name!r} is not a fit option; expected a dotted option name such as "
                            "model.optimizer.init_args.lr")
        search[option] = _param(option, value)
    return search


def _objective(value: Any) -> Objective:
    if value is None:
        raise TuneError("objective: give the metric to optimise, e.g. objective: {metric: val/ppl, direction: "
                        "minimize}")
    if isinstance(value, str):
        value = {"metric": value}
    if not isinstance(value, dict):
        raise TuneError(f"objective: expected a metric tag or a mapping of metric and direction, got {value!r}")
    objective = Objective(**_parse(Objective, value, "objective"))
    if not isinstance(objective.metric, str) or "/" not in objective.metric:
        raise TuneError(f"objective.metric: expected a tag a run logs, like val/ppl or test/acc, got "
                        f"{objective.metric!r}")
    objective.direction = objective.direction or (
        "minimize" if default_better(objective.metric) == "lower" else "maximize")
    return objective


def _class_spec(value: Any, where: str, default: str) -> dict[str, Any]:
    """A sampler or pruner as ``{class_path, init_args}`` (jsonargparse resolved and checked it)."""
    if value is None:
        return {"class_path": default, "init_args": {}}
    return {"class_path": value["class_path"], "init_args": dict(value.get("init_args") or {})}


def load_tune(cfg: Any, path: Path | None = None) -> Tune:
    """The tune ``cfg`` (a tune file's options: a mapping or a parsed namespace) describes, typed by the fields of
    :class:`Tune`, its paths resolved and checked as a whole before any trial runs; a TuneError naming the key
    otherwise."""
    values = cfg.as_dict() if hasattr(cfg, "as_dict") else dict(cfg)
    tune = Tune(**_parse(Tune, values, None))
    tune.path, bases = lookup_bases(path)
    name = Path(path).stem if path is not None else "tune"
    tune.title = tune.title or name
    tune.study_name = tune.study_name or name
    tune.out_dir = Path(tune.out_dir or Path("runs") / "tune" / name).expanduser().resolve()
    tune.storage = tune.storage or f"sqlite:///{tune.out_dir / 'tune.db'}"

    check_seeds(tune.seeds, tune.seed_args, TuneError)
    tune.args = [str(a) for a in tune.args]
    tune.tasks = [task for task, _ in task_entries(tune.tasks, bases, Task, TuneError)]
    tune.search = _search(tune.search)
    tune.persistence = persistence_options(tune.persistence)
    tune.objective = _objective(tune.objective)
    if tune.prune_on == "auto":
        tune.prune_on = tune.objective.metric if tune.objective.metric.startswith("val/") else None
    elif tune.prune_on is not None and "/" not in tune.prune_on:
        raise TuneError(f"prune_on: expected a validation tag like val/loss, auto or null, got {tune.prune_on!r}")
    if tune.test is None:
        tune.test = tune.objective.metric.startswith("test/")
    tune.sampler = _class_spec(tune.sampler, "sampler", "optuna.samplers.TPESampler")
    if tune.sampler["class_path"] == "optuna.samplers.TPESampler" and "seed" not in tune.sampler["init_args"]:
        tune.sampler["init_args"]["seed"] = 0
    tune.pruner = _class_spec(tune.pruner, "pruner", "optuna.pruners.MedianPruner")
    for key, low in (("n_trials", 1), ("parallel", 1), ("heartbeat_interval", 1)):
        if getattr(tune, key) < low:
            raise TuneError(f"{key}: must be an integer >= {low}, got {getattr(tune, key)!r}")
    tune.grace_period = tune.grace_period if tune.grace_period is not None else 2 * tune.heartbeat_interval
    if tune.grace_period <= tune.heartbeat_interval:
        raise TuneError(f"grace_period: must exceed heartbeat_interval ({tune.heartbeat_interval} s), got "
                        f"{tune.grace_period!r}")
    if tune.max_retry is not None and tune.max_retry < 0:
        raise TuneError(f"max_retry: must be >= 0 or null, got {tune.max_retry!r}")
    if tune.launcher == "inprocess" and tune.parallel != 1:
        raise TuneError("parallel: the inprocess launcher runs one run at a time; use parallel: 1")
    if tune.gpus_per_run is not None and tune.gpus_per_run < 0:
        raise TuneError(f"gpus_per_run: must be a non-negative integer, got {tune.gpus_per_run!r}")
    if tune.threads_per_run is None:
        tune.threads_per_run = _default_threads(tune.parallel)
    elif tune.threads_per_run < 1:
        raise TuneError(f"threads_per_run: must be a positive integer, got {tune.threads_per_run!r}")
    return tune


# ------------------------------------------------------------------------------------------------ a trial's runs
def format_value(value: Any) -> str:
    """A parameter's value as a command-line argument (YAML, as jsonargparse reads it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def param_args(params: dict[str, Any]) -> list[str]:
    """``--option value`` for each of a trial's parameters."""
    return [a for name, value in params.items() for a in (f"--{name}", format_value(value))]


PRUNING_FILE = "optuna_trial.json"  # in a trial's directory: the storage, study and trial its pruner reports to


class TrialRun(Run):
    """One run of a trial: a task with a seed, the trial's parameters as CLI options, in ``dir``; its cell is a
    study's (``prepare_run``, ``python -m lightning_maskprior.study.cell``)."""

    def __init__(self, tune: Tune, task: Task, seed: int, trial_dir: Path, params: dict[str, Any],
                 prune: bool) -> None:
        self.study, self.task, self.seed, self.params, self.prune = tune, task, seed, dict(params), prune
        self.init = InitEntry(name=str(params.get("model.init", "as configured")), label="trial", config=[], args=[])
        self.trial_dir = Path(trial_dir)
        single = len(tune.tasks) == 1 and len(tune.seeds) == 1
        self.dir = self.trial_dir if single else self.trial_dir / task.name / f"seed{seed}"
        files = StudyRunDir(self.dir)
        self.result_path, self.run_path = files.result, files.run_record

    @property
    def name(self) -> str:
        return self.dir.relative_to(self.study.out_dir).as_posix()

    def base_args(self) -> list[str]:
        """The fit command without its run directory and the pruning callback: what best.yaml holds."""
        args = ["fit"]
        for config in self.task.config:
            args += ["-c", str(config)]
        args += ["--trainer.enable_progress_bar", "false", *self.study.args, *self.task.args,
                 *param_args(self.params)]
        for option in self.study.seed_args:
            args += [option, str(self.seed)]
        return args

    def fit_args(self) -> list[str]:
        args = self.base_args()
        if self.prune:
            spec = {"class_path": "lightning_maskprior.callbacks.OptunaPruning",
                    "init_args": {"trial_file": str(self.trial_dir / PRUNING_FILE), "monitor": self.study.prune_on}}
            args.append(f"--trainer.callbacks+={json.dumps(spec)}")
        return [*args, "--trainer.default_root_dir", str(self.dir)]

    def key(self) -> dict:
        return {"fit": self.fit_args(), "config": config_digest(self.task.config), "test": self.study.test}

    @property
    def skip_test_if(self) -> str | None:
        """The file the pruner writes when it stops this run's fit: a pruned fit is not tested."""
        from lightning_maskprior.callbacks.optuna_pruning import PRUNED_FILE  # Lightning's: imported on use

        return str(self.trial_dir / PRUNED_FILE) if self.prune else None


def trial_runs(tune: Tune, trial_dir: Path, params: dict[str, Any]) -> list[TrialRun]:
    """The runs of a trial, task by task and seed by seed; the first one feeds the pruner."""
    runs = [TrialRun(tune, task, seed, trial_dir, params, prune=False) for task in tune.tasks for seed in tune.seeds]
    runs[0].prune = tune.prune_on is not None
    return runs


def check_values(param: Param) -> list[Any]:
    """The values of ``param`` a check parses: both ends of a range, every choice."""
    if param.type == "categorical":
        return list(param.choices)
    return [param.low, param.high]


def check_trial_commands(tune: Tune) -> int:
    """Parse every task's fit command with the fit's parser: as configured, then with each option of the search
    space at each end of its range (each choice), then with all of them at once; a TuneError naming the task or the
    option whose command does not parse. Returns the number of commands parsed."""
    parsed = 0
    probe = tune.out_dir / "trial_check"
    for task in tune.tasks:
        base = TrialRun(tune, task, tune.seeds[0], probe, {}, prune=False)
        try:
            print_fit_config(base.base_args())
        except ValueError as err:
            raise TuneError(f"tasks ({task.name}): {err}\n  command: {format_command(base.base_args())}") from None
        parsed += 1
        for name, param in tune.search.items():
            for value in check_values(param):
                run = TrialRun(tune, task, tune.seeds[0], probe, {name: _sampled(param, value)}, prune=False)
                try:
                    print_fit_config(run.base_args())
                except ValueError as err:
                    raise TuneError(f"search.{name}: {err} (task {task.name}, value {format_value(value)})") from None
                parsed += 1
        together = {name: _sampled(param, check_values(param)[0]) for name, param in tune.search.items()}
        run = trial_runs(tune, probe, together)[0] if task is tune.tasks[0] else TrialRun(
            tune, task, tune.seeds[0], probe, together, prune=False)  # the first task's with its pruning callback
        try:
            print_fit_config(run.fit_args())
        except ValueError as err:
            raise TuneError(f"search: the options together: {err}\n  command: {format_command(run.fit_args())}"
                            ) from None
        parsed += 1
    return parsed


def _sampled(param: Param, value: Any) -> Any:
    return int(value) if param.type == "int" else (float(value) if param.type == "float" else value)


def suggest(trial: optuna.Trial, name: str, param: Param) -> Any:
    """The trial's value of ``param`` (Optuna's suggest_*; a retried trial gets its original's value)."""
    if param.type == "categorical":
        return trial.suggest_categorical(name, param.choices)
    if param.type == "int":
        return trial.suggest_int(name, param.low, param.high, step=param.step, log=param.log)
    return trial.suggest_float(name, param.low, param.high, step=param.step, log=param.log)

"""A study's result directory: the small data files its tables and figures are made from, written from the
run directories (``collect``) and read back without them (``load``), so a committed copy regenerates everything.

    study.json          what was measured: title, seeds, the paper's tables, the tasks (metrics, curve tags,
                        training fraction and the task without it, the paper's task key) and the init methods
    results.csv         one row per run: status, wall seconds, precision, the last value of each metric, the
                        persistence score at the end and the half-life, the error of a failed run, and the run's
                        fingerprint (``Run.fingerprint``: its command and config contents, without paths)
    curves.csv.gz       every finished run's curves: task, init, seed, tag, step, epoch, value (at most
                        MAX_POINTS points per series; gzip without a timestamp, so rewriting is byte-stable)
    attention_maps.npz  the first seed's attention maps at the start and the end of training, per task and init
                        (keys ``<task>/<init>/start``, ``.../end``, ``.../structure``, ``.../start_step``, ...)

A study continues from these files alone (on another machine, in a checkout, on a cluster whose scratch was purged):
given them as ``results_from`` (one directory or several), each finished row whose fingerprint matches the run the
study would run stands for that run, which is kept (row, curves, maps) and not rerun (:func:`kept_rows`). They are
the lasting record once run directories are purged: rebuilding the files keeps every finished row of the out_dir's
own files that no run directory recomputes (:func:`rows_on_files` names them).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_maskprior.metrics import HALF_LIFE, PERSISTENCE, SCORE
from lightning_maskprior.run import atomic, config_files
from lightning_maskprior.run.config_files import option_values
from lightning_maskprior.run.rundir import ResultDir, StudyRunDir
from lightning_maskprior.run.status import FINISHED
from lightning_maskprior.study.spec import Metric, Run, Study, StudyError, TaskEntry, composed_config

MAX_POINTS = 120  # per (run, tag) series in curves.csv.gz: enough for a smooth line, small enough to commit
FRACTION_OPTION = "--data.init_args.train_fraction"
SUMMARY = re.compile(rf"^{PERSISTENCE}/[^/]+$")  # the means over layers and heads, not per-head series


@dataclass
class TaskInfo:
    name: str
    paper: str  # the task's key in paper_results.TABLES
    metrics: list[Metric]
    curves: list[str]
    train_fraction: float | None = None  # what the task's configs and arguments set (``task_fraction``), if anything
    series: str | None = None  # the task without its fraction (``sweep_series``): tasks that share it form one sweep
    inits: list[str] | None = None  # the init labels its row runs (None: all)


@dataclass
class InitInfo:
    name: str  # the init method
    label: str  # its column and directory name
    variant: str | None = None  # what the study adds to the method's task defaults (config files, arguments);
    # "" for nothing, None where study.json does not record it (published results such as docs/results/cyclic3_cpu)


@dataclass
class RunRow:
    task: str
    init: str  # the init's label
    seed: int
    status: str  # ok, diverged, failed, interrupted, pending
    seconds: float | None = None
    precision: str | None = None
    values: dict[str, float] = field(default_factory=dict)  # tag -> last logged value (metrics, score, half-life)
    error: str = ""
    fingerprint: str = ""  # Run.fingerprint() of the run that produced the row ("" where results.csv has none, as
    # in published results such as docs/results/cyclic3_cpu; such a row never stands for a run)


@dataclass
class ResultSet:
    """Everything a report needs, read from a result directory."""

    path: Path
    title: str
    seeds: list[int]
    paper_tables: list[str]
    tasks: list[TaskInfo]
    inits: list[InitInfo]
    runs: list[RunRow]
    curves: dict[tuple[str, str, int, str], list[tuple[int, float | None, float]]] | None = None  # (step, epoch, v)
    maps: dict[tuple[str, str], dict[str, Any]] | None = None  # (task, init) -> arrays

    def runs_of(self, task: str, init: str, status: str | None = "ok") -> list[RunRow]:
        return [r for r in self.runs if r.task == task and r.init == init and (status is None or r.status == status)]


# ------------------------------------------------------------------------------------- from the runs
def train_fraction(args: list[str]) -> float | None:
    """The last ``--data.init_args.train_fraction`` in ``args`` (None if none or not a number)."""
    values = [value for _, _, value, _ in option_values(args, (FRACTION_OPTION,))]
    try:
        return float(values[-1]) if values else None
    except ValueError:
        return None


def task_fraction(study: Study, task: TaskEntry) -> float | None:
    """The training fraction a task's runs train on: the last ``--data.init_args.train_fraction`` of the study's and
    the task's arguments, else what the CLI's default configs and the task's config files compose to (None where
    neither sets one, or the value is not a number)."""
    value = train_fraction([*study.args, *task.args])
    if value is not None:
        return value
    data = composed_config([*config_files.default_files(), *task.config]).get("data")
    data = data if isinstance(data, dict) else {}
    init_args = data.get("init_args")
    value = (init_args if isinstance(init_args, dict) else data).get("train_fraction")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def sweep_series(study: Study, task: TaskEntry) -> str:
    """A task without its training fraction, as text: its config files (by name) and its and the study's arguments
    less ``--data.init_args.train_fraction``. Tasks with the same series differ by their fraction alone."""
    args = [str(a) for a in [*study.args, *task.args]]
    dropped = {i for index, _, _, inline in option_values(args, (FRACTION_OPTION,))
               for i in ((index,) if inline else (index - 1, index))}
    return init_variant(task.config, [a for i, a in enumerate(args) if i not in dropped])


def init_variant(configs: list[Path], args: list[str]) -> str:
    """What an init entry adds to its method's task defaults: its config files (by name) and arguments."""
    return " ".join([*(Path(c).name for c in configs), *args])


def study_info(study: Study) -> dict[str, Any]:
    """The content of study.json."""
    return {
        "title": study.title,
        "study_file": study.path.name if study.path is not None else None,
        "seeds": list(study.seeds),
        "paper_tables": list(study.paper_tables),
        "tasks": [{"name": t.name, "paper": t.paper, "train_fraction": task_fraction(study, t),
                   "series": sweep_series(study, t), "metrics": [asdict(m) for m in t.metrics],
                   "curves": list(t.curves), **({"inits": t.inits} if t.inits is not None else {})}
                  for t in study.tasks],
        "inits": [{"name": i.name, "label": i.label, "variant": init_variant(i.config, i.args)} for i in study.inits],
    }


def _current(run: Run) -> dict | None:
    result = run.load_result()
    return result if run.owns(result) else None


def collect(study: Study, curves: bool = True) -> None:
    """Write study.json and results.csv into ``study.out_dir`` from the runs' result.json files, and with
    ``curves`` also curves.csv.gz and attention_maps.npz (these read every run's scalars file: slower)."""
    out = study.out_dir
    out.mkdir(parents=True, exist_ok=True)
    # results_from and out_dir's own files are read before these are rewritten: a finished row that no run
    # directory recomputes (its directory was removed) is kept, with its curves and maps
    previous = load_previous(study, maps=curves, own=True)
    kept = kept_rows(study, previous)
    atomic.write_text(out / ResultDir.STUDY, json.dumps(study_info(study), indent=1) + "\n")
    results = [(run, _current(run)) for run in study.runs()]
    tags = sorted({m.tag for t in study.tasks for m in t.metrics} | {SCORE, HALF_LIFE})
    with atomic.atomic_path(out / ResultDir.RESULTS) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "init", "seed", "status", "seconds", "precision", *tags, "error", "fingerprint"])
        for run, result in results:
            row = kept.get(run.name) if result is None else None
            if row is not None:
                writer.writerow([row.task, row.init, row.seed, row.status, "" if row.seconds is None else row.seconds,
                                 row.precision or "", *[row.values.get(t, "") for t in tags], row.error,
                                 row.fingerprint])
            elif result is None:
                writer.writerow([run.task.name, run.init.label, run.seed, "pending", "", "", *[""] * len(tags), "",
                                 ""])
            else:
                metrics = result.get("metrics", {})
                error = result.get("error", "").strip().splitlines()[-1:] or [""]
                writer.writerow([run.task.name, run.init.label, run.seed, result.get("status", "?"),
                                 result.get("seconds", ""), result.get("precision") or "",
                                 *[metrics.get(t, "") for t in tags], error[0], run.fingerprint()])
    if curves:
        finished = [(run, result) for run, result in results if result is not None and result.get("status") == "ok"]
        from_files = [run for run, result in results if result is None and run.name in kept]
        _write_curves(out / ResultDir.CURVES, finished, previous, from_files)
        _write_maps(out / ResultDir.MAPS, [run for run, _ in finished if run.seed == study.seeds[0]], previous,
                    [run for run in from_files if run.seed == study.seeds[0]])


def load_previous(study: Study, maps: bool = True, own: bool = False) -> ResultSet | None:
    """The result directories of ``study.results_from`` (with ``own``, then ``study.out_dir``'s own files where they
    can be read) read as one (None if there are none): for each run of the study, the row of the first directory
    that finished it with the run's fingerprint, and its curves (and its maps, for the first seed) from the first
    such directory that has them: a directory joined from tables alone may hold the row of a run whose curves are in
    another. Rows that match no run of the study are left out. A StudyError naming a results_from directory whose
    files are cut short or corrupt."""
    sets = []
    for path in study.results_from:
        try:
            sets.append(load(path, maps=maps))
        except ResultFileError as err:
            raise StudyError(f"results_from: {err}") from None
    if own and study.out_dir.resolve() not in {Path(p).resolve() for p in study.results_from}:
        sets += _own_files(study.out_dir, maps)
    if len(sets) <= 1:
        return sets[0] if sets else None
    wanted = {(run.task.name, run.init.label, run.seed): run.fingerprint() for run in study.runs()}
    merged = ResultSet(sets[0].path, sets[0].title, sets[0].seeds, sets[0].paper_tables, sets[0].tasks,
                       sets[0].inits, runs=[], curves={}, maps={} if maps else None)
    taken: set[tuple[str, str, int]] = set()
    with_curves: set[tuple[str, str, int]] = set()
    for found in sets:
        for row in found.runs:
            key = (row.task, row.init, row.seed)
            if row.status not in FINISHED or not row.fingerprint or wanted.get(key) != row.fingerprint:
                continue
            if key not in taken:
                taken.add(key)
                merged.runs.append(row)
            if key not in with_curves:
                curves = {k: v for k, v in (found.curves or {}).items() if k[:3] == key}
                merged.curves.update(curves)
                if curves:
                    with_curves.add(key)
            if maps and row.seed == study.seeds[0] and (row.task, row.init) not in merged.maps \
                    and (row.task, row.init) in (found.maps or {}):
                merged.maps[(row.task, row.init)] = found.maps[(row.task, row.init)]
    return merged


def kept_rows(study: Study, previous: ResultSet | None = None) -> dict[str, RunRow]:
    """The finished rows (ok or diverged) of ``study.results_from`` (``previous``, if already loaded) that stand
    for runs whose directory has no result of their own, by run name: those whose fingerprint is the run's."""
    previous = previous if previous is not None else load_previous(study, maps=False)
    if previous is None:
        return {}
    rows = previous.runs
    by_name = {f"{r.task}/{r.init}/seed{r.seed}": r for r in rows if r.status in FINISHED and r.fingerprint}
    return {run.name: by_name[run.name] for run in study.runs() if run.name in by_name
            and by_name[run.name].fingerprint == run.fingerprint() and run.load_result() is None}


def _own_files(out_dir: Path, maps: bool) -> list[ResultSet]:
    """The study's own result files in ``out_dir``, as a list of one (none where there are none, or where they are
    cut short or corrupt: rewriting them from the runs is how they are mended)."""
    if not ResultDir.holds_results(out_dir):
        return []
    try:
        return [load(out_dir, maps=maps)]
    except ResultFileError:
        return []


def rows_on_files(result: ResultSet) -> list[RunRow]:
    """The finished rows of ``result`` that rest on its data files alone: no run directory beside them
    (``<task>/<init>/seed<k>/result.json``) holds the run's result (it was removed, or the files were copied)."""
    return [row for row in result.runs if row.status in FINISHED
            and not StudyRunDir(result.path / row.task / row.init / f"seed{row.seed}").result.is_file()]


def fit_log_dir(run_dir: Path) -> Path:
    """The fit's run directory (not the test's): the one fit.json names, else the study's run directory."""
    try:
        logged = Path(json.loads(StudyRunDir(run_dir).fit_done.read_text())["log_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir
    local = run_dir / StudyRunDir.LOGS / logged.name  # the same run seen from another machine or mount
    return local if local.is_dir() else (logged if logged.is_dir() else run_dir)


def steps_per_epoch(scalars: dict[str, list[tuple[int, float]]]) -> float | None:
    """Optimizer steps per epoch: Lightning logs a validation at step (e + 1) * steps_per_epoch - 1 with epoch e."""
    epochs = dict(scalars.get("epoch", []))
    guesses = Counter(round((step + 1) / (epochs[step] + 1), 3) for tag, points in scalars.items()
                      if tag.startswith("val/") for step, _ in points if step in epochs)
    return guesses.most_common(1)[0][0] if guesses else None


def kept_tags(present: set[str], curves: list[str]) -> list[str]:
    """The curve tags, the MDI's counterparts of them (val/acc -> val/mdi_acc), and the persistence summaries."""
    wanted = [t for t in curves if t in present]
    wanted += [reference_tag(t) for t in wanted if reference_tag(t) in present]
    wanted += sorted(t for t in present if SUMMARY.match(t))
    return list(dict.fromkeys(wanted))


def reference_tag(tag: str) -> str:
    """The tag of the min-degree interpolator's value of a metric: ``val/acc`` -> ``val/mdi_acc``."""
    prefix, _, name = tag.rpartition("/")
    return f"{prefix}/mdi_{name}" if prefix else f"mdi_{name}"


def downsample(points: list, limit: int = MAX_POINTS) -> list:
    """At most ``limit`` points, evenly spread over the series, the first and the last always kept."""
    if len(points) <= limit:
        return list(points)
    index = sorted({round(i * (len(points) - 1) / (limit - 1)) for i in range(limit)})
    return [points[i] for i in index]


def _write_curves(path: Path, runs: list[tuple[Run, dict]], previous: ResultSet | None = None,
                  kept: list[Run] = ()) -> None:
    """Every run's curves from its scalars file (TensorBoard events for a run without one); the ``kept`` runs'
    from the ``previous`` curves file."""
    from lightning_maskprior.run.scalars import read_scalars

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["task", "init", "seed", "tag", "step", "epoch", "value"])
    old_curves = (previous.curves if previous is not None else None) or {}
    wanted = {(run.task.name, run.init.label, run.seed) for run in kept}
    for (task, init, seed, tag), points in old_curves.items():
        if (task, init, seed) in wanted:
            for step, epoch, value in points:
                writer.writerow([task, init, seed, tag, step, "" if epoch is None else f"{epoch:.4g}", f"{value:.6g}"])
    for run, _ in runs:
        scalars = read_scalars(fit_log_dir(run.dir))
        per_epoch = steps_per_epoch(scalars)
        for tag in kept_tags(set(scalars), run.task.curves):
            # The persistence callback logs at the global step (after that many updates); Lightning logs a batch's
            # metrics at the step before its update. Epochs elapsed are therefore step / spe and (step + 1) / spe.
            shift = 0 if tag.startswith(f"{PERSISTENCE}/") else 1
            for step, value in downsample(scalars[tag]):
                epoch = "" if per_epoch is None else f"{(step + shift) / per_epoch:.4g}"
                writer.writerow([run.task.name, run.init.label, run.seed, tag, step, epoch, f"{value:.6g}"])
    with atomic.atomic_path(path) as tmp, open(tmp, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(text.getvalue().encode())


def _write_maps(path: Path, runs: list[Run], previous: ResultSet | None = None, kept: list[Run] = ()) -> None:
    """The first seed's attention maps from the run directories; the ``kept`` runs' from the ``previous`` file."""
    import numpy as np

    arrays = {}
    old_maps = (previous.maps if previous is not None else None) or {}
    for run in kept:
        for name, array in old_maps.get((run.task.name, run.init.label), {}).items():
            arrays[f"{run.task.name}/{run.init.label}/{name}"] = array
    for run in runs:
        if StudyRunDir(run.dir).maps.is_file():
            with np.load(StudyRunDir(run.dir).maps) as data:
                arrays.update({f"{run.task.name}/{run.init.label}/{key}": data[key] for key in data.files})
    if arrays:
        with atomic.atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
    else:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ from the files
def _float(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


class ResultFileError(ValueError):
    """A result directory's data file that is cut short, corrupt or unreadable; the message names the file."""


STATUSES = ("ok", "diverged", "failed", "interrupted", "pending")
PRECISION = re.compile(r"^(64|32|16|bf16)(-(true|mixed))?$|^transformer-engine(-float16)?$")


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ResultFileError(f"{path}: cannot read the {what}: {err.strerror or err}") from None


def _study_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(_read(path, "study description"))
        for key in ("title", "seeds", "paper_tables", "tasks", "inits"):
            info[key]  # noqa: B018 - present, or the KeyError below names it
    except json.JSONDecodeError as err:
        raise ResultFileError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}): cut short or corrupt; "
                              "`maskprior study -c FILE --table_only true` rewrites it from the runs") from None
    except (KeyError, TypeError) as err:
        raise ResultFileError(f"{path} lacks {err}: expected what a study writes (title, seeds, tasks, "
                              "paper_tables, inits)") from None
    return info


def _results_rows(path: Path, info: dict[str, Any]) -> list[RunRow]:
    """results.csv's rows, refused (naming the file and the row) when a row is cut short or a value is not what a
    study writes, when a row is not of a run of study.json or repeats one (a mean would count it twice), or when a
    run of study.json has no row: a file cut at a row boundary is incomplete too."""
    fixed = {"task", "init", "seed", "status", "seconds", "precision", "error", "fingerprint"}
    reader = csv.DictReader(io.StringIO(_read(path, "results table"), newline=""))
    runs = []
    expected = {(t["name"], i["label"], int(s)) for t in info["tasks"] for i in info["inits"]
                for s in info["seeds"] if i["label"] in (t.get("inits") or [i["label"]])}
    lines: dict[tuple[str, str, int], int] = {}  # the line of each run's row: one row per run
    for number, row in enumerate(reader, start=2):
        where = f"{path}, line {number}"
        if None in row or None in row.values():
            raise ResultFileError(f"{where} has {len(row) - (None in row) - sum(v is None for v in row.values())} "
                                  f"of the header's {len(reader.fieldnames or [])} fields: cut short or corrupt")
        try:
            seed = int(row["seed"])
        except (KeyError, ValueError):
            raise ResultFileError(f"{where}: seed {row.get('seed')!r} is not a whole number") from None
        if row.get("status") not in STATUSES:
            raise ResultFileError(f"{where}: status {row.get('status')!r}; expected one of {', '.join(STATUSES)}")
        if row.get("precision") and not PRECISION.match(row["precision"]):
            raise ResultFileError(f"{where}: precision {row['precision']!r} is not a Lightning precision: cut short?")
        run = (row["task"], row["init"], seed)
        if run not in expected:
            tasks, inits = [t["name"] for t in info["tasks"]], [i["label"] for i in info["inits"]]
            raise ResultFileError(f"{where}: run {'/'.join(map(str, run))} is not one of the study's runs (tasks "
                                  f"{tasks}, inits {inits}, seeds {list(info['seeds'])}): expected one row per run of "
                                  "study.json; `maskprior study -c FILE --table_only true` rewrites it")
        if run in lines:
            raise ResultFileError(f"{where}: a second row for run {'/'.join(map(str, run))} (the first is line "
                                  f"{lines[run]}): expected one row per run; `maskprior study -c FILE --table_only "
                                  "true` rewrites it")
        lines[run] = number
        values = {k: v for k, v in ((k, _float(v)) for k, v in row.items() if k not in fixed) if v is not None}
        runs.append(RunRow(row["task"], row["init"], seed, row["status"], _float(row.get("seconds")),
                           row.get("precision") or None, values, row.get("error") or "",
                           row.get("fingerprint") or ""))
    missing = expected - lines.keys()
    if missing:
        first = "/".join(map(str, sorted(missing)[0]))
        raise ResultFileError(f"{path} has no row for {len(missing)} of the study's {len(expected)} runs (e.g. "
                              f"{first}): cut short; `maskprior study -c FILE --table_only true` rewrites it")
    return runs


def _curves(path: Path) -> dict[tuple[str, str, int, str], list]:
    curves: dict[tuple[str, str, int, str], list] = {}
    try:
        with gzip.open(path, "rt", newline="") as f:
            for number, row in enumerate(csv.DictReader(f), start=2):
                try:
                    key = (row["task"], row["init"], int(row["seed"]), row["tag"])
                    point = (int(row["step"]), _float(row["epoch"]), float(row["value"]))
                except (KeyError, TypeError, ValueError):
                    raise ResultFileError(f"{path}, line {number}: not a curve point (task, init, seed, tag, step, "
                                          "epoch, value): cut short or corrupt") from None
                curves.setdefault(key, []).append(point)
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as err:
        raise ResultFileError(f"{path}: cannot read the curves ({type(err).__name__}: {err}): cut short or "
                              "corrupt; rerun the study (or `--table_only true`) to rewrite it") from None
    return curves


def load(path: str | Path, maps: bool = True, curves: bool = True) -> ResultSet:
    """Read a result directory (study.json and results.csv; with ``curves`` and ``maps`` also curves.csv.gz and
    attention_maps.npz if there).

    A data file that is cut short, corrupt or unreadable raises ResultFileError naming it."""
    path = Path(path)
    for name in (ResultDir.STUDY, ResultDir.RESULTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a study's result directory: it has no {name} (a study writes "
                                    "it; `maskprior study -c FILE --table_only true` rewrites it from the runs)")
    info = _study_info(path / ResultDir.STUDY)
    tasks = [TaskInfo(t["name"], t["paper"], [Metric(**m) for m in t["metrics"]], list(t["curves"]),
                      t["train_fraction"], t.get("series"), t.get("inits")) for t in info["tasks"]]
    inits = [InitInfo(i["name"], i["label"], i.get("variant")) for i in info["inits"]]
    runs = _results_rows(path / ResultDir.RESULTS, info)
    result = ResultSet(path, info["title"], list(info["seeds"]), [str(t) for t in info["paper_tables"]],
                       tasks, inits, runs)
    if curves and (path / ResultDir.CURVES).is_file():
        result.curves = _curves(path / ResultDir.CURVES)
    if maps and (path / ResultDir.MAPS).is_file():
        import numpy as np

        result.maps = {}
        try:
            with np.load(path / ResultDir.MAPS) as data:
                for key in data.files:
                    task, init, name = key.split("/", 2)
                    result.maps.setdefault((task, init), {})[name] = data[key]
        except (OSError, ValueError, EOFError) as err:
            raise ResultFileError(f"{path / ResultDir.MAPS}: cannot read the attention maps ({err}): cut short or "
                                  "corrupt") from None
    return result

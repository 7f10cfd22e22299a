"""What a tune leaves in its out_dir, and the report made from it.

    tune.json       which study the directory holds (its name, storage, tune file), written by the first worker
    trials.json     every trial of the study (state, value, parameters, intermediate values, its runs), rewritten
                    from the storage after every trial: the lasting record, from which the report works alone
    best.yaml       the best trial's full fit configuration: ``maskprior fit -c <out_dir>/best.yaml``
    trials.md, trials.csv    the trials table (``maskprior report <out_dir>``)
    figures/        history.png, importance.png, slice.png, intermediate.png (Optuna's matplotlib plots)
    trial_000k/     trial k's run directory (``lightning_maskprior.load_run`` opens it)
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from lightning_maskprior.run import atomic

TUNE = "tune.json"
TRIALS = "trials.json"
BEST = "best.yaml"
TABLE = "trials.md"
TABLE_CSV = "trials.csv"
FIGURES = "figures"
PLOTS = ("history", "importance", "slice", "intermediate")  # the figures, in the order trials.md shows them


_SQLITE = re.compile(r"(sqlite:///)(/[^\s\"']+)")
_ABSOLUTE = re.compile(r"(?<![\w.~/:-])/[\w.+@=-]+(?:/[\w.+@=-]+)*")  # not within a relative path or a URL


def portable(text: str, tune_dir: Path, cwd: Path | None = None) -> tuple[str, list[str]]:
    """A tune record's ``text`` with this machine's paths made portable, for publishing (``maskprior report DIR
    --out_dir docs/results/NAME``): a packaged config as ``configs/<name>``, a path under the working directory
    relative to it, the tune's own directory (``tune_dir``; its SQLite storage) by its name. Returns the text and
    the absolute paths left (none of those)."""
    from lightning_maskprior.run import config_files

    cwd = (cwd or Path.cwd()).resolve()
    tune_dir = Path(tune_dir).resolve()
    packaged = config_files.packaged_dir().resolve()

    def relative(path: str) -> str:
        resolved = Path(path)
        for root, named in ((tune_dir, Path(tune_dir.name)), (packaged, Path("configs")), (cwd, Path())):
            if resolved.is_relative_to(root):
                return str(named / resolved.relative_to(root)) if resolved != root else str(named or ".")
        parts = resolved.parts
        if "configs" in parts:  # a config of another checkout or install: the packaged config of that name
            name = Path(*parts[len(parts) - parts[::-1].index("configs"):])
            if config_files.packaged(name) is not None:
                return str(Path("configs") / name)
        return path

    text = _SQLITE.sub(lambda m: m.group(1) + relative(m.group(2)), text)
    text = _ABSOLUTE.sub(lambda m: relative(m.group(0)), text)
    return text, sorted(set(_ABSOLUTE.findall(text)) | {m.group(2) for m in _SQLITE.finditer(text)
                                                        if m.group(2).startswith("/")})


def holds_tune(path: str | Path) -> bool:
    """Whether ``path`` is a tune's out_dir (it holds tune.json and trials.json)."""
    return (Path(path) / TUNE).is_file() and (Path(path) / TRIALS).is_file()


def finished_metrics(run_dir: str | Path) -> dict[str, float]:
    """The last logged value of every scalar of a finished run (the one place a tune reads a run's metrics)."""
    from lightning_maskprior.run.tensorboard import last_scalars

    return last_scalars(run_dir)


def trial_record(trial: Any) -> dict[str, Any]:
    """One Optuna FrozenTrial as plain JSON."""
    from optuna.distributions import distribution_to_json

    def time(value: Any) -> str | None:
        return value.isoformat() if value is not None else None

    return {
        "number": trial.number, "state": trial.state.name, "value": trial.value,
        "params": trial.params,
        "distributions": {k: distribution_to_json(d) for k, d in trial.distributions.items()},
        "intermediate_values": {str(k): v for k, v in sorted(trial.intermediate_values.items())},
        "user_attrs": trial.user_attrs,
        "retries": trial.system_attrs.get("failed_trial"),  # the trial this one retries, if any
        "datetime_start": time(trial.datetime_start), "datetime_complete": time(trial.datetime_complete),
    }


def write_trials(out_dir: Path, info: dict[str, Any], trials: list[Any]) -> None:
    """Rewrite ``out_dir/trials.json`` from the storage's trials (atomically: concurrent workers each write all)."""
    data = {**info, "trials": [trial_record(t) for t in sorted(trials, key=lambda t: t.number)]}
    atomic.write_text(Path(out_dir) / TRIALS, json.dumps(data, indent=1, default=str) + "\n")


def read_trials(out_dir: Path) -> dict[str, Any]:
    data = json.loads((Path(out_dir) / TRIALS).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("trials"), list):
        raise ValueError(f"{Path(out_dir) / TRIALS} holds no trials list; expected the file a tune writes")
    return data


def best_of(data: dict[str, Any]) -> dict[str, Any] | None:
    """The best complete trial of a trials record, or None."""
    done = [t for t in data["trials"] if t["state"] == "COMPLETE" and t["value"] is not None
            and math.isfinite(t["value"])]
    if not done:
        return None
    pick = min if data["objective"]["direction"] == "minimize" else max
    return pick(done, key=lambda t: (t["value"], -t["number"]) if pick is max else (t["value"], t["number"]))


def note(trial: dict[str, Any]) -> str:
    """What the table says of a trial beyond its value: pruned where, retried from which, why it failed."""
    attrs = trial["user_attrs"]
    parts = []
    if attrs.get("excluded"):
        parts.append(f"not counted: {attrs['excluded']}")
    if trial["retries"] is not None:
        parts.append(f"retries trial {trial['retries']}")
    if attrs.get("pruned_step") is not None:
        parts.append(f"pruned at step {attrs['pruned_step']}")
    if attrs.get("error"):
        parts.append(str(attrs["error"]).splitlines()[-1][:160])
    return "; ".join(parts)


def _number(value: Any, digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def table_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The trials table: header and one row per trial (as the CSV holds them)."""
    names = list(data.get("search") or {})
    metric = data["objective"]["metric"]
    header = ["trial", "state", metric, *names, "minutes", "run", "note"]
    rows = []
    for trial in data["trials"]:
        seconds = trial["user_attrs"].get("seconds")
        rows.append([str(trial["number"]), trial["state"], _number(trial["value"], 6),
                     *[_number(trial["params"].get(n), 6) for n in names],
                     f"{seconds / 60:.1f}" if isinstance(seconds, int | float) else "",
                     str(trial["user_attrs"].get("dir", "")), note(trial)])
    return header, rows


def markdown(data: dict[str, Any], figures: list[str]) -> str:
    header, rows = table_rows(data)
    best = best_of(data)
    objective = data["objective"]
    states: dict[str, int] = {}
    for t in data["trials"]:
        states[t["state"]] = states.get(t["state"], 0) + 1
    counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items()))
    lines = [f"# {data.get('title', 'tune')}", "",
             f"Optuna study {data.get('study_name')!r}: {len(data['trials'])} trials ({counts}) of "
             f"{data.get('n_trials')}; objective {objective['metric']} ({objective['direction']}, the mean over each "
             f"trial's runs).", ""]
    if best is not None:
        params = ", ".join(f"{k} = {_number(v, 6)}" for k, v in best["params"].items())
        lines += [f"Best: trial {best['number']}, {objective['metric']} {_number(best['value'], 6)} ({params}); "
                  f"its configuration: [{BEST}]({BEST}).", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i in (0, 2) else "---"
                                                              for i in range(len(header))) + "|"]
    for row in rows:
        if best is not None and row[0] == str(best["number"]):
            row = [f"**{c}**" if c else c for c in row]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    lines.append("")
    for name in figures:
        lines += [f"![{Path(name).stem}]({name})", ""]
    return "\n".join(lines)


def study_of(data: dict[str, Any]) -> Any:
    """An in-memory Optuna study holding the record's finished trials (for Optuna's plots)."""
    import optuna
    from optuna.distributions import json_to_distribution
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line for the in-memory study
    study = optuna.create_study(direction=data["objective"]["direction"])
    for t in data["trials"]:
        state = TrialState[t["state"]]
        if state not in (TrialState.COMPLETE, TrialState.PRUNED):
            continue
        study.add_trial(create_trial(
            state=state, value=t["value"] if state == TrialState.COMPLETE else None, params=t["params"],
            distributions={k: json_to_distribution(d) for k, d in t["distributions"].items()},
            intermediate_values={int(k): v for k, v in t["intermediate_values"].items()},
            user_attrs=t["user_attrs"]))
    return study


def write_figures(data: dict[str, Any], out_dir: Path) -> tuple[list[str], list[str]]:
    """Optuna's matplotlib plots of the record (history, importance, slice, intermediate values) as PNGs under
    ``out_dir/figures``. Returns the figures written and a line for each one that could not be drawn."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as plots

    study = study_of(data)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    wanted = [("history", plots.plot_optimization_history, 1), ("importance", plots.plot_param_importances, 2),
              ("slice", plots.plot_slice, 1)]
    if any(t.intermediate_values for t in study.trials):
        wanted.append(("intermediate", plots.plot_intermediate_values, 0))
    folder = Path(out_dir) / FIGURES
    folder.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    # Optuna's plots switch the process's matplotlib style to ggplot (plt.style.use); rc_context undoes it, so
    # a study's figures drawn after a tune's in one process (`maskprior report` over both) keep their own look.
    with matplotlib.rc_context():
        for name, plot, needs in wanted:
            path = folder / f"{name}.png"
            if len(complete) < needs:
                skipped.append(f"{name}: needs {needs} complete trials, the study has {len(complete)}")
                path.unlink(missing_ok=True)
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                    axes = plot(study)
                figure = (axes.flat[0] if hasattr(axes, "flat") else axes).get_figure()
                figure.set_size_inches(max(figure.get_size_inches()[0], 7), max(figure.get_size_inches()[1], 4.5))
                figure.savefig(path, dpi=120, bbox_inches="tight")
                plt.close(figure)
                written.append(f"{FIGURES}/{name}.png")
            except Exception as err:  # noqa: BLE001  (a plot Optuna cannot draw for this study: say so, draw the rest)
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                skipped.append(f"{name}: {first}")
                plt.close("all")
                path.unlink(missing_ok=True)
    return written, skipped


def figure_names(out_dir: str | Path) -> list[str]:
    """The plots there are under ``out_dir/figures``, in the order trials.md shows them."""
    return [f"{FIGURES}/{name}.png" for name in PLOTS if (Path(out_dir) / FIGURES / f"{name}.png").is_file()]


def render(out_dir: str | Path, figures: bool = True) -> Path:
    """Write trials.md, trials.csv (and the figures) of the tune in ``out_dir``; returns trials.md's path."""
    out_dir = Path(out_dir)
    data = read_trials(out_dir)
    header, rows = table_rows(data)
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([header, *rows])
    atomic.write_text(out_dir / TABLE_CSV, text.getvalue())
    if figures:
        _, skipped = write_figures(data, out_dir)
        for line in skipped:
            print(f"{out_dir / FIGURES}: not drawn: {line}")
    atomic.write_text(out_dir / TABLE, markdown(data, figure_names(out_dir)))
    return out_dir / TABLE


def stale_table(path: str | Path) -> list[str]:
    """The tune's trials.md if it differs from what its trials.json gives (``maskprior report --check``)."""
    table = Path(path) / TABLE
    expected = markdown(read_trials(Path(path)), figure_names(path))
    return [] if table.is_file() and table.read_text() == expected else [str(table)]


def publish(path: str | Path, out_dir: str | Path | None = None, figures: bool = True) -> Path:
    """The tune's trials table and plots, into ``out_dir`` (default: ``path``). Another directory also gets a copy
    of the tune's record (tune.json, trials.json, best.yaml) with portable paths, best.yaml's "Run it" line naming
    the copy; each absolute path still in a copy is printed. Returns trials.md's path."""
    path = Path(path)
    out = Path(out_dir) if out_dir is not None else path
    if out.resolve() != path.resolve():
        out.mkdir(parents=True, exist_ok=True)
        for name in (TUNE, TRIALS, BEST):
            if (path / name).is_file():
                text, left = portable((path / name).read_text(), path)
                if name == BEST:
                    text = re.sub(r"(?m)^# Run it: maskprior fit -c .*$", f"# Run it: maskprior fit -c {out / name}",
                                  text)
                (out / name).write_text(text)
                for absolute in left:
                    print(f"{out / name}: names {absolute}, a path of this machine")
    return render(out, figures=figures)


def write_best(out_dir: Path, data: dict[str, Any]) -> Path | None:
    """Write ``best.yaml``: the full fit configuration of the best trial's first run (its task's configs and
    overrides, the trial's values, its first seed), which ``maskprior fit -c best.yaml`` runs as is. None when no
    trial has completed."""
    import yaml

    from lightning_maskprior.study.spec import format_command, print_fit_config

    best = best_of(data)
    if best is None or not best["user_attrs"].get("fit_args"):
        return None
    args = list(best["user_attrs"]["fit_args"])
    config = yaml.safe_load(print_fit_config(args))
    objective = data["objective"]
    header = [f"Best trial of the tune {data.get('title')!r} (Optuna study {data.get('study_name')!r}): trial "
              f"{best['number']}, {objective['metric']} {_number(best['value'], 6)} ({objective['direction']}).",
              "Its parameters: " + ", ".join(f"{k} = {_number(v, 6)}" for k, v in best["params"].items()) + ".",
              "The full configuration of its first run, from:", f"  {format_command(args)}",
              f"Run it: maskprior fit -c {Path(out_dir) / BEST}"]
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(config, sort_keys=False)
    atomic.write_text(Path(out_dir) / BEST, text)
    return Path(out_dir) / BEST

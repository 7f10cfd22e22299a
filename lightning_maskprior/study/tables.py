"""A study's tables in the paper's layout, from its result directory (results.py): table.md (one table per metric,
tasks as rows, init methods as columns, the paper's number in a row beneath ours, the best mean in bold; then wall
time, persistence score at the end and half-life), table.csv (the same numbers, machine-readable) and per_seed.csv
(every run's values behind the means).
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

from lightning_maskprior.metrics import HALF_LIFE, SCORE
from lightning_maskprior.run.rundir import ResultDir
from lightning_maskprior.run.status import FINISHED
from lightning_maskprior.study import paper_results
from lightning_maskprior.study.results import InitInfo, ResultSet, RunRow, TaskInfo
from lightning_maskprior.study.spec import Metric


@dataclass
class Cell:
    """One task x init entry of a table: the mean / sample std over its n counted seeds, and the paper's number."""

    mean: float | None = None
    std: float | None = None
    n: int = 0
    paper: float | None = None
    diverged: int = 0
    text: str | None = None  # shown instead of the number (half-life: "never")


def method_label(init: InitInfo) -> str:
    """The paper's name of the method (QK-SVD, Mask, ...), or of a named variant of it ("QK-SVD (positions x50)"),
    unless the study gave the init a label of its own."""
    if init.label == init.name:
        return paper_results.METHOD_LABELS.get(init.name, init.label)
    return paper_results.VARIANT_LABELS.get(init.label, init.label)


def _without_curves(result: ResultSet) -> list[str]:
    """The ok runs of a result directory with curves.csv.gz that have no point in it (none if it has no file)."""
    if result.curves is None:
        return []
    with_curves = {key[:3] for key in result.curves}
    return [f"{r.task}/{r.init}/seed{r.seed}" for r in result.runs
            if r.status == "ok" and (r.task, r.init, r.seed) not in with_curves]


def _never_logged(result: ResultSet) -> list[str]:
    """``task: tag`` for each metric of a task that none of its finished runs logged (a misspelt tag)."""
    never = []
    for task in result.tasks:
        finished = [r for r in result.runs if r.task == task.name and r.status == "ok"]
        if finished:
            never += [f"{task.name}: {m.tag}" for m in task.metrics if not any(m.tag in r.values for r in finished)]
    return never


def _columns_note(result: ResultSet) -> str | None:
    """Which variant each column is: the method's task defaults (the paper's settings) plus what the study adds;
    None for a study whose study.json does not record it."""
    if any(i.variant is None for i in result.inits):
        return None
    parts = [f"{method_label(i)}: `{i.name}`" + (f" + `{i.variant}`" if i.variant else "") for i in result.inits]
    return ("- Columns: each init method with its task's defaults (the paper's settings where the paper states them"
            "), plus what the study adds: " + "; ".join(parts) + ".")


def _stats(values: list[float]) -> Cell:
    """Mean and sample std; no std from a single value (it is undefined, not 0)."""
    if not values:
        return Cell()
    return Cell(statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None, len(values))


def metric_cell(result: ResultSet, task: TaskInfo, init: InitInfo, metric: Metric) -> Cell:
    ok = result.runs_of(task.name, init.label)
    cell = _stats([r.values[metric.tag] * metric.scale for r in ok if metric.tag in r.values])
    cell.diverged = len(result.runs_of(task.name, init.label, "diverged"))
    if result.paper_tables and metric.paper is not None:
        cell.paper = paper_results.paper_value(result.paper_tables, task.paper, init.name, metric.paper)
    return cell


def wall_cell(result: ResultSet, task: TaskInfo, init: InitInfo) -> Cell:
    return _stats([r.seconds / 60 for r in result.runs_of(task.name, init.label) if r.seconds is not None])


def score_cell(result: ResultSet, task: TaskInfo, init: InitInfo) -> Cell:
    return _stats([r.values[SCORE] for r in result.runs_of(task.name, init.label) if SCORE in r.values])


def half_life_cell(result: ResultSet, task: TaskInfo, init: InitInfo) -> Cell:
    """Mean half-life over the seeds whose score fell below 0.5; "never" when none did (score measured, no
    half-life logged)."""
    measured = [r for r in result.runs_of(task.name, init.label) if SCORE in r.values]
    cell = _stats([r.values[HALF_LIFE] for r in measured if HALF_LIFE in r.values])
    if measured and cell.n == 0:
        cell.text = "never"
    elif cell.n and cell.n < len(measured):
        cell.text = f"{cell.mean:.0f} ({cell.n}/{len(measured)} seeds; the others never)"
    return cell


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _tiny(value: float, digits: int) -> bool:
    """Nonzero, yet 0 at ``digits`` decimals (an MSE of 4.2e-05 is not 0.0000)."""
    return value != 0 and abs(value) < 0.5 * 10.0**-digits


def _shown(mean: float, digits: int, small: bool) -> float:
    """The mean as the table prints it: rounded to ``digits``, or to two significant digits when ``small``
    keeps a tiny one (see ``cell_text``)."""
    return float(f"{mean:.1e}") if small and _tiny(mean, digits) else round(mean, digits)


def cell_text(cell: Cell, digits: int, seeds: int, small: bool = False) -> str:
    """``small``: a mean too small for ``digits`` keeps two significant digits (metrics; not wall times)."""
    if cell.text is not None:
        return cell.text
    if cell.mean is None:
        return f"diverged ({cell.diverged}/{seeds} seeds)" if cell.diverged else "–"
    if small and _tiny(cell.mean, digits):  # mean and std in two significant digits
        text = f"{cell.mean:.1e}" + ("" if cell.std is None else f" ± {cell.std:.1e}")
    else:
        text = _number(cell.mean, digits) + ("" if cell.std is None else f" ± {_number(cell.std, digits)}")
    if cell.n < seeds:
        text += f" ({cell.n}/{seeds} seeds{f', {cell.diverged} diverged' if cell.diverged else ''})"
    return text


def best(cells: list[Cell], digits: int, better: str, small: bool = False) -> set[int]:
    """Indices of the best means as printed (``small``: see ``cell_text``); none when fewer than two differ
    (nothing to mark)."""
    shown = {i: _shown(c.mean, digits, small) for i, c in enumerate(cells) if c.mean is not None and c.text is None}
    if len(set(shown.values())) < 2:
        return set()
    top = (min if better == "lower" else max)(shown.values())
    return {i for i, v in shown.items() if v == top}


def _table(result: ResultSet, title: str, rows: list[tuple[TaskInfo, list[Cell]]], digits: int, level: int,
           better: str | None = None, small: bool = False) -> list[str]:
    header = ["task", *(method_label(i) for i in result.inits)]
    lines = [f"{'#' * level} {title}", "", "| " + " | ".join(header) + " |",
             "|---|" + "---:|" * len(result.inits)]
    for task, cells in rows:
        bold = best(cells, digits, better, small) if better in ("higher", "lower") else set()
        texts = [cell_text(c, digits, len(result.seeds), small) if task.inits is None or init.label in task.inits
                 else "" for c, init in zip(cells, result.inits, strict=True)]  # blank: the row does not run it
        texts = [f"**{t}**" if i in bold else t for i, t in enumerate(texts)]
        lines.append("| " + " | ".join([task.name, *texts]) + " |")
        if any(c.paper is not None for c in cells):
            lines.append("| " + " | ".join(["*paper*", *(f"*{_number(c.paper, digits)}*" if c.paper is not None
                                                         else "–" for c in cells)]) + " |")
    return [*lines, ""]


def metric_tables(result: ResultSet) -> list[tuple[Metric, list[tuple[TaskInfo, list[Cell]]]]]:
    """One table per metric label (in the order the tasks name them), over the tasks that report it."""
    labels = list(dict.fromkeys(m.label for t in result.tasks for m in t.metrics))
    tables = []
    for label in labels:
        rows, first = [], None
        for task in result.tasks:
            metric = next((m for m in task.metrics if m.label == label), None)
            if metric is not None:
                first = first or metric
                rows.append((task, [metric_cell(result, task, init, metric) for init in result.inits]))
        tables.append((first, rows))
    return tables


def _describe(metric: Metric) -> str:
    scale = f" x {metric.scale:g}" if metric.scale != 1 else ""
    better = f"; {metric.better} is better" if metric.better != "none" else ""
    return f"{metric.label} ({metric.tag}{scale}{better})"


def _precisions(result: ResultSet) -> str:
    counted = [r for r in result.runs if r.status in FINISHED]
    known = [r.precision for r in counted if r.precision]
    if not known:
        return "not recorded (these runs predate result.json's precision field)"
    counts = {p: known.count(p) for p in dict.fromkeys(known)}
    text = ", ".join(f"{p} ({n} of {len(counted)} runs)" for p, n in counts.items())
    return text if len(counts) > 1 or len(known) < len(counted) else f"{known[0]} (all {len(counted)} runs)"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def markdown(result: ResultSet, figures: list[str] | None = None, level: int = 1, link_base: str = "") -> str:
    """The study's tables as Markdown: headings from ``level`` (1 for table.md, deeper inside a README),
    links (figures, CSV files) prefixed with ``link_base``."""
    sub = level + 1
    ok = sum(r.status == "ok" for r in result.runs)
    lines = [f"{'#' * level} {result.title}", "",
             f"{_count(len(result.tasks), 'task')} x {_count(len(result.inits), 'init method')} x seeds "
             f"{result.seeds}: {_count(len(result.runs), 'run')}, {ok} ok. Mean ± sample std over seeds; precision: "
             f"{_precisions(result)}.", ""]
    for metric, rows in metric_tables(result):
        lines += _table(result, _describe(metric), rows, metric.digits, sub, metric.better, small=True)
    extra = [("Wall time per run (minutes)", wall_cell, 1),
             ("Persistence score at the end (attention mass on the structure / its value at step 0)", score_cell, 3),
             ("Half-life (optimizer steps until the persistence score falls below 0.5)", half_life_cell, 0)]
    missing = []
    for title, make, digits in extra:
        rows = [(t, [make(result, t, i) for i in result.inits]) for t in result.tasks]
        if any(c.mean is not None or c.text is not None for _, cells in rows for c in cells):
            lines += _table(result, title, rows, digits, sub)
        else:
            missing.append(title.split(" (")[0].lower())
    if figures:
        lines += [f"{'#' * sub} Figures", ""]
        lines += [f"![{Path(f).stem}]({link_base}{f})" for f in figures] + [""]
    lines += [f"{'#' * sub} Notes", ""]
    lines.append(f"- Ours: mean ± sample std over seeds {result.seeds} of each run's last logged value (no ± from "
                 "one seed; \"k/n seeds\": only k runs counted). Each seed's value: "
                 f"[{ResultDir.PER_SEED}]({link_base}{ResultDir.PER_SEED}); every run with its status: "
                 f"[{ResultDir.RESULTS}]({link_base}{ResultDir.RESULTS}).")
    columns = _columns_note(result)
    if columns:
        lines.append(columns)
    lines.append("- Bold: the best mean of each task in each metric's table; ties at the printed precision are all "
                 "bold, and nothing is bold where every method ties.")
    if any(t.inits is not None for t in result.tasks):
        lines.append("- Blank: the study does not run that init on that task (the task's `inits`).")
    if result.paper_tables:
        titles = "; ".join(paper_results.TABLES[t]["title"] for t in result.paper_tables)
        lines.append(f"- *paper*: {paper_results.PAPER}. {titles}. – where the paper has no number.")
    if missing:
        lines.append(f"- Not in results.csv, so not shown: {', '.join(missing)}.")
    never = _never_logged(result)
    if never:
        lines.append(f"- **Warning**: no finished run logged {', '.join(never)}; its cells are empty (is the tag "
                     "spelt as the runs log it? each run's scalars.csv lists them).")
    bare = _without_curves(result)
    if bare:
        shown = ", ".join(bare)  # every one: a reader of a published table sees which curves it lacks
        lines.append(f"- {len(bare)} finished run(s) have no curves in curves.csv.gz (they logged none of their task's "
                     "`curves` tags, or were kept from a result directory without their curves), so the curve figures "
                     f"leave them out: {shown}.")
    if result.curves is None:
        lines.append("- No curves.csv.gz here: the figures need the runs' curves (run the study again, then "
                     "`maskprior report`).")
    lines.append(f"- Generated by `maskprior report` from {result.path.name}/ (study.json, results.csv"
                 f"{', curves.csv.gz' if result.curves is not None else ''}); do not edit by hand.")
    for status, heading, why in (("diverged", "Diverged runs", "Not in the means: the training loss became "
                                  "non-finite."), ("failed", "Failed runs", "Not in the means; the whole error is in "
                                  "each run's result.json.")):
        runs = [r for r in result.runs if r.status == status]
        if runs:
            lines += ["", f"{'#' * sub} {heading}", "", why, ""]
            lines += [f"- {r.task}/{r.init}/seed{r.seed}: {r.error[:300]}" for r in runs]
    return "\n".join(lines).rstrip() + "\n"


def _per_seed_row(result: ResultSet, run: RunRow, labels: dict[str, Metric]) -> list:
    task = next(t for t in result.tasks if t.name == run.task)
    metrics = {m.label: m for m in task.metrics}
    values = []
    for label in labels:
        metric = metrics.get(label)
        values.append(run.values[metric.tag] * metric.scale if metric and metric.tag in run.values else "")
    return [run.task, run.init, run.seed, run.status, *values, "" if run.seconds is None else run.seconds,
            run.precision or "", run.values.get(SCORE, ""), run.values.get(HALF_LIFE, "")]


def write_csvs(result: ResultSet, out_dir: Path) -> None:
    """table.csv (``init:quantity:mean|std|n|paper`` per task: each metric, persistence score, half-life) and
    per_seed.csv (one row per run that ran, wall seconds too)."""
    tables = metric_tables(result)
    labels = {metric.label: metric for metric, _ in tables}
    with open(out_dir / ResultDir.TABLE_CSV, "w", newline="") as f:
        writer = csv.writer(f)
        quantities = [*labels, "persistence score", "half-life"]  # not wall time: it differs between two runs
        writer.writerow(["task", *(f"{i.label}:{q}:{k}" for i in result.inits for q in quantities
                                   for k in ("mean", "std", "n", "paper"))])
        for task in result.tasks:
            metrics = {m.label: m for m in task.metrics}
            row = [task.name]
            for init in result.inits:
                cells = [metric_cell(result, task, init, metrics[q]) if q in metrics else None for q in labels]
                cells += [score_cell(result, task, init), half_life_cell(result, task, init)]
                for cell in cells:
                    row += ["", "", "", ""] if cell is None else [
                        "" if v is None else v for v in (cell.mean, cell.std, cell.n, cell.paper)]
            writer.writerow(row)
    with open(out_dir / ResultDir.PER_SEED, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "init", "seed", "status", *labels, "wall_seconds", "precision",
                         "persistence_score_end", "half_life_step"])
        for run in result.runs:
            if run.status != "pending":
                writer.writerow(_per_seed_row(result, run, labels))

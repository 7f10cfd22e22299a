"""A study's outputs from its runs' ``result.json`` files: table.md / table.csv (mean +- std over seeds, the
paper's numbers beside ours), results.csv (one row per run) and PNG plots of the logged curves.

Everything here reads only the run directories, so the same table comes out wherever the runs executed.
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from pathlib import Path
from typing import Any

from lightning_maskprior import paper_results
from lightning_maskprior.study.spec import InitEntry, Metric, Run, Study, TaskEntry

MAX_PERSISTENCE_PLOTS = 16


def _stats(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample std; no std from a single value (it is undefined, not 0)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def collect(study: Study) -> dict[tuple[str, str], list[dict]]:
    """Results of runs of the current key (ok, diverged, failed, interrupted) grouped by (task, init label)."""
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
            row[(init.label, "failed")] = sum(r.get("status") == "failed" for r in results)
            row[(init.label, "diverged")] = sum(r.get("status") == "diverged" for r in results)
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
    """Write table.md, table.csv and results.csv (and the plots); return the number of failed runs
    (diverged runs are results, listed in their own section of table.md, and not counted)."""
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
                diverged = row[(init.label, "diverged")]
                if value["mean"] is not None and value["n"] < len(study.seeds):
                    text += f" ({value['n']}/{len(study.seeds)} seeds{f', {diverged} diverged' if diverged else ''})"
                elif value["mean"] is None and diverged:
                    text = f"diverged ({diverged}/{len(study.seeds)} seeds)"
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

    by_status: dict[str, list[tuple[Run, dict]]] = {"diverged": [], "failed": []}
    for run in study.runs():
        result = run.load_result()
        if result is not None and result.get("key") == run.key() and result.get("status") in by_status:
            by_status[result["status"]].append((run, result))
    failures = by_status["failed"]
    if by_status["diverged"]:  # a result, not an error: the training loss became non-finite
        lines += ["", "## Diverged runs", "", "Not in the means above: the training loss became non-finite.", ""]
        for run, result in by_status["diverged"]:
            last = result.get("error", "").strip().splitlines()[-1:] or [""]
            lines.append(f"- {run.name}: {last[0][:300]}")
    if failures:
        lines += ["", "## Failed runs", ""]
        for run, result in failures:
            lines += [f"### {run.name} ({result.get('stage', '?')}, exit code {result.get('returncode', '?')})", "",
                      "```", result.get("error", ""), "```", ""]
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
            writer.writerow([run.task.name, run.init.label, run.seed, result.get("status", "?"),
                             result.get("seconds", ""),
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

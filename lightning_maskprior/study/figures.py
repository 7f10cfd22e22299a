"""A study's figures from its result directory (results.py), each saved as PNG and PDF.

    <task>_curves           each curve tag over training per init (seeds faint, mean bold), the MDI's value and the
                            paper's final number as reference lines
    persistence             the paper's central figure: attention mass on the structure over training, every init,
                            one panel per task
    <task>_persistence      every persistence summary (score, correlations, drifts, gradient norms) and the half-life
                            of each run (markers: it is one number per run)
    fraction_sweep          each metric against the training fraction, a row of panels per sweep (tasks that differ
                            by their training fraction alone)
    <task>_attention_maps   the first seed's attention at the start and the end of training, per init and layer

``figures(result)`` returns matplotlib Figures (for tests to inspect); ``write_figures`` saves them.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from lightning_maskprior.metrics import HALF_LIFE, OPEN_MASS, PERSISTENCE, SCORE
from lightning_maskprior.run.rundir import ResultDir
from lightning_maskprior.study import paper_results
from lightning_maskprior.study.results import ResultSet, TaskInfo, reference_tag
from lightning_maskprior.study.tables import method_label

PANEL = (4.2, 3.0)  # inches per panel
PNG_DPI = 110  # ~460 x 330 pixels per panel; the PDF is the one to print
MAX_MAP_LAYERS = 4  # attention-map figures show at most this many layers (evenly spread)
PERSISTENCE_ORDER = ("score", "open_mass", "open_mass_rel", "attn_corr", "attn_corr_rel", "prior_corr",
                     "prior_corr_rel", "prior_drift", "qk_drift", "grad_prior", "grad_q", "grad_k")
LABELS = {
    "val/acc": "accuracy, full cube (%)", "val/unseen_acc": "accuracy, unseen slice (%)",
    "val/seq_acc": "sequence accuracy (%)", "val/digit_acc": "digit accuracy (%)", "val/mse": "MSE",
    "val/unseen_mse": "MSE, unseen slice", "val/loss": "validation loss", "val/ppl": "perplexity",
    "score": "persistence score\n(open mass / step 0)", "open_mass": "attention mass on the structure",
    "open_mass_rel": "open mass / step 0", "attn_corr": "corr(attention, structure)",
    "attn_corr_rel": "corr(attention, structure)\n/ step 0", "prior_corr": "corr(log σ(M), structure)",
    "prior_corr_rel": "corr(log σ(M), structure)\n/ step 0", "prior_drift": "RMS(M − M₀) (logit units)",
    "qk_drift": "‖WqᵀWk − Wq₀ᵀWk₀‖ / ‖Wq₀ᵀWk₀‖", "grad_prior": "‖∂L/∂M‖ (Frobenius)",
    "grad_q": "‖∂L/∂Wq‖ (Frobenius)", "grad_k": "‖∂L/∂Wk‖ (Frobenius)",
}


def _color(result: ResultSet, label: str) -> str:
    return f"C{[i.label for i in result.inits].index(label) % 10}"


def _is_percent(tag: str) -> bool:
    return tag.rsplit("/", 1)[-1].endswith("acc")


def _is_log(tag: str) -> bool:
    name = tag.rsplit("/", 1)[-1]
    return any(word in name for word in ("mse", "loss", "ppl", "grad_"))


def _label(tag: str) -> str:
    return LABELS.get(tag, LABELS.get(tag.removeprefix(f"{PERSISTENCE}/"), tag))


def _series(result: ResultSet, task: str, init: str, tag: str) -> list[list[tuple[int, float | None, float]]]:
    seeds = [r.seed for r in result.runs_of(task, init)]
    return [result.curves[key] for seed in seeds if (key := (task, init, seed, tag)) in result.curves]


def _uses_epochs(series: list[list]) -> bool:
    return bool(series) and all(epoch is not None for points in series for _, epoch, _ in points)


def _mean(series: list[list[tuple[int, float | None, float]]], epochs: bool) -> tuple[list[float], list[float]]:
    """Mean over seeds at the steps every seed logged."""
    common = set.intersection(*({s for s, _, _ in points} for points in series)) if series else set()
    by_step = {step: [] for step in common}
    x_of = {}
    for points in series:
        for step, epoch, value in points:
            if step in by_step:
                by_step[step].append(value)
                x_of[step] = epoch if epochs else step
    steps = sorted(common)
    return [x_of[s] for s in steps], [statistics.mean(by_step[s]) for s in steps]


def _draw_runs(ax, result: ResultSet, task: TaskInfo, tag: str, scale: float = 1.0) -> tuple[bool, float]:
    """Each seed faint, the mean bold, per init; returns (x is epochs, the largest x)."""
    everything = [s for init in result.inits for s in _series(result, task.name, init.label, tag)]
    epochs = _uses_epochs(everything)
    x_max = 0.0
    for init in result.inits:
        series = _series(result, task.name, init.label, tag)
        color = _color(result, init.label)
        for points in series:
            xs = [e if epochs else s for s, e, _ in points]
            ax.plot(xs, [v * scale for _, _, v in points], color=color, alpha=0.25, linewidth=0.8)
            x_max = max([x_max, *xs])
        if series:
            xs, mean = _mean(series, epochs)
            ax.plot(xs, [v * scale for v in mean], color=color, linewidth=2, marker="o" if len(xs) <= 12 else None,
                    markersize=3)
    ax.set_xlabel("epoch" if epochs else "optimizer step")
    ax.grid(alpha=0.3)
    return epochs, x_max


def _legend(fig: Figure, result: ResultSet, task: str | None, extra: list[tuple[Line2D, str]] = (),
            seed_marker: str | None = None) -> None:
    """One legend for the figure, outside the panels (right): the init methods present, then reference marks."""
    present = {r.init for r in result.runs if task is None or r.task == task}
    handles = [(Line2D([], [], color=_color(result, i.label), linewidth=2), method_label(i) + " (mean)")
               for i in result.inits if i.label in present]
    handles.append((Line2D([], [], color="grey", alpha=0.4, linewidth=0 if seed_marker else 0.8,
                           marker=seed_marker), "each seed"))
    handles += list(extra)
    fig.legend([h for h, _ in handles], [t for _, t in handles], loc="outside right upper", fontsize=8,
               frameon=False)


def _limits(ax, tag: str, values: list[float]) -> None:
    """Fixed ranges for fractions and ratios (a flat curve stays flat), log axes for errors and gradient norms."""
    name = tag.rsplit("/", 1)[-1]
    finite = [v for v in values if v == v]
    if _is_log(tag) and any(v > 0 for v in finite):
        ax.set_yscale("log")
    elif _is_percent(tag):
        ax.set_ylim(0, 105)
    elif name in ("score", "open_mass") or name.endswith("_rel") or name.endswith("_corr"):
        low, high = min(finite, default=0.0), max(finite, default=1.0)
        ax.set_ylim(min(0.0, low * 1.05), max(1.05, high * 1.02))
    elif name.endswith("drift"):
        ax.set_ylim(bottom=0)


def curves_figure(result: ResultSet, task: TaskInfo) -> Figure | None:
    """Each of the task's curve tags over training, with the MDI's value and the paper's final numbers."""
    tags = [t for t in task.curves if any(k[0] == task.name and k[3] == t for k in result.curves)]
    if not tags:
        return None
    fig = Figure(figsize=(PANEL[0] * len(tags) + 1.6, PANEL[1]), layout="constrained")
    axes = fig.subplots(1, len(tags), squeeze=False)[0]
    extra = {}
    for ax, tag in zip(axes, tags, strict=True):
        scale = 100.0 if _is_percent(tag) else 1.0
        _, x_max = _draw_runs(ax, result, task, tag, scale)
        values = [v * scale for k, pts in result.curves.items() if k[0] == task.name and k[3] == tag for *_, v in pts]
        reference = [pts[-1][2] for k, pts in result.curves.items() if k[0] == task.name and k[3] == reference_tag(tag)]
        if reference:
            ax.axhline(statistics.mean(reference) * scale, color="black", linestyle="--", linewidth=1)
            extra["mdi"] = (Line2D([], [], color="black", linestyle="--", linewidth=1), "min-degree interpolator")
        for init in result.inits:
            paper = _paper_final(result, task, init.name, tag)
            if paper is not None:
                ax.plot([x_max], [paper * scale], marker="*", markersize=11, color=_color(result, init.label),
                        markeredgecolor="black", markeredgewidth=0.5, linestyle="none", clip_on=False)
                values.append(paper * scale)
                extra["paper"] = (Line2D([], [], marker="*", color="grey", markeredgecolor="black", markersize=10,
                                         linestyle="none"), "paper, end of training")
        ax.set_ylabel(_label(tag))
        _limits(ax, tag, values)
    fig.suptitle(f"{task.name}: {', '.join(tags)} over training")
    _legend(fig, result, task.name, list(extra.values()))
    return fig


def _paper_final(result: ResultSet, task: TaskInfo, init: str, tag: str) -> float | None:
    """The paper's number for the metric measuring ``tag`` at the end (val/acc -> the test/acc metric), raw units."""
    name = tag.rsplit("/", 1)[-1]
    for metric in task.metrics:
        if metric.tag.rsplit("/", 1)[-1] == name and metric.paper and result.paper_tables:
            value = paper_results.paper_value(result.paper_tables, task.paper, init, metric.paper)
            return None if value is None else value / metric.scale
    return None


def persistence_figure(result: ResultSet) -> Figure | None:
    """Attention mass on the structure over training, every init, one panel per task (the paper's thesis)."""
    tag = OPEN_MASS
    tasks = [t for t in result.tasks if any(k[0] == t.name and k[3] == tag for k in result.curves)]
    if not tasks:
        return None
    fig = Figure(figsize=(PANEL[0] * len(tasks) + 1.6, PANEL[1]), layout="constrained")
    for ax, task in zip(fig.subplots(1, len(tasks), squeeze=False)[0], tasks, strict=True):
        _draw_runs(ax, result, task, tag)
        ax.set_title(task.name)
        ax.set_ylabel(_label(tag))
        ax.set_ylim(0, 1.05)
    fig.suptitle("Is the structure still in the attention? Mass on the structure's open pairs, probe batch")
    _legend(fig, result, None)
    return fig


def persistence_detail(result: ResultSet, task: TaskInfo) -> Figure | None:
    """Every persistence summary of one task over training, and each run's half-life."""
    present = {k[3] for k in result.curves if k[0] == task.name}
    tags = [f"{PERSISTENCE}/{n}" for n in PERSISTENCE_ORDER if f"{PERSISTENCE}/{n}" in present]
    if not tags:
        return None
    cols = 4
    rows = -(-(len(tags) + 1) // cols)
    fig = Figure(figsize=(PANEL[0] * cols + 1.6, PANEL[1] * rows), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, tag in zip(axes, tags, strict=False):
        _draw_runs(ax, result, task, tag)
        ax.set_ylabel(_label(tag))
        _limits(ax, tag, [v for k, pts in result.curves.items() if k[0] == task.name and k[3] == tag for *_, v in pts])
    extra = _half_life_panel(axes[len(tags)], result, task)
    for ax in axes[len(tags) + 1:]:
        ax.axis("off")
    fig.suptitle(f"{task.name}: persistence of the structure (PriorPersistence, means over layers and heads)")
    _legend(fig, result, task.name, extra)
    return fig


def _half_life_panel(ax, result: ResultSet, task: TaskInfo) -> list[tuple[Line2D, str]]:
    """Half-life per run as markers (a bar at the mean), and runs whose score never fell below 0.5."""
    never_seen = False
    for x, init in enumerate(result.inits):
        color = _color(result, init.label)
        runs = [r for r in result.runs_of(task.name, init.label) if SCORE in r.values]
        reached = [r.values[HALF_LIFE] for r in runs if HALF_LIFE in r.values]
        if reached:
            ax.bar(x, statistics.mean(reached), color=color, alpha=0.3, width=0.6)
            ax.plot([x] * len(reached), reached, "o", color=color, markersize=5)
        for r in runs:
            if HALF_LIFE not in r.values:
                steps = [s for s, _, _ in result.curves.get((task.name, init.label, r.seed, SCORE), [])]
                if steps:
                    ax.plot([x], [max(steps)], "^", color=color, markerfacecolor="none", markersize=7)
                    never_seen = True
    ax.set_xticks(range(len(result.inits)), [method_label(i) for i in result.inits], rotation=30, fontsize=8)
    ax.set_xlabel("init method")
    ax.set_ylabel("half-life (optimizer steps)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")
    marks = [(Line2D([], [], marker="o", color="grey", linestyle="none"), "half-life of a run (bar: mean)")]
    if never_seen:
        marks.append((Line2D([], [], marker="^", color="grey", markerfacecolor="none", linestyle="none"),
                      "score never below 0.5\n(at the last measured step)"))
    return marks


def _sweeps(result: ResultSet) -> list[list[TaskInfo]]:
    """The tasks that set a training fraction, grouped into sweeps: tasks of one series (the same task but for its
    fraction; all of them where study.json predates series) at two fractions at least, each sorted by fraction."""
    groups: dict[str | None, list[TaskInfo]] = {}
    for task in result.tasks:
        if task.train_fraction is not None:
            groups.setdefault(task.series, []).append(task)
    return [sorted(tasks, key=lambda t: t.train_fraction) for tasks in groups.values()
            if len({t.train_fraction for t in tasks}) >= 2]


def _sweep_title(result: ResultSet, tasks: list[TaskInfo]) -> str:
    """A sweep's name: the paper's task key of its task that the paper's tables have, else its series."""
    for task in tasks:
        if paper_results.has_task(result.paper_tables, task.paper):
            return task.paper
    return tasks[0].series or tasks[0].name


def fraction_sweep(result: ResultSet) -> Figure | None:
    """Each metric against the training fraction (log axis), one row of panels per sweep (``_sweeps``): a line per
    init through the seeds' means, the seeds as dots, and the paper's value (a star) at the fraction its table has."""
    sweeps = _sweeps(result)
    if not sweeps:
        return None
    labels = list(dict.fromkeys(m.label for tasks in sweeps for t in tasks for m in t.metrics))
    fig = Figure(figsize=(PANEL[0] * len(labels) + 1.6, PANEL[1] * len(sweeps)), layout="constrained")
    axes = fig.subplots(len(sweeps), len(labels), squeeze=False)
    has_paper = False
    for row, tasks in zip(axes, sweeps, strict=True):
        for ax, label in zip(row, labels, strict=True):
            has_paper = _draw_sweep(ax, result, tasks, label) or has_paper
            if len(sweeps) > 1:
                ax.set_title(_sweep_title(result, tasks))
    fig.suptitle("Final metric against the fraction of the data trained on")
    extra = [(Line2D([], [], marker="*", color="grey", markeredgecolor="black", markersize=10, linestyle="none"),
              "paper")] if has_paper else []
    _legend(fig, result, None, extra, seed_marker="o")
    return fig


def _draw_sweep(ax, result: ResultSet, tasks: list[TaskInfo], label: str) -> bool:
    """One panel of ``fraction_sweep``; whether it drew a paper value."""
    percent_axis, has_paper = True, False
    for init in result.inits:
        color, xs, means = _color(result, init.label), [], []
        for task in tasks:
            metric = next((m for m in task.metrics if m.label == label), None)
            if metric is None:
                continue
            percent_axis = percent_axis and metric.scale == 100
            x = task.train_fraction * 100
            values = [r.values[metric.tag] * metric.scale for r in result.runs_of(task.name, init.label)
                      if metric.tag in r.values]
            ax.plot([x] * len(values), values, "o", color=color, alpha=0.3, markersize=4)
            if values:
                xs.append(x)
                means.append(statistics.mean(values))
            paper = (paper_results.paper_value(result.paper_tables, task.paper, init.name, metric.paper)
                     if result.paper_tables and metric.paper else None)
            if paper is not None:
                ax.plot([x], [paper], "*", color=color, markeredgecolor="black", markersize=11)
                has_paper = True
        ax.plot(xs, means, "-o", color=color, linewidth=2, markersize=4)
    ax.set_xscale("log")
    fractions = sorted({t.train_fraction * 100 for t in tasks})
    ax.set_xticks(fractions, [f"{x:g}" for x in fractions])  # a tick at every fraction trained on
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
    ax.set_xlabel("training fraction (% of all pairs)")
    ax.set_ylabel(label)
    if percent_axis:
        ax.set_ylim(0, 105)
    ax.grid(alpha=0.3, which="both")
    return has_paper


def attention_figure(result: ResultSet, task: TaskInfo) -> Figure | None:
    """The first seed's attention (mean over heads and the probe batch) at the start and the end, per init and layer."""
    inits = [i for i in result.inits if "end" in (result.maps or {}).get((task.name, i.label), {})]
    if not inits:
        return None
    arrays = [result.maps[(task.name, i.label)] for i in inits]
    layers = arrays[0]["end"].shape[0]
    shown = sorted({round(i * (layers - 1) / (MAX_MAP_LAYERS - 1)) for i in range(MAX_MAP_LAYERS)}) \
        if layers > MAX_MAP_LAYERS else list(range(layers))
    structure = next((a["structure"] for a in arrays if "structure" in a), None)
    cols = 2 * len(shown) + (structure is not None)
    fig = Figure(figsize=(1.9 * cols + 1.2, 1.9 * len(inits) + 0.6), layout="constrained")
    axes = fig.subplots(len(inits), cols, squeeze=False)
    image = None
    for row, (init, maps) in enumerate(zip(inits, arrays, strict=True)):
        panels = [("structure", structure[0].mean(0))] if structure is not None else []
        for layer in shown:
            for when in ("start", "end"):
                if when in maps:
                    step = int(maps.get(f"{when}_step", 0))
                    panels.append((f"layer {layer}, step {step}", maps[when][layer].astype("float32").mean(0)))
                else:
                    panels.append((f"layer {layer}, {when}: not recorded", None))
        for col, (title, values) in enumerate(panels):
            ax = axes[row, col]
            if values is not None:
                image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis" if title != "structure" else "Greys")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0 or col > 0:
                ax.set_title(title, fontsize=8)
            if row == len(inits) - 1:
                ax.set_xlabel("key token")
        axes[row, 0].set_ylabel(f"{method_label(init)}\nquery token")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability (mean over heads)")
    fig.suptitle(f"{task.name}: attention at the start and the end of training (seed {result.seeds[0]}, probe batch)")
    return fig


def figures(result: ResultSet) -> dict[str, Figure]:
    """Every figure the result directory's data allows, by file stem."""
    made: dict[str, Figure | None] = {}
    if result.curves:
        for task in result.tasks:
            made[f"{task.name}_curves"] = curves_figure(result, task)
        made["persistence"] = persistence_figure(result)
        for task in result.tasks:
            made[f"{task.name}_persistence"] = persistence_detail(result, task)
    made["fraction_sweep"] = fraction_sweep(result)
    if result.maps:
        for task in result.tasks:
            made[f"{task.name}_attention_maps"] = attention_figure(result, task)
    return {name: fig for name, fig in made.items() if fig is not None}


def write_figures(result: ResultSet, out_dir: Path) -> list[str]:
    """Save every figure as figures/<name>.png and .pdf under ``out_dir``; return the PNGs' relative paths.
    Figures of an earlier report that this one does not make are removed."""
    folder = Path(out_dir) / ResultDir.FIGURES
    made = figures(result)
    if folder.is_dir():
        for old in folder.glob("*"):
            if old.suffix in (".png", ".pdf") and old.stem not in made:
                old.unlink()
    written = []
    for name, fig in made.items():
        folder.mkdir(parents=True, exist_ok=True)
        fig.savefig(folder / f"{name}.png", dpi=PNG_DPI)
        fig.savefig(folder / f"{name}.pdf", metadata={"CreationDate": None, "ModDate": None})
        written.append(f"{ResultDir.FIGURES}/{name}.png")
    return written

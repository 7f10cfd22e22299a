"""A study's tables and figures from its result directory, and the README's copies of them (the ``maskprior
report`` command is lightning_maskprior/report.py).

A result directory holds a study's data files (results.py: study.json, results.csv, curves.csv.gz,
attention_maps.npz); the study writes them into its out_dir after every run. From those files alone, with no run
directory, :func:`render` writes table.md (tables.py: the paper's layout), table.csv, per_seed.csv and
figures/<name>.png and .pdf (figures.py). :func:`update_readme` replaces the text between
``<!-- results: NAME -->`` and ``<!-- /results -->`` in a README by the tables of the result directory named NAME.
Every output is generated: edit the code or the data, never the output.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from lightning_maskprior.run.status import FINISHED
from lightning_maskprior.study.results import (
    ResultDir,
    collect,
    load,
    rows_on_files,
)
from lightning_maskprior.study.spec import Study
from lightning_maskprior.study.tables import markdown, write_csvs

MARKER = re.compile(r"(<!-- results: (?P<name>[^\s>]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
FIGURE_LINK = re.compile(rf"\]\(({ResultDir.FIGURES}/[^)\s]+\.png)\)")  # a figure as table.md shows it
STUDY_LEVEL = ("persistence", "fraction_sweep")  # figures of the whole study (the README shows them inline)
TASK_KINDS = ("_curves", "_persistence", "_attention_maps")


def write_outputs(study: Study, plots: bool = True) -> int:
    """Collect the runs into ``study.out_dir``'s data files and write its tables (and with ``plots`` the curves
    and the figures). Returns the number of failed runs (diverged runs are results, listed apart, not counted)."""
    collect(study, curves=plots)
    render(study.out_dir, figures=plots)
    return sum(r.status == "failed" for r in load(study.out_dir, maps=False).runs)


def figure_names(path: Path, tasks: list[str], also: list[str] = ()) -> list[str]:
    """The PNGs under ``path/figures`` (and the names ``also`` gives, ``figures/<name>.png``) in reading order:
    study-wide figures, then per task and kind."""
    def order(name: str) -> tuple:
        if name in STUDY_LEVEL:
            return (0, STUDY_LEVEL.index(name), 0)
        for rank, kind in enumerate(TASK_KINDS):
            task = name.removesuffix(kind)
            if task != name and task in tasks:
                return (1, tasks.index(task), rank)
        return (2, 0, name)

    names = {p.stem for p in (Path(path) / ResultDir.FIGURES).glob("*.png")} | {Path(n).stem for n in also}
    return [f"{ResultDir.FIGURES}/{n}.png" for n in sorted(names, key=order)]


def render(path: str | Path, out_dir: str | Path | None = None, figures: bool = True) -> Path:
    """Write table.md, table.csv, per_seed.csv (and figures) for the result directory ``path`` into ``out_dir``
    (default: ``path``; another directory also gets a copy of the data files). Returns table.md's path."""
    path = Path(path)
    out = Path(out_dir) if out_dir is not None else path
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != path.resolve():
        for name in ResultDir.DATA:
            if (path / name).is_file():
                shutil.copyfile(path / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
    result = load(out, maps=figures)
    if figures:
        from lightning_maskprior.study.figures import write_figures

        write_figures(result, out)
    tasks = [t.name for t in result.tasks]
    write_csvs(result, out)
    (out / ResultDir.TABLE).write_text(markdown(result, figure_names(out, tasks)))
    return out / ResultDir.TABLE


def missing_figures(path: Path) -> list[str]:
    """The figures ``path``'s table.md shows that are not there (``figures/<name>.png``)."""
    table = Path(path) / ResultDir.TABLE
    linked = FIGURE_LINK.findall(table.read_text()) if table.is_file() else []
    return [name for name in dict.fromkeys(linked) if not (Path(path) / name).is_file()]


def readme_section(path: Path, readme: Path, also: list[str] = ()) -> str:
    """The README's copy of a result directory's tables: headings one level down, links relative to the README,
    the study-wide figures inline and the others as links (those under ``figures/`` and those ``also`` names)."""
    result = load(path, maps=False)
    base = Path(os.path.relpath(Path(path).resolve(), Path(readme).resolve().parent)).as_posix() + "/"
    names = figure_names(path, [t.name for t in result.tasks], also)
    text = markdown(result, [n for n in names if Path(n).stem in STUDY_LEVEL], level=3, link_base=base)
    others = [n for n in names if Path(n).stem not in STUDY_LEVEL]
    if others:
        links = ", ".join(f"[{Path(n).stem}]({base}{n})" for n in others)
        text += f"\nMore figures (PNG and PDF): {links}.\n"
    return text


def update_readme(readme: Path, paths: list[Path], write: bool = True) -> tuple[list[str], list[str]]:
    """Replace each ``<!-- results: NAME -->`` section whose NAME is one of ``paths``' directory names.
    Returns (the names replaced, the names whose text changed); with ``write=False`` only compares (a figure that
    is missing is compared as if it were there: it is reported as missing, not as a change)."""
    by_name = {Path(p).resolve().name: Path(p) for p in paths}
    text = Path(readme).read_text()
    replaced, changed = [], []

    def substitute(match: re.Match) -> str:
        name = match["name"]
        if name not in by_name:
            return match[0]
        also = [] if write else missing_figures(by_name[name])
        body = readme_section(by_name[name], readme, also)
        replaced.append(name)
        if body != match["body"]:
            changed.append(name)
        return f"{match[1]}{body}{match[4]}"

    new = MARKER.sub(substitute, text)
    if write and new != text:
        Path(readme).write_text(new)
    return replaced, changed


def stale_table(path: Path, missing: list[str]) -> list[str]:
    """``path``'s table.md if it differs from what the data files give (a figure it shows that is missing is
    appended to ``missing`` instead); says which finished rows rest on the data files alone."""
    result = load(path, maps=False)
    absent = missing_figures(path)
    missing += [str(path / name) for name in absent]
    on_files = [f"{r.task}/{r.init}/seed{r.seed}" for r in rows_on_files(result)]
    finished = sum(r.status in FINISHED for r in result.runs)
    if len(on_files) == finished and finished:
        print(f"{path}: all {finished} finished rows rest on the data files alone (no run directory holds them)")
    elif on_files:
        print(f"{path}: {len(on_files)} of {finished} finished rows rest on the data files alone (no run "
              f"directory holds them): {', '.join(on_files)}")
    expected = markdown(result, figure_names(path, [t.name for t in result.tasks], absent))
    table = path / ResultDir.TABLE
    return [] if table.is_file() and table.read_text() == expected else [str(table)]

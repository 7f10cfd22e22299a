"""``maskprior report``: a study's tables and figures from its result directory, and the README's copies of them;
a tune's trials table and Optuna's plots from its out_dir.

    maskprior report docs/results/boolean_cpu
    maskprior report runs/tune/quick             (a tune: trials.md, trials.csv, figures/history.png, importance.png...)
    maskprior report --readme README.md docs/results/*
    maskprior report runs/study/boolean_cpu --out_dir docs/results/boolean_cpu     (publish a finished study)

A result directory holds a study's data files (results.py: study.json, results.csv, curves.csv.gz,
attention_maps.npz); the study writes them into its out_dir after every run. From those files alone, with no run
directory, the report writes table.md (tables.py: the paper's layout), table.csv, per_seed.csv and
figures/<name>.png and .pdf (figures.py). With --readme, the text between ``<!-- results: NAME -->`` and
``<!-- /results -->`` in the README is replaced by the tables of the result directory named NAME. Every output is
generated: edit the code or the data, never the output.

A tune's out_dir (``maskprior tune``) holds tune.json and trials.json (every trial, rewritten from the Optuna storage
after each one); from trials.json alone the report writes trials.md and trials.csv (one row per trial: state, value,
parameters, minutes, run directory) and Optuna's matplotlib plots under figures/ (the optimisation history, the
parameters' importances, the objective against each parameter, the pruner's intermediate values).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from lightning_maskprior.run.errors import bad_input
from lightning_maskprior.run.status import FINISHED
from lightning_maskprior.study.results import (
    ResultDir,
    ResultFileError,
    collect,
    load,
    rows_on_files,
)
from lightning_maskprior.study.spec import Study
from lightning_maskprior.study.tables import markdown, write_csvs
from lightning_maskprior.tune import record as tune_record

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


class _Parser(argparse.ArgumentParser):
    """Errors in one line, exit 2 (as every maskprior command)."""

    def error(self, message: str):
        bad_input(f"{message} (`{self.prog} --help` lists the options)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="maskprior report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result_dirs", nargs="*", type=Path, metavar="RESULT_DIR",
                        help="A study's result directory: its out_dir (runs/study/<name>) or a published copy "
                        "(docs/results/<name>) holding study.json and results.csv (curves.csv.gz and "
                        "attention_maps.npz for the figures; without them only the tables are written); or a tune's "
                        "out_dir (runs/tune/<name>, holding tune.json and trials.json): its trials table and plots.")
    parser.add_argument("--readme", type=Path, default=None,
                        help="A Markdown file whose sections between '<!-- results: NAME -->' and '<!-- /results "
                        "-->' are replaced by the tables of the RESULT_DIR named NAME (links relative to the file).")
    parser.add_argument("--out_dir", type=Path, default=None,
                        help="Write the outputs (and a copy of the data files) here instead of into RESULT_DIR, "
                        "e.g. to publish a finished study's out_dir into docs/results/<name>. One RESULT_DIR only.")
    parser.add_argument("--no_figures", action="store_true",
                        help="Write the tables and CSV files only (the figures already there stay).")
    parser.add_argument("--check", action="store_true",
                        help="Write nothing; exit 1 naming each table.md or README section that differs from what "
                        "the data files give (for CI: a hand edit or a forgotten regeneration) and each figure a "
                        "table shows that is missing; say which finished rows rest on the data files alone (no run "
                        "directory holds their result).")
    parser.add_argument("--scorecard", type=Path, default=None,
                        help="Also write this scorecard (docs/scorecard.md: every number the paper prints beside "
                        "ours, with a verdict) and results/table2_as_printed.md beside it, from the result "
                        "directories in results/ beside it; with --readme also its '<!-- scorecard -->' section.")
    return parser


def main(argv: list[str] | None = None) -> None:
    """``maskprior report``: regenerate result directories (and a README's sections); exit 1 when --check finds
    an output that differs from what the data files give."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if not args.result_dirs and args.scorecard is None:
        parser.error("give a RESULT_DIR or --scorecard")
    if args.out_dir is not None and len(args.result_dirs) != 1:
        parser.error(f"--out_dir takes one RESULT_DIR, got {len(args.result_dirs)}")
    for path in args.result_dirs:
        if not ResultDir.holds_results(path) and not tune_record.holds_tune(path):
            parser.error(f"{path} is not a study's result directory nor a tune's out_dir: it needs {ResultDir.STUDY} "
                         f"and {ResultDir.RESULTS} (a study writes both into its out_dir), or {tune_record.TUNE} and "
                         f"{tune_record.TRIALS} (a tune's)")
    if args.readme is not None and not args.readme.is_file():
        parser.error(f"--readme {args.readme}: no such file")
    try:
        _report(args)
    except ResultFileError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def _report(args: argparse.Namespace) -> None:
    stale, missing = [], []
    for path in args.result_dirs:
        if tune_record.holds_tune(path):
            stale += _tune(path, args)
            continue
        if args.check:
            stale += _check(path, missing)
            continue
        table = render(path, args.out_dir, figures=not args.no_figures)
        curves = (table.parent / ResultDir.CURVES).is_file()
        note = "" if curves else f" (tables only: no {ResultDir.CURVES}, so no curve figures)"
        print(f"{table}{note}")
    if args.readme is not None:
        stale += _readme(args)
    if args.scorecard is not None:
        stale += _scorecard(args)
    if missing:
        print("missing figures (`maskprior report RESULT_DIR` draws them):\n  " + "\n  ".join(missing),
              file=sys.stderr)
    if stale:
        print("out of date (run the same command without --check):\n  " + "\n  ".join(stale), file=sys.stderr)
    if stale or missing:
        sys.exit(1)


def _tune(path: Path, args: argparse.Namespace) -> list[str]:
    """A tune's trials table and plots (into --out_dir with a copy of its record); with --check, its trials.md if
    that differs from what trials.json gives."""
    try:
        data = tune_record.read_trials(path)
    except ValueError as err:
        raise ResultFileError(str(err)) from None
    if args.check:
        table = path / tune_record.TABLE
        expected = tune_record.markdown(data, tune_record.figure_names(path))
        return [] if table.is_file() and table.read_text() == expected else [str(table)]
    out = Path(args.out_dir) if args.out_dir is not None else Path(path)
    if out.resolve() != Path(path).resolve():
        out.mkdir(parents=True, exist_ok=True)
        for name in (tune_record.TUNE, tune_record.TRIALS, tune_record.BEST):  # published with portable paths
            if (Path(path) / name).is_file():
                text, left = tune_record.portable((Path(path) / name).read_text(), Path(path))
                if name == tune_record.BEST:  # its "Run it" line names the copy
                    text = re.sub(r"(?m)^# Run it: maskprior fit -c .*$", f"# Run it: maskprior fit -c {out / name}",
                                  text)
                (out / name).write_text(text)
                for absolute in left:
                    print(f"{out / name}: names {absolute}, a path of this machine")
    table = tune_record.render(out, figures=not args.no_figures)
    print(table)
    return []


def _check(path: Path, missing: list[str]) -> list[str]:
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


def _readme(args: argparse.Namespace) -> list[str]:
    """Regenerate (or with --check compare) the README's sections; the sections that differ, with --check."""
    dirs = [args.out_dir] if args.out_dir is not None else args.result_dirs
    replaced, changed = update_readme(args.readme, dirs, write=not args.check)
    if args.check:
        return [f"{args.readme} (results: {name})" for name in changed]
    missing = sorted({Path(p).resolve().name for p in dirs} - set(replaced))
    if dirs:
        print(f"{args.readme}: {len(replaced)} section(s) regenerated ({', '.join(replaced) or 'none'})"
              + (f"; no section for {', '.join(missing)}" if missing else ""))
    return []


def _scorecard(args: argparse.Namespace) -> list[str]:
    """Regenerate (or with --check compare) the scorecard, Table 2 as printed and the README's scorecard section;
    the files that differ, with --check."""
    from lightning_maskprior.study import scorecard

    changed = scorecard.write(args.scorecard, args.readme, check=args.check)
    if args.check:
        return changed
    print(f"{args.scorecard}: regenerated" + (f" ({', '.join(changed)} changed)" if changed else ""))
    return []


if __name__ == "__main__":
    main()

"""``maskprior report``: a study's tables and figures from its result directory, and the README's copies of them;
a tune's trials table and Optuna's plots from its out_dir; the scorecard of the paper's numbers.

    maskprior report docs/results/boolean_cpu
    maskprior report runs/tune/quick             (a tune: trials.md, trials.csv, figures/history.png, importance.png...)
    maskprior report --readme README.md docs/results/*
    maskprior report runs/study/boolean_cpu --out_dir docs/results/boolean_cpu     (publish a finished study)

A study's result directory holds its data files (study.json, results.csv, curves.csv.gz, attention_maps.npz); from
them alone, with no run directory, the report writes table.md (the paper's layout), table.csv, per_seed.csv and
figures/<name>.png and .pdf. With --readme, the text between ``<!-- results: NAME -->`` and ``<!-- /results -->``
in the README is replaced by the tables of the result directory named NAME. Every output is generated: edit the
code or the data, never the output.

A tune's out_dir (``maskprior tune``) holds tune.json and trials.json (every trial, rewritten from the Optuna storage
after each one); from trials.json alone the report writes trials.md and trials.csv (one row per trial: state, value,
parameters, minutes, run directory) and Optuna's matplotlib plots under figures/ (the optimisation history, the
parameters' importances, the objective against each parameter, the pruner's intermediate values).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_maskprior.run.errors import bad_input
from lightning_maskprior.study.report import render, stale_table, update_readme
from lightning_maskprior.study.results import ResultDir, ResultFileError
from lightning_maskprior.tune import record as tune_record


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
            stale += stale_table(path, missing)
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
        tune_record.read_trials(path)
    except ValueError as err:
        raise ResultFileError(str(err)) from None
    if args.check:
        return tune_record.stale_table(path)
    print(tune_record.publish(path, args.out_dir, figures=not args.no_figures))
    return []


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

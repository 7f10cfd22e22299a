"""``maskprior study``: a grid of tasks x init methods x seeds (see ``cli.py`` for the command).

    spec.py       the study file: its options (Study, TaskEntry, InitEntry, Metric), validation, the runs (Run)
    cell.py       one run as one self-contained command that writes its own result.json
    launchers/    what executes the cells: local processes, in-process, SLURM (submitit), Ray
    lock.py       one study at a time per output directory
    results.py    the result directory (ResultDir) and its data files (study.json, results.csv, curves, maps)
    paper_results.py  the paper's numbers, beside ours in the tables
    tables.py     table.md / table.csv / per_seed.csv in the paper's layout, from the data files
    figures.py    the figures (PNG and PDF), from the data files
    report.py     the tables and figures of a result directory, and the README's copies (the command that
                  writes them, for a study's or a tune's directory, is lightning_maskprior/report.py)
    scorecard.py  every number the paper prints beside ours with a verdict, and Table 2 as printed (report --scorecard)
    cli.py        the command: parse, validate, lock, launch, report

The names below are imported when first used, so ``python -m lightning_maskprior.study.cell`` (run once per
run, anywhere) loads only what the cell needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Interrupted": "cli", "build_parser": "cli", "main": "cli", "run_study": "cli", "study_options": "cli",
    "LOCK_NAME": "lock", "OWNER_NAME": "lock", "study_lock": "lock",
    "render": "report", "update_readme": "report", "write_outputs": "report",
    "ResultSet": "results", "collect": "results", "load": "results",
    "InitEntry": "spec", "Metric": "spec", "Run": "spec", "Study": "spec", "StudyError": "spec",
    "TaskEntry": "spec", "check_commands": "spec", "load_study": "spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

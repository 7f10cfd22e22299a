"""``maskprior study``: a grid of tasks x init methods x seeds, each an ordinary ``maskprior fit`` (+ ``test``).

    maskprior study -c configs/study/boolean_cpu.yaml
    maskprior study -c configs/study/boolean_cpu.yaml --parallel 2 --out_dir runs/my_study
    maskprior study -c configs/study/boolean_cpu.yaml --dry_run true     (check every command, run nothing)
    maskprior study --help

Every run gets its own directory ``<out_dir>/<task>/<init>/seed<k>/`` with its logs (the scalars file, and
TensorBoard's unless the runs configure other loggers), checkpoints, console output, the ``run.json`` the study
wrote and the ``result.json`` the run wrote.
Each run is one self-contained command (``python -m lightning_maskprior.study.cell <run_dir>``), started
by a launcher: local processes (disjoint GPU slots with ``gpus_per_run``), SLURM or Ray. A run with a
``result.json`` from the same command and config contents (what the configs parse to, wherever they lie: an
edited comment, a reinstall or a moved checkout keeps them) is finished and skipped when the study is run again;
an interrupted one resumes from its ``last.ckpt``; a failed one is recorded with the tail of its stderr, the study
goes on. While it runs, a study holds ``<out_dir>/.study.lock``, so a second study in the same directory fails
at once instead of taking over the first one's unfinished runs.
After every run the study writes its data files into out_dir (``study.json``, ``results.csv``: one row per run)
and ``table.md`` / ``table.csv`` / ``per_seed.csv`` (mean +- std over seeds, the paper's numbers beneath ours); at
the end also ``curves.csv.gz``, ``attention_maps.npz`` and ``figures/`` (PNG and PDF). ``maskprior report
<out_dir>`` regenerates the tables and figures from those data files alone (see ``maskprior report --help``).
Those files are also enough to go on elsewhere (another machine, a purged scratch disk): with ``--results_from
<result dir>`` every finished row there whose fingerprint matches its run (the same command and config contents)
is kept and not rerun.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lightning_maskprior.run import atomic
from lightning_maskprior.run.config_files import CheckedConfigFiles
from lightning_maskprior.run.errors import OneLineErrors
from lightning_maskprior.run.rundir import ResultDir, StudyRunDir
from lightning_maskprior.study.cell import prepare_run
from lightning_maskprior.study.launchers import Launcher, get_launcher
from lightning_maskprior.study.lock import study_lock
from lightning_maskprior.study.report import write_outputs
from lightning_maskprior.study.results import kept_rows, study_info
from lightning_maskprior.study.spec import (
    Run,
    Study,
    StudyError,
    add_study_arguments,
    check_commands,
    field_docstrings,
    format_command,
    load_study,
)


class Interrupted(Exception):
    """The study was asked to stop (SIGTERM, SIGINT, SIGHUP); ``args[0]``: the signal's number."""


def file_parser(prog: str, description: str, kind: str):
    """An argument parser for a command driven by one YAML file of options (a study or tune file): errors in one line
    (exit 2), the file's own among them, naming it as ``kind``; the description's line breaks kept; ``-c/--config``
    reads the file."""
    import argparse

    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Keeps the description's line breaks (the examples)."""

    class FileParser(CheckedConfigFiles, OneLineErrors, ArgumentParser):
        """Errors in one line (exit 2), the file's among them."""

        config_file_kind = kind

    parser = FileParser(prog=prog, description=description, formatter_class=HelpFormatter)
    parser.add_argument("-c", "--config", action=ActionConfigFile, help=f"The {kind} (YAML) holding the options below.")
    return parser


def parse_file_command(build: Any, argv: list[str] | None, folder: str) -> tuple[Any, Any, Path | None]:
    """The parser ``build()`` makes, the command line it parsed (field docstrings as help) and the last file given
    with -c; without one (and no tasks on the command line), one line naming ``configs/<folder>/`` and exit 2."""
    with field_docstrings():  # --tasks.help and the like explain the entries' keys
        parser = build()
        cfg = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    files = [p for p in (cfg.get("config") or []) if p is not None]
    path = Path(str(files[-1])) if files else None
    if path is None and not cfg.get("tasks"):
        parser.error(f"give a {parser.config_file_kind}: {parser.prog} -c configs/{folder}/<name>.yaml (see --help)")
    return parser, cfg, path


def build_parser():
    """The ``maskprior study`` argument parser: every key of a study file (a field of ``Study``) is an option
    here, and two of the command's own."""
    parser = file_parser("maskprior study", __doc__, "study file")
    add_study_arguments(parser)
    parser.add_argument("--dry_run", type=bool, default=False,
        help="Validate the study, parse every run's full fit command (a misspelled option fails here), make the "
        "checks each run makes before it trains (plug-ins resolve, the structure fits the task's tokens, a low_rank "
        "rank is within them) and those of the out_dir (writable, no other study's) and print the commands, each "
        "marked finished, kept from results_from or to run; run nothing.")
    parser.add_argument("--table_only", type=bool, default=False,
        help="Rebuild the result files, tables and figures from finished runs; run nothing (the same outputs as "
        "`maskprior report <out_dir>` after the study).")
    return parser


def study_options(cfg: Any) -> dict[str, Any]:
    """The study file's options in a parsed ``maskprior study`` command line (without the command's own)."""
    return {k: v for k, v in cfg.as_dict().items() if k not in ("config", "dry_run", "table_only")}


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def run_study(study: Study, log=print) -> int:
    """Run every unfinished run, then write tables and plots. Returns the number of failed runs.

    Raises StudyError when the launcher cannot honour the study or another study holds ``<out_dir>/.study.lock``,
    and Interrupted after SIGTERM / SIGINT / SIGHUP (live runs are stopped first; they resume next time).
    """
    launcher = get_launcher(study.launcher)(study)
    with study_lock(study.out_dir):
        check_out_dir_owner(study)
        return _run_study(study, launcher, log)


def check_out_dir_writable(study: Study) -> None:
    """Refuse an out_dir this process could not write into: the nearest part of its path that exists must be a
    directory it may write in (not a file, not on a read-only filesystem, not without permission)."""
    path = study.out_dir
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    if not path.is_dir():
        raise StudyError(f"out_dir {study.out_dir}: {path} is a file, not a directory; expected an out_dir whose "
                         "path holds directories only")
    if not os.access(path, os.W_OK | os.X_OK):
        why = "is on a read-only filesystem" if _read_only(path) else "is not writable by this user"
        raise StudyError(f"out_dir {study.out_dir}: {path} {why}; expected an out_dir the study can write its runs "
                         "into")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def check_out_dir_owner(study: Study, write: bool = True) -> None:
    """Refuse an out_dir whose study.json names another study (title or study file), or, with no readable
    study.json, one that holds run directories other than this study's own (their run.json written for the run
    this study would run there), unless replace_out_dir: running there would delete those finished runs wherever
    their commands differ. A study.json is written at once otherwise (unless ``write`` is false: a dry run), so the
    study's own runs are vouched for from its first one."""
    path = study.out_dir / ResultDir.STUDY
    if study.replace_out_dir:
        return
    try:
        theirs = json.loads(path.read_text(encoding="utf-8"))
        problem = None if isinstance(theirs, dict) else f"{path} holds no study description"
    except FileNotFoundError:
        theirs, problem = None, f"there is no {path}"
    except (OSError, ValueError) as err:
        theirs, problem = None, f"{path} cannot be read: {getattr(err, 'strerror', None) or err}"
    if problem is not None:
        own = {run.dir.resolve(): run for run in study.runs()}
        found = sorted({p.parent for name in (StudyRunDir.RUN, StudyRunDir.RESULT)
                        for p in study.out_dir.glob(f"*/*/*/{name}")})
        others = [d for d in found if d.resolve() not in own or not any(
            own[d.resolve()].owns(_json(d / name)) for name in (StudyRunDir.RUN, StudyRunDir.RESULT))]
        if others:
            raise StudyError(
                f"out_dir {study.out_dir} holds {len(others)} run director{'y' if len(others) == 1 else 'ies'} "
                f"(e.g. {others[0].relative_to(study.out_dir)}) that no readable {ResultDir.STUDY} vouches for "
                f"({problem}); "
                "running there could delete another study's finished runs. Expected an out_dir of this study's own "
                "(--out_dir), or --replace_out_dir true to replace them"
            )
        if write:
            study.out_dir.mkdir(parents=True, exist_ok=True)
            atomic.write_text(path, json.dumps(study_info(study), indent=1) + "\n")
        return
    ours = study_info(study)
    if (theirs.get("title"), theirs.get("study_file")) != (ours["title"], ours["study_file"]):
        raise StudyError(
            f"out_dir {study.out_dir} holds another study: {theirs.get('title')!r} (from {theirs.get('study_file')}), "
            f"not {ours['title']!r} (from {ours['study_file']}); running there would redo its finished runs. "
            "Expected an out_dir of this study's own (--out_dir), or --replace_out_dir true to replace them."
        )


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


KEPT = "kept from results_from"


def run_states(study: Study) -> list[tuple[Run, str]]:
    """Each run with what the study does with it: "finished" (its directory holds its result), "kept from
    results_from" (only the result files there record it: a study moved, restored or run in parts) or "to run"."""
    kept = kept_rows(study)
    return [(run, "finished" if run.is_done() else KEPT if run.name in kept else "to run") for run in study.runs()]


def _run_study(study: Study, launcher: Launcher, log=print) -> int:
    states = run_states(study)
    kept = sum(state == KEPT for _, state in states)
    todo = [run for run, state in states if state == "to run"]
    log(f"study {study.title}: {len(states)} runs ({len(study.tasks)} tasks x {len(study.inits)} inits x "
        f"{len(study.seeds)} seeds) in {study.out_dir}")
    prepared = [prepare_run(run, study.threads_per_run) for run in todo]
    resumed = prepared.count("resume")
    # Interrupted runs first (closest to done, and their checkpoints were made for this moment), then the rest in
    # the study's order.
    todo = [run for run, _ in sorted(zip(todo, prepared, strict=True), key=lambda pair: pair[1] != "resume")]
    sources = ", ".join(map(str, study.results_from))
    from_files = f"; {kept} of them kept from {sources}" if kept else ""
    log(f"  {len(states) - len(todo)} finished earlier (skipped{from_files}), {len(todo)} to run"
        f"{f' ({resumed} resumed from their last checkpoint)' if resumed else ''}; launcher {study.launcher}: "
        f"{launcher.describe()}")

    start, durations, done = time.time(), [], 0
    report_lock = threading.Lock()

    def report(run: Run, result: dict) -> None:
        nonlocal done
        with report_lock:
            done += 1
            durations.append(result.get("seconds", 0.0))
            remaining = len(todo) - done
            eta = statistics.mean(durations) * math.ceil(remaining / study.parallel)
            status = result.get("status")
            last = result.get("error", "").strip().splitlines()[-1:] or [""]
            if status == "ok":
                shown = ", ".join(f"{m.tag} {result['metrics'][m.tag]:.4g}" for m in run.task.metrics
                                  if m.tag in result.get("metrics", {}))
                what = f"ok ({shown})" if shown else "ok"
            elif status == "diverged":
                what = f"DIVERGED: {last[0][:200]}"
            elif status == "interrupted":
                what = "interrupted (resumes from its last checkpoint when the study is rerun)"
            else:
                what = f"FAILED in {result.get('stage', '?')}: {last[0][:200]}"
            log(f"[{done}/{len(todo)}] {run.name}: {what} in {_duration(result.get('seconds', 0.0))} | "
                f"elapsed {_duration(time.time() - start)}, ETA {_duration(eta)}", flush=True)
            write_outputs(study, plots=False)

    def interrupt(signum, frame):
        raise Interrupted(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                previous[sig] = signal.signal(sig, interrupt)
    try:
        launcher.run(todo, report)
    except (Interrupted, KeyboardInterrupt) as err:
        launcher.stop()
        log(f"\ninterrupted after {done} of {len(todo)} runs; unfinished runs resume from their last checkpoint "
            "when you rerun the same command.", flush=True)
        raise Interrupted(*(err.args if isinstance(err, Interrupted) else (signal.SIGINT,))) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = write_outputs(study, plots=True)
    log(f"done in {_duration(time.time() - start)}: {study.out_dir / ResultDir.TABLE}")
    if failed:
        log(f"{failed} run(s) failed; their errors are in {ResultDir.TABLE} and <run>/{StudyRunDir.RESULT}")
    return failed


def main(argv: list[str] | None = None) -> None:
    """``maskprior study``: parse, validate the whole study, then run it."""
    parser, cfg, path = parse_file_command(build_parser, argv, "study")
    try:
        study = load_study(study_options(cfg), path)
        if cfg.dry_run or (not cfg.table_only and any(state == "to run" for _, state in run_states(study))):
            # Every run's full fit command, checked before any cell starts (a bad option fails here, not in each
            # cell after the first ones ran).
            get_launcher(study.launcher)(study)  # the launcher's own options are valid
            checked = check_commands(study)
        if cfg.dry_run:
            # what the run would check of its out_dir before its first cell: writable, and this study's own
            check_out_dir_writable(study)
            check_out_dir_owner(study, write=False)
            _print_commands(study, checked)
        elif cfg.table_only:
            study.out_dir.mkdir(parents=True, exist_ok=True)
            write_outputs(study)
            print(study.out_dir / ResultDir.TABLE)
        else:
            _run_and_print(study)
    except StudyError as err:
        parser.error(f"{path or 'study'}: {err}")


def _print_commands(study: Study, checked: int) -> None:
    states = run_states(study)
    print(f"study {study.title}: {len(states)} runs, valid ({checked} distinct fit commands parsed); commands:")
    for run, state in states:
        print(f"[{state}] {run.name}: {format_command(run.fit_args())}")


def _run_and_print(study: Study) -> None:
    try:
        failed = run_study(study)
    except Interrupted as err:
        sys.exit(128 + int(err.args[0] if err.args else signal.SIGINT))  # 143 after SIGTERM, 130 after SIGINT
    print("\n" + (study.out_dir / ResultDir.TABLE).read_text())
    if failed:
        sys.exit(1)

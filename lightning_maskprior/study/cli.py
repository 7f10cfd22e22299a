"""``maskprior study``: a grid of tasks x init methods x seeds, each an ordinary ``maskprior fit`` (+ ``test``).

    maskprior study -c configs/study/boolean_cpu.yaml
    maskprior study -c configs/study/boolean_cpu.yaml --parallel 2 --out_dir runs/my_study
    maskprior study -c configs/study/boolean_cpu.yaml --dry_run true     (check every command, run nothing)
    maskprior study --help

Every run gets its own directory ``<out_dir>/<task>/<init>/seed<k>/`` with its TensorBoard logs,
checkpoints, console output, the ``run.json`` the study wrote and the ``result.json`` the run wrote.
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
from lightning_maskprior.run.rundir import StudyRunDir
from lightning_maskprior.study.cell import prepare_run
from lightning_maskprior.study.launchers import Launcher, get_launcher
from lightning_maskprior.study.lock import study_lock
from lightning_maskprior.study.report import write_outputs
from lightning_maskprior.study.results import STUDY_FILE, kept_rows, study_info
from lightning_maskprior.study.spec import Run, Study, StudyError, check_commands, format_command, load_study


class Interrupted(Exception):
    """The study was asked to stop (SIGTERM, SIGINT, SIGHUP); ``args[0]``: the signal's number."""


def build_parser():
    """The ``maskprior study`` argument parser: every key of a study file is an option here."""
    import argparse

    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Keeps the description's line breaks (the examples)."""

    class StudyParser(CheckedConfigFiles, OneLineErrors, ArgumentParser):
        """Errors in one line (exit 2), the study file's among them."""

        config_file_kind = "study file"

    parser = StudyParser(prog="maskprior study", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-c", "--config", action=ActionConfigFile,
        help="The study file (YAML) holding the options below.")
    parser.add_argument("--title", type=str | None, default=None, help="Heading of table.md (default: the file name).")
    parser.add_argument(
        "--tasks", type=list[str | dict[str, Any]], default=[],
        help="The table's rows. Each entry is a config path (the row is named after the file) or a mapping: "
        "name (row name and directory), config (one path or a list, composed like repeated -c), "
        "args (extra CLI overrides for this task, e.g. ['--trainer.max_epochs', '2']), metrics (this row's "
        "metrics, replacing the top-level ones), curves (this row's curve tags), paper (the task's key in the "
        "paper's tables; default: name). Relative paths are looked up from the working directory, then from "
        "the study file's directory and its parents.",
    )
    parser.add_argument(
        "--inits", type=list[str | dict[str, Any]], default=[],
        help="The table's columns: init method names (registered in lightning_maskprior.inits, checked before "
        "any run) or mappings: name (the init method), label (column and directory name; default name), "
        "config (init configs to compose, e.g. configs/init/mask.yaml), args (extra overrides, e.g. "
        "['--model.init_options', '{open_value: 5, closed_value: -5}']). Each run gets --model.init <name>.",
    )
    parser.add_argument("--seeds", type=list[int], default=[],
        help="Seeds; each run passes its seed to every option in seed_args.")
    parser.add_argument(
        "--seed_args", type=list[str], default=["--seed_everything"],
        help="CLI options that receive the run's seed (e.g. also --data.init_args.seed to vary the data order).",
    )
    parser.add_argument(
        "--metrics", type=list[str | dict[str, Any]], default=[],
        help="Numbers in each cell: TensorBoard tags (last value of the run) or mappings: tag (e.g. test/acc), "
        "label (column text; default the tag), scale (e.g. 100 for percent), digits (decimals, default 4), paper "
        "(the metric's key in the paper's table, e.g. acc, mse, seq_acc), better (higher or lower: the table bolds the "
        "best mean per task; default lower for MSE, loss and perplexity tags, else higher). Tasks may override.",
    )
    parser.add_argument(
        "--curves", type=list[str], default=["val/acc"],
        help="Tags plotted over training per init method (each seed faint, the mean bold), one figure per task "
        "(figures/<task>_curves.png and .pdf). The persistence/ summaries are kept and drawn too whenever the runs "
        "logged them. Their points go to curves.csv.gz, from which `maskprior report` redraws every figure.",
    )
    parser.add_argument(
        "--paper_tables", type=list[str | int], default=[],
        help="The paper's tables to put beside ours, searched in order (1, 2, 3, 4, 6; see "
        "lightning_maskprior/paper_results.py). Empty: no paper column.",
    )
    parser.add_argument("--args", type=list[str], default=[], help="CLI overrides given to every run.")
    parser.add_argument("--test", type=bool, default=True,
        help="Run `maskprior test` on the final checkpoint after each fit.")
    parser.add_argument("--out_dir", type=str | None, default=None,
        help="Where runs and tables go (default: runs/study/<study file name>). One study at a time per "
             "directory: a second one fails naming the host and process that hold <out_dir>/.study.lock.")
    parser.add_argument("--parallel", type=int, default=1, help="How many runs at a time (at most).")
    parser.add_argument(
        "--gpus_per_run", type=int | None, default=None,
        help="CUDA devices per run (local launcher: default 1 when CUDA is present, else 0). Concurrent runs get "
        "disjoint devices through CUDA_VISIBLE_DEVICES; with 0 a run sees none.",
    )
    parser.add_argument(
        "--threads_per_run", type=int | None, default=None,
        help="OMP_NUM_THREADS of each run (default: CPU cores / parallel, at most an OMP_NUM_THREADS you set).",
    )
    parser.add_argument("--retry_failed", type=bool, default=True, help="Rerun runs that failed last time.")
    parser.add_argument(
        "--replace_out_dir", type=bool, default=False,
        help="Run even if out_dir holds another study (another title or study file): its runs that differ from this "
        "study's are deleted and redone. Without it such an out_dir is refused, naming the study it holds.",
    )
    parser.add_argument(
        "--results_from", type=list[str] | str | None, default=None,
        help="A result directory of this study made elsewhere (e.g. a committed docs/results/<name>, or an out_dir "
        "on another machine), or a list of them ('[dir1, dir2]'): each finished row there whose fingerprint (fit "
        "command and config contents, without paths) is the one a run here would have stands for that run, which "
        "is not run; its row, curves and maps go into this out_dir's result files (from the first directory that "
        "has it). A long grid continues this way from its data files alone, and studies run in parts (by task, "
        "by seed) join into one table.",
    )
    parser.add_argument(
        "--launcher", type=str, default="local",
        help="What executes each run's cell (python -m lightning_maskprior.study.cell <run_dir>). local: a child "
        "process of the study (the default; 'subprocess' is its old name). inprocess: in this process, one at a "
        "time (for debugging and tests). slurm: a SLURM job per run (submitit). ray: a Ray task per run.",
    )
    parser.add_argument(
        "--launcher_options", type=dict[str, Any] | None, default=None,
        help="The launcher's own settings (e.g. a SLURM partition and time limit); see the launcher's module.",
    )
    parser.add_argument(
        "--slurm", type=dict[str, Any] | None, default=None,
        help="Settings of launcher slurm (used when launcher is slurm; launcher_options override them): cluster "
        "(slurm, or local: submitit's LocalExecutor here), partition, gpus_per_node, cpus_per_task, mem_gb, time "
        "(minutes), array_parallelism, job_name, log_folder (default <out_dir>/submitit), additional_parameters "
        "(extra #SBATCH options), setup (shell lines), signal_delay_s, max_num_timeout. See the docs' guide "
        "\"DDP and clusters\".",
    )
    parser.add_argument(
        "--ray", type=dict[str, Any] | None, default=None,
        help="Settings of launcher ray (used when launcher is ray): address (null: a Ray instance here; auto; "
        "ray://<head>:10001), num_cpus and num_gpus per run, max_retries (after a lost worker or node), "
        "runtime_env. The run directories must be on a filesystem every node sees. See the docs' guide "
        "\"DDP and clusters\".",
    )
    parser.add_argument("--dry_run", type=bool, default=False,
        help="Validate the study, parse every run's full fit command (a misspelled option fails here) and print "
        "the commands, each marked finished, kept from results_from or to run; run nothing.")
    parser.add_argument("--table_only", type=bool, default=False,
        help="Rebuild the result files, tables and figures from finished runs; run nothing (the same outputs as "
        "`maskprior report <out_dir>` after the study).")
    return parser




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


def check_out_dir_owner(study: Study) -> None:
    """Refuse an out_dir whose study.json names another study (title or study file), or, with no readable
    study.json, one that holds run directories other than this study's own (their run.json written for the run
    this study would run there), unless replace_out_dir: running there would delete those finished runs wherever
    their commands differ. A study.json is written at once otherwise, so the study's own runs are vouched for
    from its first one."""
    path = study.out_dir / STUDY_FILE
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
                f"(e.g. {others[0].relative_to(study.out_dir)}) that no readable {STUDY_FILE} vouches for ({problem}); "
                "running there could delete another study's finished runs. Expected an out_dir of this study's own "
                "(--out_dir), or --replace_out_dir true to replace them"
            )
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
    log(f"done in {_duration(time.time() - start)}: {study.out_dir / 'table.md'}")
    if failed:
        log(f"{failed} run(s) failed; their errors are in table.md and <run>/result.json")
    return failed


def main(argv: list[str] | None = None) -> None:
    """``maskprior study``: parse, validate the whole study, then run it."""
    parser = build_parser()
    cfg = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    files = [p for p in (cfg.get("config") or []) if p is not None]
    path = Path(str(files[-1])) if files else None
    if path is None and not cfg.get("tasks"):
        parser.error("give a study file: maskprior study -c configs/study/<name>.yaml (see --help)")
    options = {k: v for k, v in cfg.as_dict().items() if k not in ("config", "dry_run", "table_only")}
    try:
        study = load_study(options, path)
        if cfg.dry_run or (not cfg.table_only and any(state == "to run" for _, state in run_states(study))):
            # Every run's full fit command, checked before any cell starts (a bad option fails here, not in each
            # cell after the first ones ran).
            get_launcher(study.launcher)(study)  # the launcher's own options are valid
            checked = check_commands(study)
    except StudyError as err:
        parser.error(f"{path or 'study'}: {err}")
    if cfg.dry_run:
        states = run_states(study)
        print(f"study {study.title}: {len(states)} runs, valid ({checked} distinct fit commands parsed); commands:")
        for run, state in states:
            print(f"[{state}] {run.name}: {format_command(run.fit_args())}")
        return
    if cfg.table_only:
        study.out_dir.mkdir(parents=True, exist_ok=True)
        write_outputs(study)
        print(study.out_dir / "table.md")
        return
    try:
        failed = run_study(study)
    except Interrupted as err:
        sys.exit(128 + int(err.args[0] if err.args else signal.SIGINT))  # 143 after SIGTERM, 130 after SIGINT
    except StudyError as err:
        parser.error(str(err))
    print("\n" + (study.out_dir / "table.md").read_text())
    if failed:
        sys.exit(1)

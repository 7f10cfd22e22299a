"""``maskprior tune``: an Optuna study over runs; every trial is an ordinary ``maskprior fit`` (+ ``test``).

    maskprior tune -c configs/tune/quick.yaml
    maskprior tune -c configs/tune/quick.yaml --n_trials 12          (the study's total: rerun to resume or extend)
    maskprior tune -c configs/tune/quick.yaml --dry_run true         (check everything, run nothing)
    maskprior tune -c tune/pydoc_scale.yaml --storage postgresql://USER:PASSWORD@HOST/DB   (one of several workers)
    maskprior tune --help

A tune file names the runs of a trial (tasks x seeds), a search space over their fit options, an objective (a
metric's last value, the mean over the trial's runs) and the Optuna study: its sampler (TPE, seeded, by default),
pruner (median, fed from validation inside the first run's fit) and storage (default sqlite:///<out_dir>/tune.db).
This command is a worker: it runs trials one after another until the study holds n_trials of them; several workers
on one storage share the study. Trial k runs as a study's cell in <out_dir>/trial_000k/ (python -m
lightning_maskprior.study.cell: fit, test, result.json); a trial whose worker died or was stopped is retried in
the same directory, resuming from its last checkpoint. After every trial the worker rewrites trials.json and
best.yaml (the best trial's configuration: maskprior fit -c <out_dir>/best.yaml); `maskprior report <out_dir>`
writes the trials table and Optuna's plots.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lightning_maskprior.run import atomic
from lightning_maskprior.study.cli import Interrupted, _duration, file_parser, parse_file_command
from lightning_maskprior.study.spec import field_docstrings, format_command


def build_parser():
    """The ``maskprior tune`` argument parser: every key of a tune file (a field of ``Tune``) is an option here,
    and the command's own."""
    from lightning_maskprior.tune.spec import Tune

    parser = file_parser("maskprior tune", __doc__, "tune file")
    with field_docstrings():
        parser.add_class_arguments(Tune, as_group=False, skip={"path"})
    parser.add_argument("--dry_run", type=bool, default=False,
                        help="Check the tune file, parse every task's fit command with each searched option at the "
                        "ends of its range (each choice), open the storage and compare its study; run nothing.")
    return parser


def main(argv: list[str] | None = None) -> None:
    """``maskprior tune``: parse and check everything, then run trials until the study holds n_trials."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        from lightning_maskprior.run.errors import bad_input

        bad_input("maskprior tune needs Optuna, which is not installed; expected the tune extra: "
                  "pip install 'lightning-maskprior[tune]'")
    from lightning_maskprior.study.spec import StudyError
    from lightning_maskprior.tune.spec import check_trial_commands, load_tune
    from lightning_maskprior.tune.storage import StorageError

    parser, cfg, path = parse_file_command(build_parser, argv, "tune")
    options = {k: v for k, v in cfg.as_dict().items() if k not in ("config", "dry_run")}
    try:
        tune = load_tune(options, path)
        checked = check_trial_commands(tune)
        if cfg.dry_run:
            _dry_run(tune, checked)
            return
        worker = Worker(tune)
        code = worker.run()
    except (StudyError, StorageError) as err:  # a TuneError, or the study helpers' errors of a task entry
        parser.error(f"{path or 'tune'}: {err}")
    except Interrupted as err:
        sys.exit(128 + int(err.args[0] if err.args else signal.SIGINT))
    if code:
        sys.exit(code)


def _dry_run(tune: Any, checked: int) -> None:
    from lightning_maskprior.tune.spec import trial_runs
    from lightning_maskprior.tune.storage import redacted

    existing = _check_storage(tune)
    runs = trial_runs(tune, tune.out_dir / "trial_0000", {n: p.low if p.type != "categorical" else p.choices[0]
                                                           for n, p in tune.search.items()})
    print(f"tune {tune.title}: valid ({checked} fit commands parsed); study {tune.study_name!r} in "
          f"{redacted(tune.storage)} ({existing}); {tune.n_trials} trials of {len(runs)} run(s) each, objective "
          f"{tune.objective.metric} ({tune.objective.direction}), pruning on "
          f"{tune.prune_on or 'nothing'}; a trial's first run, with the search space's lowest values:")
    print(f"  {format_command(runs[0].fit_args())}")


def _check_storage(tune: Any) -> str:
    """Open the storage (a new SQLite file is not created) and compare the study it holds with this tune; a line
    saying what is there."""
    import optuna

    from lightning_maskprior.tune.spec import TuneError
    from lightning_maskprior.tune.storage import is_journal, open_storage

    url = tune.storage
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        folder = Path(url.removeprefix("sqlite:///")).parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir() or not _writable(folder):
            raise TuneError(f"storage {url!r}: the SQLite file cannot be created under {folder}; expected a "
                            "writable directory")
        return "a new SQLite file"
    if is_journal(url) and not Path(url).exists():
        return "a new journal file"
    storage = open_storage(url)
    try:
        study = optuna.load_study(study_name=tune.study_name, storage=storage)
    except KeyError:
        return "a new study"
    _compare_definition(tune, study)
    return f"holds {len(study.trials)} trials of this tune"


def _writable(folder: Path) -> bool:
    import os

    return os.access(folder, os.W_OK)


def _compare_definition(tune: Any, study: Any) -> None:
    """Refuse a study made by another tune (other runs, search space or objective) once it holds a result."""
    import optuna

    from lightning_maskprior.tune.spec import TuneError

    theirs = study.user_attrs.get("definition")
    ours = json.loads(json.dumps(tune.definition(), default=str))
    if theirs is None or theirs == ours:
        return
    results = [t for t in study.get_trials(deepcopy=False)
               if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    if not results:
        return  # nothing measured yet under the old definition (e.g. its metric was misspelled): take it over
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    raise TuneError(f"study {tune.study_name!r} holds {len(results)} results of another tune: its "
                    f"{', '.join(differ)} differ from this file's; expected the same tune file, or another study_name "
                    "or out_dir")


class TrialFailed(Exception):
    """A run of the trial failed or diverged: the trial is recorded as failed and the study goes on."""


class Surplus(Exception):
    """Another worker started the study's last trial at the same moment: this one is not run."""


class Worker:
    """One worker of a tune: runs trials in this process until the study holds ``n_trials``."""

    def __init__(self, tune: Any) -> None:
        self.tune = tune
        self.start = time.time()
        self.current: Any = None  # the trial this worker is running

    # ------------------------------------------------------------------------------------------------ the study
    def open(self) -> None:
        import optuna

        from lightning_maskprior.study.launchers import get_launcher
        from lightning_maskprior.tune.spec import TuneError
        from lightning_maskprior.tune.storage import has_heartbeat, instantiate, open_storage, redacted

        tune = self.tune
        tune.out_dir.mkdir(parents=True, exist_ok=True)
        self.storage = open_storage(tune.storage, tune.heartbeat_interval, tune.grace_period, tune.max_retry)
        self._claim_out_dir()
        self.heartbeat = has_heartbeat(self.storage)
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # this worker prints a line per trial instead
        try:
            self.study = optuna.create_study(study_name=tune.study_name, storage=self.storage, load_if_exists=True,
                                             direction=tune.objective.direction)
        except Exception as err:  # noqa: BLE001  (the storage refused the study)
            raise TuneError(f"storage {redacted(tune.storage)!r}: the study cannot be created or loaded: "
                            f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}"
                            ) from None
        _compare_definition(tune, self.study)
        self.study.set_user_attr("definition", json.loads(json.dumps(tune.definition(), default=str)))
        self.study.set_user_attr("objective", vars(tune.objective))
        try:  # checked here; each trial gets its own, seeded by its number (``objective``)
            self.study.sampler = instantiate(tune.sampler, optuna.samplers.BaseSampler)
            self.study.pruner = instantiate(tune.pruner, optuna.pruners.BasePruner)
        except Exception as err:  # noqa: BLE001  (the sampler's or pruner's own check of its arguments)
            raise TuneError(f"sampler / pruner: {err}") from None
        self.launcher = get_launcher(tune.launcher)(tune)

    def _claim_out_dir(self) -> None:
        """Write tune.json, or refuse an out_dir that holds another study (another name or storage)."""
        from lightning_maskprior.tune.record import TUNE
        from lightning_maskprior.tune.spec import TuneError
        from lightning_maskprior.tune.storage import redacted

        tune = self.tune
        ours = {"title": tune.title, "study_name": tune.study_name, "storage": redacted(tune.storage),
                "tune_file": str(tune.path) if tune.path else None}
        path = tune.out_dir / TUNE
        try:
            theirs = json.loads(path.read_text())
        except (OSError, ValueError):
            theirs = None
        if isinstance(theirs, dict) and (theirs.get("study_name"), theirs.get("storage")) != (
                ours["study_name"], ours["storage"]):
            raise TuneError(f"out_dir {tune.out_dir} holds the trials of study {theirs.get('study_name')!r} in "
                            f"{theirs.get('storage')}, not {ours['study_name']!r} in {ours['storage']}; expected an "
                            "out_dir of this study's own (--out_dir)")
        if theirs != ours:
            atomic.write_text(path, json.dumps(ours, indent=1) + "\n")

    def census(self) -> dict[str, list]:
        """The study's trials by what they mean for n_trials: ``counted`` (every trial but a failed one that was
        retried and one that was never run), of them ``running`` and ``waiting`` (to be retried)."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
        counted = [t for t in trials if not t.user_attrs.get("excluded")
                   and not (t.state == TrialState.FAIL and t.number in retried)]
        return {"counted": counted, "running": [t for t in counted if t.state == TrialState.RUNNING],
                "waiting": [t for t in counted if t.state == TrialState.WAITING]}

    # ------------------------------------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Run trials until the study holds n_trials and none is running. Returns 0 (1 if this worker's trials
        all failed)."""
        import optuna

        from lightning_maskprior.tune.storage import redacted

        self.open()
        tune = self.tune
        census = self.census()
        done = [t for t in census["counted"] if t.state.is_finished()]
        print(f"tune {tune.title}: study {tune.study_name!r} in {redacted(tune.storage)}, {len(done)} of "
              f"{tune.n_trials} trials done ({len(census['running'])} running, {len(census['waiting'])} to retry); "
              f"objective {tune.objective.metric} ({tune.objective.direction}); trials in {tune.out_dir}",
              flush=True)
        self.mine: list[str] = []
        previous = self._signals()
        try:
            while True:
                if self.heartbeat:
                    optuna.storages.fail_stale_trials(self.study)  # a dead worker's trial becomes one to retry
                census = self.census()
                if census["waiting"] or len(census["counted"]) < tune.n_trials:
                    self.study.optimize(self.objective, n_trials=1, catch=(TrialFailed, Surplus),
                                        callbacks=[self.after_trial])
                    continue
                if census["running"] and self.heartbeat:
                    # Trials of other workers: wait for them to end, or to go stale (then this worker retries them).
                    time.sleep(min(tune.heartbeat_interval, 5))
                    continue
                break
        except (Interrupted, KeyboardInterrupt) as err:
            self._stopped()
            raise Interrupted(*(err.args if isinstance(err, Interrupted) else (signal.SIGINT,))) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.write_record()  # also when a trial stopped the tune (a metric the runs do not log)
        census = self.census()
        running = f"; {len(census['running'])} still running elsewhere" if census["running"] else ""
        best = self._best()
        print(f"tune {tune.title}: {len([t for t in census['counted'] if t.state.is_finished()])} of "
              f"{tune.n_trials} trials done{running} in {_duration(time.time() - self.start)}"
              + (f"; best: trial {best.number}, {tune.objective.metric} {best.value:.6g}" if best else ""), flush=True)
        return 1 if self.mine and all(state == "FAIL" for state in self.mine) else 0

    def _signals(self) -> dict:
        def interrupt(signum, frame):
            raise Interrupted(signum)

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
                if sig is not None:
                    previous[sig] = signal.signal(sig, interrupt)
        return previous

    def _stopped(self) -> None:
        """This worker was stopped mid-trial: its runs saved their checkpoints (the launcher stopped them), and the
        trial, which Optuna recorded as failed, is queued to be retried, resuming in its directory."""
        import optuna

        if self.current is None:
            return
        frozen = self._frozen(self.current.number)
        if frozen.state == optuna.trial.TrialState.FAIL:
            optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=self.tune.max_retry,
                                                             inherit_intermediate_values=True)(self.study, frozen)
        print(f"\ninterrupted during trial {frozen.number}; it is retried (from its last checkpoint) when a worker "
              "runs this tune again", flush=True)

    def _frozen(self, number: int) -> Any:
        """The study's record of trial ``number`` (Optuna's FrozenTrial, with its system attributes)."""
        return next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)

    def _best(self) -> Any:
        try:
            return self.study.best_trial
        except ValueError:
            return None

    # ------------------------------------------------------------------------------------------------ one trial
    def objective(self, trial: Any) -> float:
        import optuna

        from lightning_maskprior.callbacks.optuna_pruning import PRUNED_FILE
        from lightning_maskprior.study.cell import prepare_run, read_json, write_json
        from lightning_maskprior.tune.spec import PRUNING_FILE, suggest, trial_runs
        from lightning_maskprior.tune.storage import trial_sampler

        tune = self.tune
        self.current = trial
        self.trial_start = time.time()
        retry = self._frozen(trial.number).system_attrs.get("failed_trial") is not None
        earlier = [t for t in self.census()["counted"] if t.number < trial.number]
        if not retry and len(earlier) >= tune.n_trials:
            trial.set_user_attr("excluded", "started when the study already had n_trials")
            raise Surplus(f"the study already has {tune.n_trials} trials")
        self.study.sampler = trial_sampler(tune.sampler, trial.number)  # seeded by the trial's number
        params = {name: suggest(trial, name, param) for name, param in tune.search.items()}
        name = trial.user_attrs.get("dir") or f"trial_{trial.number:04d}"  # a retry continues in its original's
        trial_dir = tune.out_dir / name
        runs = trial_runs(tune, trial_dir, params)
        trial.set_user_attr("dir", name)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        trial.set_user_attr("fit_args", runs[0].base_args())
        for run in runs:
            prepare_run(run, tune.threads_per_run)  # resumes a retried trial's interrupted runs
        (trial_dir / PRUNED_FILE).unlink(missing_ok=True)
        write_json(trial_dir / PRUNING_FILE, {"storage": tune.storage, "study_name": tune.study_name,
                                              "trial_id": trial._trial_id, "trial_number": trial.number,
                                              "pruner": tune.pruner})
        results = self._execute(runs[:1])
        pruned = read_json(trial_dir / PRUNED_FILE)
        if pruned is None and results[0][1].get("status") == "ok":
            results += self._execute(runs[1:])
        records, values, failed = [], [], []
        for run, result in results:
            record = {"run": run.name, "status": result.get("status"), "seconds": result.get("seconds")}
            if result.get("status") == "ok" and pruned is None:  # a pruned fit has no value (nor a test)
                metrics = finished(run)
                if tune.objective.metric not in metrics:
                    self._missing_metric(trial, run, metrics)
                record["value"] = metrics[tune.objective.metric]
                values.append(record["value"])
            else:
                last = (result.get("error") or "").strip().splitlines()[-1:] or [""]
                failed.append(f"{run.name}: {result.get('status')}: {last[0][:240]}")
            records.append(record)
        trial.set_user_attr("runs", records)
        trial.set_user_attr("seconds", round(time.time() - self.trial_start, 1))
        if pruned is not None:
            trial.set_user_attr("pruned_step", pruned.get("step"))
            raise optuna.TrialPruned(f"pruned at step {pruned.get('step')}")
        if failed:
            trial.set_user_attr("error", "; ".join(failed))
            raise TrialFailed("; ".join(failed))
        return float(statistics.mean(values))

    def _execute(self, runs: list) -> list[tuple[Any, dict]]:
        ended: list[tuple[Any, dict]] = []
        if runs:
            self.launcher.run(runs, lambda run, result: ended.append((run, result)))
        order = {run.name: i for i, run in enumerate(runs)}
        return sorted(ended, key=lambda pair: order[pair[0].name])

    def _missing_metric(self, trial: Any, run: Any, metrics: dict[str, float]) -> None:
        from lightning_maskprior.tune.spec import TuneError

        trial.set_user_attr("excluded", f"the runs log no {self.tune.objective.metric}")
        logged = ", ".join(sorted(metrics)) or "nothing"
        hint = "" if self.tune.test or not self.tune.objective.metric.startswith("test/") else " (test: false)"
        raise TuneError(f"objective.metric: the trial's run {run.name} logged no {self.tune.objective.metric!r}"
                        f"{hint}; expected one of the metrics it logged: {logged}")

    def after_trial(self, study: Any, frozen: Any) -> None:
        """Optuna's callback after each trial of this worker: the progress line, trials.json and best.yaml."""
        tune = self.tune
        self.current = None
        if frozen.user_attrs.get("excluded"):
            return
        self.mine.append(frozen.state.name)
        census = self.census()
        done = len([t for t in census["counted"] if t.state.is_finished()])
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in frozen.params.items())
        if frozen.state.name == "COMPLETE":
            what = f"{tune.objective.metric} {frozen.value:.6g}"
        elif frozen.state.name == "PRUNED":
            what = f"PRUNED at step {frozen.user_attrs.get('pruned_step')}"
        else:
            what = f"FAILED: {str(frozen.user_attrs.get('error', ''))[:200]}"
        best = self._best()
        best_text = f"best {best.value:.6g} (trial {best.number})" if best is not None else "no best yet"
        retry = frozen.system_attrs.get("failed_trial")
        print(f"[trial {frozen.number}{f', retries {retry}' if retry is not None else ''}] {what} | {params} | "
              f"{best_text} | {_duration(time.time() - self.trial_start)}, elapsed "
              f"{_duration(time.time() - self.start)} | {done}/{tune.n_trials} done", flush=True)
        self.write_record()

    def write_record(self) -> None:
        """trials.json from the storage, best.yaml from the best trial, and the table (without the plots)."""
        from lightning_maskprior.tune import record
        from lightning_maskprior.tune.storage import redacted

        tune = self.tune
        info = {"title": tune.title, "study_name": tune.study_name, "storage": redacted(tune.storage),
                "n_trials": tune.n_trials, "objective": vars(tune.objective),
                "search": {k: vars(v) for k, v in tune.search.items()}}
        record.write_trials(tune.out_dir, info, self.study.get_trials(deepcopy=False))
        data = record.read_trials(tune.out_dir)
        best = record.best_of(data)
        if best is not None and best["number"] != getattr(self, "_best_written", None):
            record.write_best(tune.out_dir, data)
            self._best_written = best["number"]
        record.render(tune.out_dir, figures=False)


def finished(run: Any) -> dict[str, float]:
    """A finished run's metrics."""
    from lightning_maskprior.tune.record import finished_metrics

    return finished_metrics(run.dir)

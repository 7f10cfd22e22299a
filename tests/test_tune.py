"""``maskprior tune``: bad input in one line, trials as run directories, pruning, resuming after a killed worker, two
workers on one study, best.yaml, the report of a tune directory."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")

from conftest import CONFIGS, TINY_BOOLEAN  # noqa: E402
from lightning_maskprior.cli import main  # noqa: E402
from lightning_maskprior.tune.record import read_trials  # noqa: E402

TINY = [*TINY_BOOLEAN, "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1",
        "--trainer.enable_model_summary", "false", "--trainer.callbacks", "null"]
SEARCH = {"model.init_options.scale": {"low": 0.1, "high": 10.0, "log": True},
          "model.optimizer.init_args.lr": {"low": 1e-3, "high": 1e-2, "log": True}}


def tune_file(tmp_path: Path, name: str = "tiny", **changes) -> Path:
    """A tiny tune (2parity at width 16, two epochs a run) written to ``tmp_path/<name>.yaml``."""
    tune = {
        "tasks": [{"name": "2parity", "config": [str(CONFIGS / "boolean/2parity.yaml"),
                                                 str(CONFIGS / "init/mask.yaml")]}],
        "args": TINY, "search": SEARCH, "objective": "val/mse", "n_trials": 2,
        "sampler": {"class_path": "RandomSampler", "init_args": {"seed": 0}},
        "out_dir": str(tmp_path / "out"), "launcher": "inprocess", "threads_per_run": 1,
    }
    tune.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tune))
    return path


def run_tune(path: Path, *args: str) -> None:
    main(["tune", "-c", str(path), *args])


def tune_process(path: Path, *args: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "lightning_maskprior.cli", "tune", "-c", str(path), *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=path.parent)


def counted(trials: list[dict]) -> list[dict]:
    """The trials n_trials counts: not a failed one that was retried, nor one never run."""
    retried = {t["retries"] for t in trials if t["retries"] is not None}
    return [t for t in trials if not t["user_attrs"].get("excluded")
            and not (t["state"] == "FAIL" and t["number"] in retried)]


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "change,message",
    [
        ({"search": {**SEARCH, "model.nonexistent": {"low": 1, "high": 2}}},
         r"search.model.nonexistent: the fit command does not parse: .*unrecognized arguments: --model.nonexistent"),
        ({"search": {"model.optimizer.init_args.lr": {"low": 0.1, "high": 0.01}}},
         r"search.model.optimizer.init_args.lr: empty range: low 0.1 >= high 0.01"),
        ({"search": {"model.init": {"choices": []}}},
         r"search.model.init: a categorical option needs a non-empty list of choices"),
        ({"search": {"model.init": {"type": "categorical"}}},
         r"search.model.init: a categorical option needs a non-empty list of choices"),
        ({"search": {"model.init_options.scale": {"low": 0.0, "high": 1.0, "log": True}}},
         r"search.model.init_options.scale: a log scale needs low > 0"),
        ({"search": {}}, r"search: give at least one option to tune"),
        ({"storage": "nosuchdb://host/db"}, r"storage 'nosuchdb://host/db' cannot be opened: .*expected an Optuna"),
        ({"objective": "mse"}, r"objective.metric: expected a tag a run logs, like val/ppl"),
        ({"seeds": [0, -1]}, r"seeds\[1\]: a seed is a non-negative integer, got -1"),
        ({"tasks": [{"config": "boolean/nope.yaml"}]},
         r"tasks\[0\] \(nope\): config 'boolean/nope.yaml' does not exist"),
    ],
    ids=["unknown-option", "empty-range", "no-choices", "choices-missing", "log-at-zero", "no-search",
         "storage", "objective-tag", "seed", "task-config"],
)
def test_bad_tune_fails_in_one_line_before_any_trial(tmp_path, capsys, change, message):
    import re

    path = tune_file(tmp_path, **change)
    with pytest.raises(SystemExit) as exit_info:
        run_tune(path)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out" / "trial_0000").exists()


def test_a_storage_that_cannot_be_opened_fails_the_run_too(tmp_path, capsys):
    path = tune_file(tmp_path, storage=str(tmp_path / "a_file" / "tune.log"))
    (tmp_path / "a_file").write_text("a file where the journal's directory should be\n")
    with pytest.raises(SystemExit) as exit_info:
        run_tune(path)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "cannot be opened" in err and "a_file" in err


def test_dry_run_checks_everything_and_runs_nothing(tmp_path, capsys):
    path = tune_file(tmp_path)
    run_tune(path, "--dry_run", "true")
    out = capsys.readouterr().out
    assert "valid (6 fit commands parsed)" in out and "--model.init_options.scale 0.1" in out
    assert not (tmp_path / "out").exists()


def test_a_metric_no_run_logs_stops_after_the_first_trial_naming_what_was_logged(tmp_path, capsys):
    path = tune_file(tmp_path, objective="val/nope", prune_on=None)
    with pytest.raises(SystemExit) as exit_info:
        run_tune(path)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "logged no 'val/nope'" in err and "val/mse" in err and "val/acc" in err
    trials = read_trials(tmp_path / "out")["trials"]
    assert len(trials) == 1 and trials[0]["user_attrs"]["excluded"]  # not counted: a fixed file starts afresh
    fixed = tune_file(tmp_path, objective="val/mse", prune_on=None, n_trials=1)
    run_tune(fixed)
    trials = read_trials(tmp_path / "out")["trials"]
    assert [t["state"] for t in counted(trials)] == ["COMPLETE"]


# ------------------------------------------------------------------------------------------------ trials
@pytest.fixture(scope="module")
def finished_tune(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tune")
    path = tune_file(tmp_path, n_trials=3, prune_on=None)
    run_tune(path)
    return tmp_path / "out"


def test_each_trial_is_a_run_directory_and_the_best_one_is_best_yaml(finished_tune, tmp_path, monkeypatch):
    from lightning_maskprior import load_run
    from lightning_maskprior.run.tensorboard import last_scalars

    data = read_trials(finished_tune)
    assert [t["state"] for t in data["trials"]] == ["COMPLETE"] * 3
    for trial in data["trials"]:
        run_dir = finished_tune / trial["user_attrs"]["dir"]
        assert run_dir.name == f"trial_{trial['number']:04d}"
        assert trial["value"] == pytest.approx(last_scalars(run_dir)["val/mse"])
        config = yaml.safe_load(next(run_dir.glob("lightning_logs/version_*/config.yaml")).read_text())
        assert config["model"]["init_options"]["scale"] == pytest.approx(trial["params"]["model.init_options.scale"])
    load_run(finished_tune / "trial_0000")
    best = min(data["trials"], key=lambda t: t["value"])
    monkeypatch.chdir(tmp_path)
    main(["fit", "-c", str(finished_tune / "best.yaml")])  # runs as is, from anywhere
    (run,) = (tmp_path / "runs").glob("*/version_0")
    assert last_scalars(run)["val/mse"] == pytest.approx(best["value"], rel=1e-4)


def test_report_on_a_tune_directory_writes_the_trials_table_and_plots(finished_tune, capsys):
    import matplotlib

    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        main(["report", str(finished_tune)])
        # Optuna's plots set the ggplot style; the figures of a study the same command renders next keep their own
        assert matplotlib.rcParams["axes.facecolor"] == "white"
    with open(finished_tune / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["trial"] for r in rows] == ["0", "1", "2"] and {r["state"] for r in rows} == {"COMPLETE"}
    assert "model.init_options.scale" in rows[0] and rows[0]["val/mse"]
    for name in ("history", "importance", "slice"):
        png = finished_tune / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"figures/{name}.png" in (finished_tune / "trials.md").read_text()
    main(["report", str(finished_tune), "--check"])  # what it wrote is what the record gives


def test_a_published_tune_names_no_path_of_this_machine(finished_tune, tmp_path, monkeypatch):
    """``report DIR --out_dir docs/results/NAME`` copies the record with portable paths: the configs by their
    packaged names, the tune's directory by its name, best.yaml's "Run it" line naming the copy."""
    assert str(CONFIGS) in (finished_tune / "trials.json").read_text()  # the record names the configs' paths
    monkeypatch.chdir(finished_tune.parent)  # the project: the tune file is here
    main(["report", str(finished_tune), "--out_dir", "published", "--no_figures"])
    published = finished_tune.parent / "published"
    for name in ("tune.json", "trials.json", "best.yaml"):
        text = (published / name).read_text()
        assert not re.findall(r"(?:^|[\s\"'=])/[\w.-]+/", text, re.MULTILINE), (name, text[:400])
    assert "configs/boolean/2parity.yaml" in (published / "trials.json").read_text()
    assert f"sqlite:///{finished_tune.name}/tune.db" in (published / "tune.json").read_text()
    assert "# Run it: maskprior fit -c published/best.yaml" in (published / "best.yaml").read_text()


def test_portable_paths(tmp_path):
    from lightning_maskprior.tune.record import portable

    tune_dir = tmp_path / "runs" / "t"
    text = (f"-c /elsewhere/checkout/configs/boolean/2parity.yaml -c {tmp_path}/my/own.yaml "
            f"sqlite:///{tune_dir}/tune.db postgresql://user:pw@host/db /srv/data/x.bin "
            f"/elsewhere/configs/not/packaged.yaml")
    out, left = portable(text, tune_dir, cwd=tmp_path)
    assert out == ("-c configs/boolean/2parity.yaml -c my/own.yaml sqlite:///t/tune.db postgresql://user:pw@host/db "
                   "/srv/data/x.bin /elsewhere/configs/not/packaged.yaml")
    assert left == ["/elsewhere/configs/not/packaged.yaml", "/srv/data/x.bin"]


def test_a_pruned_trial_stops_its_fit_cleanly(tmp_path):
    # A pruner that prunes every trial at the first validation: the fit stops there, saves, exits 0, and is not
    # tested (test: true) nor given a value.
    path = tune_file(tmp_path, n_trials=1, args=[*TINY, "--trainer.max_epochs", "20"], test=True,
                     pruner={"class_path": "optuna.pruners.ThresholdPruner", "init_args": {"upper": 0.0}})
    run_tune(path)
    (trial,) = read_trials(tmp_path / "out")["trials"]
    assert trial["state"] == "PRUNED" and trial["user_attrs"]["pruned_step"] >= 1
    assert list(trial["intermediate_values"]) == [str(trial["user_attrs"]["pruned_step"])]
    result = json.loads((tmp_path / "out" / "trial_0000" / "result.json").read_text())
    assert result["status"] == "ok" and result["stage"] == "fit"
    assert [command.split()[1] for command in result["commands"]] == ["fit"]
    assert [set(run) for run in trial["user_attrs"]["runs"]] == [{"run", "status", "seconds"}]
    from lightning_maskprior.run.rundir import Checkpoint, RunDir

    assert Checkpoint(RunDir(tmp_path / "out" / "trial_0000").find_checkpoint()).global_step < 20


# ------------------------------------------------------------------------------------------------ workers
@pytest.mark.parametrize("launcher", ["inprocess", pytest.param("local", marks=pytest.mark.slow)])
def test_a_killed_worker_s_trial_is_retried_in_its_directory_and_resumes(tmp_path, launcher):
    """SIGKILL the worker mid-trial (inprocess: its fit dies with it; local: its cell and fit are stopped and save
    last.ckpt); a rerun waits for the trial's heartbeat to go stale, retries it in the same directory from its last
    checkpoint, and the study reaches n_trials."""
    path = tune_file(tmp_path, n_trials=1, heartbeat_interval=1, grace_period=3, prune_on=None, launcher=launcher,
                     args=[*TINY, "--trainer.max_epochs", "30"])
    worker = tune_process(path, log=tmp_path / "first.log")
    ckpt = tmp_path / "out" / "trial_0000" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 120
    while not ckpt.is_file() and worker.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert ckpt.is_file(), (tmp_path / "first.log").read_text()[-2000:]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    second = tune_process(path, log=tmp_path / "second.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    trials = read_trials(tmp_path / "out")["trials"]
    by_number = {t["number"]: t for t in trials}
    assert by_number[0]["state"] == "FAIL"
    retry = next(t for t in trials if t["retries"] == 0)
    assert retry["state"] == "COMPLETE" and retry["user_attrs"]["dir"] == "trial_0000"
    assert retry["params"] == by_number[0]["params"]
    assert [t["state"] for t in counted(trials)] == ["COMPLETE"]  # n_trials, the killed one retried
    result = json.loads((tmp_path / "out" / "trial_0000" / "result.json").read_text())
    assert result["status"] == "ok" and result["resumed_from"].endswith("last.ckpt")


def test_two_workers_share_one_sqlite_study(tmp_path):
    """Two workers started together on one SQLite study make its n_trials between them, each trial once, in a
    directory of its own. (Whether their trials overlap in time depends on the machine's load: not asserted.)"""
    path = tune_file(tmp_path, n_trials=2, prune_on=None)
    workers = [tune_process(path, log=tmp_path / f"worker{i}.log") for i in range(2)]
    for i, worker in enumerate(workers):
        assert worker.wait(timeout=300) == 0, (tmp_path / f"worker{i}.log").read_text()[-3000:]
    trials = read_trials(tmp_path / "out")["trials"]
    done = counted(trials)
    assert len(done) == 2 and {t["state"] for t in done} == {"COMPLETE"}
    assert len({t["user_attrs"]["worker"] for t in done}) == 2  # both workers ran trials
    assert len({t["user_attrs"]["dir"] for t in done}) == 2  # each in its own run directory
    assert len({json.dumps(t["params"], sort_keys=True) for t in done}) == 2


def test_each_trial_is_sampled_with_its_own_seed():
    """Two workers that both ask before either samples (they started together) draw different values: each trial's
    sampler is seeded by its number; and the same study drawn again gives the same values."""
    import optuna

    from lightning_maskprior.tune.storage import trial_sampler

    spec = {"class_path": "optuna.samplers.TPESampler", "init_args": {"seed": 7}}

    def race() -> list[float]:
        study = optuna.create_study()
        first, second = study.ask(), study.ask()  # each worker holds a trial before either has sampled
        values = []
        for trial in (first, second):
            study.sampler = trial_sampler(spec, trial.number)
            values.append(trial.suggest_float("scale", 0.1, 30, log=True))
        return values

    drawn = race()
    assert drawn[0] != drawn[1] and race() == drawn


def test_published_tunes_are_what_report_generates():
    """A tune published under docs/results (its tune.json, trials.json and best.yaml beside the outputs) has the
    trials.md and figures `maskprior report` makes of it, and names no path outside the project."""
    results = CONFIGS.parent / "docs" / "results"
    tunes = sorted(p for p in results.iterdir() if (p / "tune.json").is_file())
    assert tunes, "docs/results holds no published tune"
    main(["report", "--check", *map(str, tunes)])  # exit 1 names what is out of date
    for tune in tunes:
        for name in ("tune.json", "trials.json", "best.yaml"):  # paths relative to the project, as a user runs it
            absolute = re.findall(r"(?:^|[\s\"'=])(/[\w.-]+/[\w./-]*)", (tune / name).read_text(), re.MULTILINE)
            assert not absolute, f"{tune.name}/{name} names absolute paths: {sorted(set(absolute))[:3]}"
        trials = read_trials(tune)
        assert trials["trials"] and all(t["state"] in ("COMPLETE", "PRUNED") for t in trials["trials"])

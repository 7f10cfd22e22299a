"""Any Lightning logger for fit, test and study: the run directory keeps its layout (config, checkpoints, record) and
its scalars file (``scalars.csv``), which studies read, whatever the loggers are."""

import csv
import gzip
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.run.rundir import RunDir
from lightning_maskprior.run.scalars import last_scalars, read_event_scalars, read_scalars
from lightning_maskprior.run.scalars_logger import ScalarsLogger

RUN = "2parity-mask-seed0/version_0"
STEPS = ["--data.init_args.batch_size", "16", "--trainer.log_every_n_steps", "1"]  # 3 steps an epoch, each logged


def fit(*args: str) -> None:
    main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"), *args])


def rows(path: Path) -> list[tuple[int, str]]:
    """The (step, tag) of every row of a scalars file, in file order."""
    with open(path, newline="") as f:
        return [(int(row["step"]), row["tag"]) for row in csv.DictReader(f)]


def steps(series) -> list[int]:
    return [step for step, _ in series]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B with no network and nothing written outside tmp_path."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    yield
    wandb.finish()  # Lightning's WandbLogger leaves its run open: the next fit in this process would log to it


@pytest.fixture
def mlflow_env():
    """MLflow with the process's MLFLOW_TRACKING_URI put back afterwards (MLFlowLogger's mlflow.set_tracking_uri sets
    it for the whole process: a later test's logger would read it)."""
    pytest.importorskip("mlflow")
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def _logger_args(kind: str, tmp_path: Path, monkeypatch) -> list[str]:
    if kind == "tensorboard":
        return []
    if kind == "false":
        return ["--trainer.logger", "false"]
    if kind == "csv":
        return ["--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(tmp_path / "csv")]
    if kind == "mlflow":
        return ["--trainer.logger", "MLFlowLogger", "--trainer.logger.tracking_uri",
                f"sqlite:///{tmp_path / 'mlflow.db'}"]
    if kind == "wandb":
        return ["--trainer.logger", "WandbLogger", "--trainer.logger.offline", "true",
                "--trainer.logger.save_dir", str(tmp_path / "wandb")]
    assert kind == "wandb_env"
    monkeypatch.setenv("WANDB_MODE", "offline")
    return ["--trainer.logger", "WandbLogger", "--trainer.logger.save_dir", str(tmp_path / "wandb")]


# ----------------------------------------------------------------------------------------------- fit
@pytest.mark.parametrize("kind", ["tensorboard", "csv", "mlflow", "wandb", "wandb_env", "false"])
def test_a_fit_with_any_logger_keeps_its_run_directory_and_scalars(kind, tiny_args, tmp_path, monkeypatch, request):
    if kind.startswith("wandb"):
        request.getfixturevalue("offline_wandb")
    if kind == "mlflow":
        request.getfixturevalue("mlflow_env")
    fit(*tiny_args, *STEPS, *_logger_args(kind, tmp_path, monkeypatch))
    run = tmp_path / "runs" / RUN
    assert sorted(p.relative_to(tmp_path / "runs").as_posix() for p in (tmp_path / "runs").glob("*/*")) == [RUN]
    # The run's layout, whatever the logger: its config, its checkpoints, its hyperparameters and its scalars.
    assert (run / "config.yaml").is_file() and (run / "hparams.yaml").is_file()
    assert RunDir(run).last_checkpoint.is_file() and RunDir(run).scalars.is_file()
    scalars = read_scalars(run)
    assert steps(scalars["val/acc"]) == [2, 5]  # 2 epochs of 3 steps, validated after each
    assert len(scalars["train/loss"]) == 6 and "persistence/score" in scalars and "epoch" in scalars
    assert "train/lr/network" in scalars  # the learning rate, whatever the logger (none at all included)
    final = last_scalars(run, "val/")
    assert 0 <= final["val/acc"] <= 1
    events = list(run.glob("events.out.tfevents.*"))
    if kind == "tensorboard":  # the file holds the series TensorBoard shows
        shown = read_event_scalars(run)
        assert set(shown) == set(scalars)
        for tag, points in shown.items():
            assert steps(points) == steps(scalars[tag]), tag
            assert [v for _, v in points] == pytest.approx([v for _, v in scalars[tag]], rel=1e-6, abs=1e-6), tag
    else:
        assert not events  # no TensorBoard logger: the scalars file alone
    if kind == "csv":  # the user's logger writes where it was told to
        (metrics,) = (tmp_path / "csv").glob("lightning_logs/version_0/metrics.csv")
        with open(metrics, newline="") as f:
            logged = [float(row["val/acc"]) for row in csv.DictReader(f) if row.get("val/acc")]
        assert logged == pytest.approx([v for _, v in scalars["val/acc"]])
    if kind == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("lightning_logs")  # MLFlowLogger's default experiment
        (mlflow_run,) = client.search_runs([experiment.experiment_id])
        assert mlflow_run.info.status == "FINISHED"
        assert mlflow_run.data.metrics["val/acc"] == pytest.approx(final["val/acc"])
    if kind.startswith("wandb"):
        assert list((tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb"))  # offline: written locally


def test_a_resumed_fit_drops_the_points_logged_after_its_checkpoint(tiny_args, tmp_path):
    """A run stopped after its epoch-1 checkpoint at step 3, with 6 more steps logged (a killed run's), resumed from
    that checkpoint: the scalars file keeps no point of the first run after step 3, and reads as the uninterrupted
    run. (3 epochs validated every 2: the final weights are validated after the fit, which appends to the file
    again.)"""
    every_epoch = ('{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
                   '"init_args": {"save_top_k": -1, "save_on_train_epoch_end": true}}')
    args = [*tiny_args, *STEPS, "--trainer.max_epochs", "3", "--trainer.check_val_every_n_epoch", "2",
            "--trainer.logger", "false", f"--trainer.callbacks+={every_epoch}"]
    fit(*args)
    run = tmp_path / "runs" / RUN
    uninterrupted, before = read_scalars(run), rows(run / "scalars.csv")
    assert steps(uninterrupted["val/acc"]) == [5, 9]  # after epoch 2, and the final weights after the fit
    fit(*args, "--ckpt_path", str(run / "checkpoints/epoch=0-step=3.ckpt"))
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]  # continued in the same run directory
    after = rows(run / "scalars.csv")
    kept = [row for row in before if row[0] <= 3]
    assert after[: len(kept)] == kept  # what the first run logged up to its checkpoint, in place
    # After the checkpoint, the points of one run (the resumed one), each as often as the uninterrupted run has it
    later = Counter(row for row in after if row[0] > 3)
    assert later and later == Counter(row for row in before if row[0] > 3)
    resumed = read_scalars(run)
    assert set(resumed) == set(uninterrupted)
    for tag, points in uninterrupted.items():
        assert steps(resumed[tag]) == steps(points), tag


def test_the_scalars_file_is_purged_and_repaired_once_when_appended_to(tmp_path):
    logger = ScalarsLogger(tmp_path, name="run", version=0)
    for step in range(5):
        logger.log_metrics({"a": float(step), "b": {"c": step * 2}}, step=step)
    logger.finalize("success")
    path = tmp_path / "run/version_0/scalars.csv"
    assert rows(path) == [(s, tag) for s in range(5) for tag in ("a", "b/c")]
    with open(path, "a") as f:
        f.write("5,a,0.")  # a killed process's half-written row
    resumed = ScalarsLogger(tmp_path, name="run", version=0, purge_step=3)
    resumed.log_metrics({"a": 30.0}, step=3)
    resumed.finalize("success")
    assert path.read_text().splitlines()[0] == "step,tag,value"  # one header
    assert rows(path) == [(s, tag) for s in range(3) for tag in ("a", "b/c")] + [(3, "a")]
    assert read_scalars(path.parent)["a"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    resumed.log_metrics({"a": 40.0}, step=4)  # after finalize (a validation after the fit): appended, no new purge
    resumed.finalize("success")
    assert read_scalars(path.parent)["a"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    # A file with a header only is a run that logged nothing: a failed run leaves no run directory behind.
    empty = ScalarsLogger(tmp_path, name="empty", version=0)
    empty.log_metrics({"x": "not a number"}, step=0)
    empty.log_hyperparams({"lr": 0.1})
    (Path(empty.log_dir) / "scalars.csv").write_text("step,tag,value\n")
    assert RunDir(empty.log_dir).remove_if_empty()


def test_runs_recorded_before_the_scalars_file_are_read_from_their_events(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    old = tmp_path / "old/lightning_logs/version_0"
    writer = SummaryWriter(str(old))
    for step in range(3):
        writer.add_scalar("val/acc", step / 4, step)
    writer.close()
    new = ScalarsLogger(tmp_path / "old", version=1)
    new.log_metrics({"test/acc": 0.5}, step=0)
    new.finalize("success")
    assert last_scalars(tmp_path / "old") == {"val/acc": 0.5, "test/acc": 0.5}
    # Beside a scalars file, a run's own event files are not read twice (their float32 values would win).
    events = SummaryWriter(str(new.log_dir))
    events.add_scalar("test/acc", 0.25, 0)
    events.close()
    assert read_scalars(new.log_dir) == {"test/acc": [(0, 0.5)]}


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("uri,pattern", [
    ("sqlite:///{tmp}/a_file/mlflow.db", r"File exists"),
    ("nosuchscheme://host/x", r"unsupported URI 'nosuchscheme://host/x'"),
    (None, r"The filesystem tracking backend .* is in maintenance mode"),  # the logger's default, ./mlruns
])
def test_an_mlflow_store_that_cannot_be_opened_is_one_line(uri, pattern, tiny_args, tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    (tmp_path / "a_file").write_text("not a directory")
    option = [] if uri is None else ["--trainer.logger.tracking_uri", uri.format(tmp=tmp_path)]
    uri = "file:./mlruns" if uri is None else uri.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as info:
        fit(*tiny_args, "--trainer.logger", "MLFlowLogger", *option)
    assert info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line == err.strip().splitlines()[-1] and "Traceback" not in err
    assert re.search(rf"error: trainer.logger: MLFlowLogger cannot open its tracking_uri '{re.escape(uri)}' "
                     rf"\(.*{pattern}.*\); expected a tracking store MLflow can open", line), line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlruns").exists()  # nothing written


def test_a_logger_class_that_does_not_exist_is_one_line(tiny_args, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        fit(*tiny_args, "--trainer.logger", "NoSuchLogger")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert re.fullmatch(r"error: trainer.logger: expected .*Logger.*, got 'NoSuchLogger' .*", err), err


# -------------------------------------------------------------------------------------------------- study
# The MLflow study is the CSV one's path with another logger (and a minute longer): slow.
@pytest.mark.parametrize("kind", ["csv", pytest.param("mlflow", marks=pytest.mark.slow)])
def test_a_study_whose_runs_use_another_logger_collects_every_run(kind, tmp_path):
    """``maskprior study`` as a user runs it: its run fitted, tested from its checkpoint and read back with its
    metrics and curves."""
    logger = {"csv": ["--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(tmp_path / "csv")],
              "mlflow": ["--trainer.logger", "MLFlowLogger", "--trainer.logger.tracking_uri",
                         f"sqlite:///{tmp_path / 'mlflow.db'}"]}[kind]
    if kind == "mlflow":
        pytest.importorskip("mlflow")
    out = tmp_path / "out"
    study = {
        "tasks": [{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")}],
        "inits": ["mask"], "seeds": [0], "test": True, "launcher": "local", "out_dir": str(out),
        "args": [*TINY_BOOLEAN, "--trainer.max_epochs", "1", "--trainer.check_val_every_n_epoch", "1",
                 "--trainer.enable_model_summary", "false", "--trainer.enable_progress_bar", "false",
                 "--trainer.callbacks", "null", *logger],
        "metrics": [{"tag": "test/acc", "label": "acc %", "scale": 100, "paper": "acc"}],
        "curves": ["val/acc"],
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "study", "-c", str(path)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "2parity/mask/seed0/result.json").read_text())
    assert result["status"] == "ok", result.get("error")  # fitted, then tested from its checkpoint
    assert 0 <= result["metrics"]["test/acc"] <= 1 and 0 <= result["metrics"]["val/acc"] <= 1
    fitted = out / "2parity/mask/seed0/lightning_logs/version_0"
    assert (fitted / "scalars.csv").is_file() and RunDir(fitted).last_checkpoint.is_file()
    with open(out / "results.csv", newline="") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["ok"]
    with gzip.open(out / "curves.csv.gz", "rt") as f:
        assert {row["seed"] for row in csv.DictReader(f) if row["tag"] == "val/acc"} == {"0"}
    if kind == "mlflow":  # the fit and the test logged there too
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert len([r for r in runs if "test/acc" in r.data.metrics]) == 1
        assert any("val/acc" in r.data.metrics for r in runs)

"""A run's record says what it trained: a resume keeps config.yaml as the run started and appends each changed option
as a segment at the resumed step (or refuses an option that cannot change mid-run), the schedule follows the
segments, and a command that fails leaves the record as it was."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from test_resume import BOOLEAN, _files, _fit, assert_same_scalars

from lightning_maskprior.run import record
from lightning_maskprior.run.rundir import RunDir
from lightning_maskprior.run.tensorboard import read_scalars

ONE_EPOCH = [*BOOLEAN, "--trainer.max_epochs", "1"]  # 3 steps of 16 examples
LR = 0.001  # the 2parity config's


@pytest.fixture(autouse=True)
def _helpers_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))  # resume_helpers, by class path


def _run(root: Path) -> Path:
    (run,) = root.glob("*/version_0")
    return run


def _lrs(run: Path) -> dict[int, float]:
    """The network's rate per step (Lightning's LearningRateMonitor names it after the optimizer when a constant
    rate has no scheduler)."""
    scalars = read_scalars(run)
    return {step: lr for tag in ("train/lr/network", "lr-Adam/network") for step, lr in scalars.get(tag, [])}


def _cosine(step: int, total: int) -> float:
    return LR * 0.5 * (1 + math.cos(math.pi * step / total))


def test_extending_a_run_records_a_segment_and_the_schedule_continues_from_the_resumed_step(tmp_path):
    """max_epochs 1 -> 2: config.yaml stays as the run started, changes.yaml holds the segment, the replayed record
    says 2 epochs, and step 3 trains at the new cosine's rate there (not at the old curve's end, 0)."""
    assert _fit(ONE_EPOCH, tmp_path) == 0
    run = _run(tmp_path)
    started = (run / "config.yaml").read_bytes()
    assert _fit([*BOOLEAN, "--trainer.max_epochs", "2", "--ckpt_path", "last"], tmp_path) == 0
    assert (run / "config.yaml").read_bytes() == started
    assert yaml.safe_load((run / "changes.yaml").read_text()) == [
        {"step": 3, "changed": {"trainer.max_epochs": {"old": 1, "new": 2}}}]
    assert record.replay(RunDir(run))["trainer.max_epochs"] == 2
    lrs = _lrs(run)
    assert [lrs[s] for s in range(3)] == pytest.approx([_cosine(s, 3) for s in range(3)])
    assert [lrs[s] for s in range(3, 6)] == pytest.approx([_cosine(s, 6) for s in range(3, 6)])


@pytest.mark.parametrize("then,now", [("cosine", "constant"), ("constant", "cosine")])
def test_a_changed_lr_schedule_takes_effect_at_the_resumed_step(tmp_path, then, now):
    """cosine -> constant trains on at the config's lr (not the decayed 0); constant -> cosine continues the cosine
    at the resumed step (not from its start)."""
    assert _fit([*ONE_EPOCH, "--model.lr_schedule", then], tmp_path) == 0
    run = _run(tmp_path)
    weights = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert _fit([*BOOLEAN, "--trainer.max_epochs", "2", "--model.lr_schedule", now, "--ckpt_path", "last"],
                tmp_path) == 0
    lrs = _lrs(run)
    expected = [LR] * 3 if now == "constant" else [_cosine(s, 6) for s in range(3, 6)]
    assert [lrs[s] for s in range(3, 6)] == pytest.approx(expected)
    moved = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert not torch.equal(moved["backbone.blocks.0.attn.qkv.weight"], weights["backbone.blocks.0.attn.qkv.weight"])
    segment = yaml.safe_load((run / "changes.yaml").read_text())[0]
    assert segment["changed"]["model.lr_schedule"] == {"old": then, "new": now}


@pytest.mark.parametrize("option,value,why", [
    ("--data.init_args.batch_size", "8", "data.init_args.batch_size cannot change when resuming run"),
    ("--model.backbone.init_args.dropout", "0.1", "model.backbone.init_args.dropout cannot change when resuming run"),
], ids=["batch-size", "backbone"])
def test_an_option_that_cannot_change_mid_run_is_refused_in_one_line(tmp_path, capsys, option, value, why):
    assert _fit(ONE_EPOCH, tmp_path) == 0
    before = _files(tmp_path)
    capsys.readouterr()
    checkpoint = str(_run(tmp_path) / "checkpoints" / "last.ckpt")
    assert _fit([*BOOLEAN, "--trainer.max_epochs", "2", option, value, "--ckpt_path", checkpoint], tmp_path) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err[-2000:]
    # `--ckpt_path last` looks for a run of this config; one whose model differs is not it, and the line says why
    assert _fit([*BOOLEAN, "--trainer.max_epochs", "2", option, value, "--ckpt_path", "last"], tmp_path) == 2
    err = capsys.readouterr().err
    assert option.removeprefix("--") in err and "Traceback" not in err, err[-2000:]
    assert _files(tmp_path) == before


def test_a_resume_that_fails_before_its_first_checkpoint_leaves_the_record_as_it_was(tmp_path):
    assert _fit(ONE_EPOCH, tmp_path) == 0
    run = _run(tmp_path)
    started = (run / "config.yaml").read_bytes()
    with pytest.raises(RuntimeError, match="crash at step 4"):
        _fit([*BOOLEAN, "--trainer.max_epochs", "2", "--ckpt_path", "last",
              "--trainer.callbacks+=resume_helpers.CrashAt", "--trainer.callbacks.step", "4"], tmp_path)
    assert (run / "config.yaml").read_bytes() == started
    assert not (run / "changes.yaml").exists()


@pytest.mark.parametrize("extend", [["--trainer.max_steps", "-1"], ["--trainer.max_steps", "9"]],
                         ids=["by-epochs", "by-steps"])
def test_a_run_stopped_by_max_steps_inside_an_epoch_continues_inside_it(tmp_path, extend):
    """Stopped at step 4 (epoch 1, batch 1 of 3) and extended: every scalar equals the uninterrupted run's (a
    constant rate, so the first part's schedule is the same)."""
    args = [*BOOLEAN, "--model.lr_schedule", "constant"]
    assert _fit(args, tmp_path / "full") == 0
    assert _fit([*args, "--trainer.max_steps", "4"], tmp_path / "resumed") == 0
    assert _fit([*args, *extend, "--ckpt_path", "last"], tmp_path / "resumed") == 0
    assert_same_scalars(tmp_path / "full", tmp_path / "resumed")


def test_segments_replay_in_order_and_a_broken_changes_file_is_named(tmp_path):
    run = RunDir(tmp_path)
    run.config_path.write_text(yaml.safe_dump({"trainer": {"max_epochs": 1}, "model": {"lr_schedule": "cosine"}}))
    record.append_segment(run, 3, {"trainer.max_epochs": (1, 2)})
    record.append_segment(run, 6, {"trainer.max_epochs": (2, 4), "model.lr_schedule": ("cosine", "constant")})
    assert record.replay(run) == {"trainer.max_epochs": 4, "model.lr_schedule": "constant"}
    assert record.differences(record.replay(run), {"trainer.max_epochs": 4, "model.lr_schedule": "constant",
                                                   "ckpt_path": "x"}) == {}
    run.changes.write_text("[1, 2]")
    with pytest.raises(record.RecordError, match="changes.yaml is not a list of {step, changed} segments"):
        record.replay(run)


# ----------------------------------------------------------------------------------------- reloading a run
def _edit_config(run: Path, edit) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    edit(config["model"])
    (run / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("edit,named", [
    (lambda model: model["backbone"]["init_args"].update(mlp_dim=64),
     "model.backbone.init_args.mlp_dim: checkpoint 32, config 64"),
    (lambda model: model.update(parameterisation="low_rank"), "model.parameterisation: checkpoint 'full', config "
                                                              "'low_rank'"),
    (lambda model: model.update(prior_rank=2), "model.prior_rank: checkpoint 8, config 2"),
], ids=["width", "parameterisation", "rank"])
def test_load_run_names_an_edited_width_parameterisation_or_rank(tmp_path, edit, named):
    from lightning_maskprior import load_run
    from lightning_maskprior.checkpoints import CheckpointError

    assert _fit(ONE_EPOCH, tmp_path) == 0
    run = _run(tmp_path)
    _edit_config(run, edit)
    with pytest.raises(CheckpointError, match=named.replace("(", r"\(")):
        load_run(run)


def test_a_reload_measures_against_the_structure_the_run_trained_with_when_its_file_changed(tmp_path):
    """The structure file was overwritten after the fit: load_run's module holds the trained structure (from the
    checkpoint) and says that the config's now builds another."""
    from lightning_maskprior import load_run

    trained = torch.eye(6, dtype=torch.bool)
    trained[0, 1] = trained[1, 0] = True
    path = tmp_path / "structure.pt"
    torch.save(trained, path)
    assert _fit([*ONE_EPOCH, "--model.structure", f"{{file: {path}}}"], tmp_path / "runs") == 0
    other = torch.eye(6, dtype=torch.bool)
    other[2, 3] = other[3, 2] = True
    torch.save(other, path)
    with pytest.warns(UserWarning, match="checkpoint was trained with Structure.*the config's structure now builds"):
        module, _ = load_run(_run(tmp_path / "runs"))
    assert torch.equal(module.structure.open[0, 0], trained)


def test_ckpt_path_last_resumes_an_older_run_of_this_config_when_the_newest_has_another_width(tmp_path):
    """Two runs of one task, init and seed: the newest with another width. ``last`` takes the older one, which the
    config builds exactly, instead of refusing the newest's shapes."""
    assert _fit(ONE_EPOCH, tmp_path) == 0  # version_0, mlp_dim 32
    assert _fit([*ONE_EPOCH, "--model.backbone.init_args.mlp_dim", "64"], tmp_path) == 0  # version_1, the newest
    assert _fit([*BOOLEAN, "--trainer.max_epochs", "2", "--ckpt_path", "last"], tmp_path) == 0
    (older,) = tmp_path.glob("*/version_0/checkpoints/last.ckpt")
    assert torch.load(older, map_location="cpu", weights_only=True)["global_step"] == 6


def test_a_resume_with_a_change_leaves_hparams_as_the_run_started_and_readers_follow_the_segments(tmp_path):
    """The record (config.yaml and its segments) is the one truth: hparams.yaml and the TensorBoard HPARAMS session stay
    as the run started (the resumed fit writes no second session claiming its values for the whole run), and what
    reads a run's options (the precision it trained in last, the datamodule it is reopened with) reads the record."""
    from test_callbacks import session_starts

    from lightning_maskprior.run.load import run_precision
    from lightning_maskprior.run.tensorboard import read_hparams

    assert _fit([*ONE_EPOCH, "--trainer.precision", "bf16-mixed"], tmp_path) == 0
    run = _run(tmp_path)
    started = (run / "hparams.yaml").read_bytes()
    assert _fit([*BOOLEAN, "--trainer.max_epochs", "2", "--trainer.precision", "32-true",
                 "--model.optimizer.init_args.lr", "0.0005", "--ckpt_path", "last"], tmp_path) == 0
    assert record.replay(RunDir(run))["model.optimizer.init_args.lr"] == 0.0005
    assert (run / "hparams.yaml").read_bytes() == started
    assert [session_starts(path) for path in sorted(run.glob("events.out.tfevents.*"))] == [1, 0]
    assert read_hparams(run)[0]["trainer/max_epochs"] == 1 and read_hparams(run)[0]["optimizer/lr"] == LR
    assert RunDir(run).precision() == run_precision(run) == "32-true"  # config.yaml says bf16-mixed
    assert RunDir(run).trained_config()["model"]["optimizer"]["init_args"]["lr"] == 0.0005
    assert RunDir(run).config()["model"]["optimizer"]["init_args"]["lr"] == LR


def test_a_studys_test_of_a_resumed_run_is_given_the_options_its_segments_changed(tmp_path):
    from lightning_maskprior.study.cell import test_command

    run = RunDir(tmp_path / "version_0")
    run.path.mkdir()
    run.config_path.write_text("trainer: {precision: bf16-mixed, max_epochs: 1}\n")
    record.append_segment(run, 3, {"trainer.precision": ("bf16-mixed", "32-true"), "trainer.max_epochs": (1, 2)})
    record.append_segment(run, 6, {"model.optimizer.init_args.betas": ([0.9, 0.999], [0.8, 0.99]),
                                   "trainer.max_epochs": (2, 3)})
    assert test_command(run, run.last_checkpoint, tmp_path) == [
        "test", "-c", str(run.config_path), "--trainer.precision=32-true", "--trainer.max_epochs=3",
        "--model.optimizer.init_args.betas=[0.8, 0.99]", "--ckpt_path", str(run.last_checkpoint),
        "--trainer.default_root_dir", str(tmp_path)]

"""Checkpoints that cannot be mixed up or lost: bound to their run's task and init, ``last`` the same for every
subcommand, written atomically, saved after every epoch; a resumed run's test keeps every curve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, ROOT, TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.run import record
from lightning_maskprior.run.atomic import AtomicCheckpointIO
from lightning_maskprior.run.rundir import RunDir
from lightning_maskprior.run.tensorboard import read_scalars

COMMON = [*TINY_BOOLEAN, "--data.init_args.batch_size", "16", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "1"]


def config(task: str = "2parity", init: str = "mask") -> list[str]:
    return ["-c", str(CONFIGS / f"boolean/{task}.yaml"), "-c", str(CONFIGS / f"init/{init}.yaml")]


def run_exit(args: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(args)
    return info.value.code


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2parity mask run of 3 epochs, validated every 2 (so epoch 2 ends without a validation)."""
    root = tmp_path_factory.mktemp("runs")
    main(["fit", *config(), *COMMON, "--trainer.max_epochs", "3", "--trainer.check_val_every_n_epoch", "2",
          "--trainer.default_root_dir", str(root)])
    return root


def ckpt(root: Path) -> Path:
    return root / "2parity-mask-seed0/version_0/checkpoints/last.ckpt"


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_a_checkpoint_of_another_task_is_refused_before_anything_is_written(trained, tmp_path, capsys, subcommand):
    root = tmp_path / "other"
    code = run_exit([subcommand, *config("majority3"), *COMMON, "--trainer.default_root_dir", str(root),
                     "--ckpt_path", str(ckpt(trained))])
    err = capsys.readouterr().err
    assert code == 2
    assert "data.init_args.task: checkpoint '2parity', config 'majority3'" in err
    assert not root.exists()


def test_a_checkpoint_of_another_init_or_init_options_is_refused(trained, tmp_path, capsys):
    code = run_exit(["test", *config(init="default"), *COMMON, "--ckpt_path", str(ckpt(trained)),
                     "--trainer.default_root_dir", str(tmp_path)])
    assert code == 2 and "model.init: checkpoint 'mask', config 'default'" in capsys.readouterr().err
    code = run_exit(["test", *config(), *COMMON, "--ckpt_path", str(ckpt(trained)),
                     "--model.init_options", "{open_value: 5.0}", "--trainer.default_root_dir", str(tmp_path)])
    assert code == 2 and "model.init_options: checkpoint {}, config {'open_value': 5.0}" in capsys.readouterr().err


def test_a_checkpoint_trained_on_another_objective_is_refused(trained, tmp_path, capsys):
    """The objective (the loss trained on, the metrics scored by) binds a checkpoint as its init does."""
    code = run_exit(["test", *config(), *COMMON, "--ckpt_path", str(ckpt(trained)), "--model.objective", "regression",
                     "--trainer.default_root_dir", str(tmp_path)])
    assert code == 2 and "model.objective: checkpoint None, config 'regression'" in capsys.readouterr().err


def test_the_run_config_and_its_own_checkpoint_are_accepted(trained, tmp_path, capsys):
    run_config = str(ckpt(trained).parent.parent / "config.yaml")
    main(["test", "-c", run_config, "--ckpt_path", str(ckpt(trained)), "--trainer.default_root_dir", str(tmp_path),
          "--data.init_args.eval_batch_size", "32"])  # a run-only option may differ
    assert "test/acc" in capsys.readouterr().out


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_test_and_predict_need_a_checkpoint(tmp_path, capsys, subcommand):
    code = run_exit([subcommand, *config(), *COMMON, "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"{subcommand} needs --ckpt_path, got none" in err
    assert not any(tmp_path.iterdir())


def test_last_resolves_for_test_as_for_fit(trained, tmp_path, capsys):
    main(["test", *config(), *COMMON, "--trainer.default_root_dir", str(trained), "--ckpt_path", "last"])
    by_last = capsys.readouterr().out
    main(["test", *config(), *COMMON, "--trainer.default_root_dir", str(trained), "--ckpt_path", str(ckpt(trained))])
    by_path = capsys.readouterr().out
    assert by_last.split("test metrics")[1].splitlines()[1:] == by_path.split("test metrics")[1].splitlines()[1:]
    code = run_exit(["test", *config(), *COMMON, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", "last"])
    assert code == 2 and "--ckpt_path last: no last.ckpt under" in capsys.readouterr().err


def test_last_checkpoint_is_saved_after_every_epoch_whatever_the_validation_cadence(trained):
    saved = torch.load(ckpt(trained), map_location="cpu", weights_only=True)
    assert saved["epoch"] == 2  # the third epoch, which had no validation of its own


def test_a_command_line_option_wins_on_resume(trained, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained, root)
    main(["fit", *config(), *COMMON, "--trainer.max_epochs", "4", "--trainer.check_val_every_n_epoch", "2",
          "--trainer.default_root_dir", str(root), "--ckpt_path", "last", "--model.lr_schedule", "constant"])
    run = RunDir(root / "2parity-mask-seed0/version_0")
    assert run.config()["model"]["lr_schedule"] == "cosine"  # config.yaml: how the run started
    assert record.replay(run)["model.lr_schedule"] == "constant"  # its record: how it went on
    steps_before = torch.load(ckpt(trained), map_location="cpu", weights_only=True)["global_step"]
    scalars = read_scalars(root / "2parity-mask-seed0/version_0")
    before = [lr for step, lr in scalars["train/lr/network"] if step < steps_before]
    # With no scheduler (constant, no warm-up) Lightning's LearningRateMonitor names the tag after the optimizer.
    after = [lr for step, lr in scalars["lr-Adam/network"] if step >= steps_before]
    assert before[-1] < before[0]  # the first fit decayed by cosine
    assert after == pytest.approx([1e-3] * len(after)) and after  # the command line's schedule at the config's lr


def test_testing_a_resumed_run_with_its_config_keeps_every_curve(trained, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained, root)
    version = root / "2parity-mask-seed0/version_0"
    main(["fit", *config(), *COMMON, "--trainer.max_epochs", "5", "--trainer.check_val_every_n_epoch", "2",
          "--trainer.default_root_dir", str(root), "--ckpt_path", "last"])
    assert "purge_step" not in (version / "config.yaml").read_text()  # the record: the config the run started with
    before = read_scalars(version)
    main(["test", "-c", str(version / "config.yaml"), "--ckpt_path", str(version / "checkpoints/last.ckpt"),
          "--trainer.default_root_dir", str(root)])
    after = read_scalars(version)
    for tag, points in before.items():
        assert after[tag][: len(points)] == points, tag
    assert "test/acc" in read_scalars(root / "2parity-mask-seed0/version_1")  # a test logs beside the run


# ---------------------------------------------------------------------------------------- atomic writes
def test_a_failed_checkpoint_save_leaves_the_good_one(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    good = path.read_bytes()

    def full_disk(checkpoint, filepath):  # what a full disk does to Lightning's own writer: a part, then an error
        Path(filepath).write_bytes(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("lightning.fabric.plugins.io.torch_io._atomic_save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_last_falls_back_to_the_newest_intact_checkpoint(trained, tmp_path, capsys):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained, root)
    checkpoints = root / "2parity-mask-seed0/version_0/checkpoints"
    data = (checkpoints / "last.ckpt").read_bytes()
    (checkpoints / "last.ckpt").write_bytes(data[:40960])
    found, note = RunDir.resolve_last(root)
    assert found is not None and found.name != "last.ckpt" and found.parent == checkpoints
    assert "last.ckpt is not a complete checkpoint" in note
    main(["test", *config(), *COMMON, "--trainer.default_root_dir", str(root), "--ckpt_path", "last"])
    assert "using the newest intact one" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- run directories
def test_two_fits_in_one_slurm_job_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    args = ["fit", *config(), *COMMON, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path)]
    main(args)
    main(args)
    versions = sorted(p.name for p in (tmp_path / "2parity-mask-seed0").iterdir())
    assert versions == ["version_4242", "version_4242_1"]
    first = tmp_path / "2parity-mask-seed0/version_4242/checkpoints"
    assert [p.name for p in first.glob("last*.ckpt")] == ["last.ckpt"]


def test_a_value_a_class_refuses_is_one_line_and_exit_2_from_the_console_script(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "fit", *config(), *COMMON,
                           "--trainer.default_root_dir", str(tmp_path), "--data.init_args.target", "{x1: 1}"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error: a task of your own needs both `target` and `seen`" in proc.stderr
    assert not tmp_path.joinpath("2parity-mask-seed0").exists()


def test_every_checkpoint_of_a_fit_goes_through_the_atomic_writer(tmp_path, monkeypatch):
    saved = []
    original = AtomicCheckpointIO.save_checkpoint

    def counting(self, checkpoint, path, storage_options=None):
        saved.append(Path(path).name)
        return original(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counting)
    main(["fit", *config(), *COMMON, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(tmp_path)])
    written = sorted(p.name for p in tmp_path.rglob("*.ckpt"))
    assert written and set(written) <= set(saved)


def test_load_run_refuses_a_config_yaml_edited_to_another_task(trained, tmp_path):
    """load_run builds the datamodule from config.yaml and the model from the checkpoint: an edited task there is
    refused naming both values, not the old model paired with the new datamodule."""
    import shutil

    from lightning_maskprior import load_run
    from lightning_maskprior.run.rundir import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(ckpt(trained).parent.parent, run)
    module, datamodule = load_run(run)  # its own config: accepted
    assert datamodule.task == "2parity"
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("task: 2parity", "task: majority3"))
    with pytest.raises(CheckpointError, match=r"config.yaml does not describe the run of checkpoint \S+last.ckpt: "
                                              r"data.init_args.task: checkpoint '2parity', config 'majority3'"):
        load_run(run)


def test_a_checkpoint_that_records_no_datamodule_is_refused(trained, tmp_path):
    """A checkpoint without hyper_parameters.datamodule (edited, or of a module built in Python with task= only) is
    bound to no task: refused through the console script in one line, nothing written."""
    saved = torch.load(ckpt(trained), map_location="cpu", weights_only=True)
    del saved["hyper_parameters"]["datamodule"]
    bare = tmp_path / "bare.ckpt"
    torch.save(saved, bare)
    root = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "test", *config("majority3"), *COMMON,
                           "--trainer.default_root_dir", str(root), "--ckpt_path", str(bare)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "the checkpoint records no datamodule (hyper_parameters.datamodule), the config asks for " \
           "lightning_maskprior.datamodules.BooleanGOTUDataModule" in errors[0]
    assert not root.exists()


@pytest.mark.parametrize(("subcommand", "by"), [("fit", "path"), ("fit", "last"), ("test", "last")])
def test_a_run_reads_its_checkpoint_once(trained, tmp_path, monkeypatch, subcommand, by):
    """Every check of the checkpoint (binding, optimizer, step, shapes) and Lightning's restore use one read of it."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained, root)
    reads = []
    load = torch.load

    def counting_load(f, *args, **kwargs):
        reads.append(Path(f).name if isinstance(f, str | os.PathLike) else f)
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    main([subcommand, *config(), *COMMON, "--trainer.max_epochs", "4", "--trainer.default_root_dir", str(root),
          "--ckpt_path", "last" if by == "last" else str(ckpt(root))])
    assert reads == ["last.ckpt"]

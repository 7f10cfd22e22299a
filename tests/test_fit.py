"""End to end through the CLI on tiny problems: metrics, run directories and bad input."""

import re
import subprocess
import sys

import pytest
import torch

from conftest import CONFIGS, ROOT
from lightning_maskprior.cli import main
from lightning_maskprior.run.tensorboard import read_scalars

METRICS = ["acc", "mse", "unseen_acc", "unseen_mse", "mdi_acc", "mdi_mse"]


def run_cli(*args):
    return main(list(args))


@pytest.mark.parametrize("init", ["default", "mask", "zero", "fixed"])
def test_tiny_fit_logs_every_metric(tiny_args, tmp_path, capsys, init):
    run_cli("fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / f"init/{init}.yaml"),
            *tiny_args)
    out = capsys.readouterr().out
    assert "final validation metrics" in out
    for name in METRICS:
        assert f"val/{name} " in out
    run_dirs = list((tmp_path / "runs").glob("*/version_*"))
    assert len(run_dirs) == 1
    scalars = read_scalars(run_dirs[0])
    for name in METRICS:
        assert len(scalars[f"val/{name}"]) == 2  # one point per validation (2 epochs)
    # 2parity on n=6: the MDI is right on 3/4 of the cube, wrong on the unseen quarter.
    assert scalars["val/mdi_acc"][-1][1] == pytest.approx(0.75)
    assert (run_dirs[0] / "config.yaml").is_file()
    assert list((run_dirs[0] / "checkpoints").glob("*.ckpt"))


def test_last_epoch_is_validated_when_the_validation_interval_skips_it(tiny_args, tmp_path, capsys):
    """max_epochs 3 with validation every 2 epochs: the final weights are still validated and printed."""
    run_cli("fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
            *tiny_args, "--trainer.max_epochs", "3", "--trainer.check_val_every_n_epoch", "2")
    out = capsys.readouterr().out
    assert "final validation metrics" in out and "val/acc " in out
    (run_dir,) = (tmp_path / "runs").glob("*/version_*")
    scalars = read_scalars(run_dir)
    steps = [step for step, _ in scalars["val/acc"]]
    assert len(steps) == 2  # after epoch 2, then after the final epoch 3
    assert steps[0] < steps[1]


def test_last_ckpt_holds_the_final_weights_when_checkpoints_are_saved_every_n_epochs(tiny_args, tmp_path):
    """A ModelCheckpoint every 2 epochs and max_epochs 3: last.ckpt is still the end of training (what test reads)."""
    callback = ('{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": true, '
                '"every_n_epochs": 2, "save_on_train_epoch_end": true}}')
    run_cli("fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"), *tiny_args,
            "--trainer.max_epochs", "3", "--trainer.callbacks+", callback)
    (run_dir,) = (tmp_path / "runs").glob("*/version_*")
    checkpoints = {p.name: torch.load(p, map_location="cpu", weights_only=False) for p in
                   (run_dir / "checkpoints").glob("*.ckpt")}
    steps_per_epoch = checkpoints["last.ckpt"]["global_step"] // 3
    assert checkpoints["last.ckpt"]["epoch"] == 3 and steps_per_epoch > 0
    assert [c["global_step"] for n, c in checkpoints.items() if n != "last.ckpt"] == [2 * steps_per_epoch]


def test_mask_prior_is_trained_and_fixed_is_not(tiny_args, tmp_path):
    for init in ("mask", "fixed"):
        run_cli("fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / f"init/{init}.yaml"),
                *tiny_args, "--trainer.default_root_dir", str(tmp_path / init))
        ckpt = next((tmp_path / init).rglob("*.ckpt"))
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        prior = state["backbone.blocks.0.attn.prior_logits"]
        initial = torch.where(prior > 0, 10.0, -10.0)  # open entries stay positive in so few steps
        moved = (prior - initial).abs().max()
        assert (moved > 0) if init == "mask" else (moved == 0)


def test_test_subcommand_reports_test_metrics(tiny_args, capsys):
    run_cli("fit", "-c", str(CONFIGS / "boolean/majority3.yaml"), *tiny_args)
    run_cli("test", "-c", str(CONFIGS / "boolean/majority3.yaml"), *tiny_args, "--ckpt_path", "last")
    out = capsys.readouterr().out
    for name in METRICS:
        assert f"test/{name} " in out


@pytest.mark.parametrize(
    "override,message",
    [
        (["--data.init_args.task", "parity"], "unknown Boolean task 'parity'"),
        (["--model.init", "svd"], "unknown init method 'svd'"),
        (["--model.init", "mask", "--model.init_options", "{open_value: -1, closed_value: 1}"],
         r"open value \(-1\) must be greater than closed value \(1\)"),
        (["--model.init", "mask", "--model.structure", "{file: missing.pt}"], "missing.pt does not exist"),
        (["--model.init", "mask", "--model.init_options", "{open: 3}"], r"unknown options \['open'\]"),
    ],
)
def test_bad_input_fails_with_a_clear_message(tiny_args, override, message, capsys):
    with pytest.raises(SystemExit) as info:
        run_cli("fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), *tiny_args, *override)
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_structure_size_mismatch_is_reported(tiny_args, tmp_path, capsys):
    path = tmp_path / "s.pt"
    torch.save(torch.eye(7, dtype=torch.bool), path)
    with pytest.raises(SystemExit) as info:
        run_cli("fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), *tiny_args,
                "--model.init", "mask", "--model.structure", f"{{file: {path}}}")
    assert info.value.code == 2
    assert "structure is 7x7 but the sequence has 6 tokens" in capsys.readouterr().err


def test_ddp_two_processes_match_one_process(tmp_path):
    """Two gloo processes evaluate the full cube exactly once and report what one process does."""
    common = [
        "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
        "--data.init_args.n", "7", "--data.init_args.eval_batch_size", "50",
        "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "1",
        "--model.backbone.init_args.head_dim", "8", "--model.backbone.init_args.mlp_dim", "16",
        "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
    ]
    results = {}
    for name, extra in {"single": [], "ddp": ["-c", str(CONFIGS / "trainer/ddp.yaml")]}.items():
        root = tmp_path / name
        # validate (no training): both runs evaluate the same initial model on 2^7 = 128 points,
        # split 50 + 50 + 28 in one process and unevenly over two.
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_maskprior.cli", "validate", *common, *extra,
             "--trainer.default_root_dir", str(root)],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = read_scalars(next(root.glob("*/version_*")))
    for metric in METRICS:
        single = results["single"][f"val/{metric}"][-1][1]
        assert results["ddp"][f"val/{metric}"][-1][0] == 0  # logged once, at step 0
        ddp = results["ddp"][f"val/{metric}"][-1][1]
        assert ddp == pytest.approx(single, rel=1e-5, abs=1e-6), metric


def test_ddp_fit_runs_and_logs_every_metric(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_maskprior.cli", "fit",
         "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
         "-c", str(CONFIGS / "trainer/ddp.yaml"),
         "--data.init_args.n", "6", "--model.backbone.init_args.dim", "16",
         "--model.backbone.init_args.depth", "1", "--model.backbone.init_args.head_dim", "8",
         "--model.backbone.init_args.mlp_dim", "16", "--trainer.enable_progress_bar", "false",
         # validated after epoch 2 and, since max_epochs is odd, once more after the fit (2 points)
         "--trainer.max_epochs", "3", "--trainer.check_val_every_n_epoch", "2",
         "--trainer.default_root_dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final validation metrics" in proc.stdout
    scalars = read_scalars(next(tmp_path.glob("*/version_*")))
    for metric in METRICS:
        assert len(scalars[f"val/{metric}"]) == 2, metric

"""Packaged configs by short name, reopening a run (load_from_checkpoint, load_run), predict, --help."""

import csv
import importlib.util
import subprocess
import sys

import pytest
import torch

from conftest import CONFIGS, ROOT
from lightning_maskprior import load_run, run_precision
from lightning_maskprior.cli import main
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import config_files, precision
from lightning_maskprior.run.tensorboard import read_scalars
from lightning_maskprior.study.spec import _resolve_path


# ------------------------------------------------------------------------------ packaged configs
def test_short_config_names_resolve_to_the_packaged_files_from_an_empty_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = config_files.resolve_argv(["fit", "-c", "boolean/2parity.yaml", "-c", "configs/init/mask.yaml",
                                      "--config=init/zero.yaml", "--trainer.max_epochs", "1"])
    assert argv[2] == str(CONFIGS / "boolean/2parity.yaml")
    assert argv[4] == str(CONFIGS / "init/mask.yaml")
    assert argv[5] == f"--config={CONFIGS / 'init/zero.yaml'}"
    assert argv[6:] == ["--trainer.max_epochs", "1"]
    assert config_files.resolve_argv(["fit", "-c", "nowhere.yaml"]) == ["fit", "-c", "nowhere.yaml"]


def test_a_local_config_wins_over_the_packaged_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "boolean").mkdir()
    (tmp_path / "boolean/2parity.yaml").write_text("seed_everything: 1\n")
    (tmp_path / "configs/init").mkdir(parents=True)
    (tmp_path / "configs/init/mask.yaml").write_text("model: {init: mask}\n")
    argv = config_files.resolve_argv(["fit", "-c", "boolean/2parity.yaml", "-c", "init/mask.yaml"])
    assert argv[2] == "boolean/2parity.yaml"  # a file here: left as given
    assert argv[4] == str(tmp_path / "configs/init/mask.yaml")


def test_configs_command_lists_and_copies(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["configs"])
    out = capsys.readouterr().out
    assert "boolean/2parity.yaml" in out and "init/mask.yaml" in out and "study/boolean_cpu.yaml" in out
    main(["configs", "copy", "init/mask.yaml"])
    assert (tmp_path / "configs/init/mask.yaml").read_text() == (CONFIGS / "init/mask.yaml").read_text()
    with pytest.raises(SystemExit):
        main(["configs", "copy", "init/none.yaml"])


def test_a_reader_that_stops_early_gets_no_traceback():
    """`maskprior configs | head -1`: the listing's reader closes the pipe first; the command ends quietly with
    128 + SIGPIPE, as Unix tools do, instead of a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "lightning_maskprior.cli", "configs"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command has started: every write it makes fails
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_study_task_configs_resolve_by_short_name(tmp_path):
    assert _resolve_path("boolean/2parity.yaml", "tasks[0]", [tmp_path]) == (CONFIGS / "boolean/2parity.yaml")
    assert _resolve_path("configs/init/mask.yaml", "inits[0]", [tmp_path]) == (CONFIGS / "init/mask.yaml")


def test_help_mentions_study_and_configs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog at the terminal's width
    assert "maskprior study" in out and "maskprior configs" in out and "maskprior discover" in out


# ------------------------------------------------------------------------------------- reloading
@pytest.fixture
def finished_run(tiny_args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", "-c", "boolean/2parity.yaml", "-c", "init/mask.yaml", *tiny_args])
    (run_dir,) = (tmp_path / "runs").glob("*/version_*")
    return run_dir


def test_load_from_checkpoint_needs_no_arguments_and_loads_safely(finished_run):
    ckpt = finished_run / "checkpoints/last.ckpt"
    hparams = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert hparams["datamodule"]["class_path"].endswith("BooleanGOTUDataModule")
    assert hparams["backbone"]["init_args"]["dim"] == 16
    module = MaskPriorModule.load_from_checkpoint(ckpt)
    assert module.task.name == "boolean/2parity" and module.init_method == "mask"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert torch.equal(module.state_dict()["backbone.blocks.0.attn.prior_logits"],
                       state["backbone.blocks.0.attn.prior_logits"])


def test_load_run_and_the_example_reproduce_the_logged_validation_exactly(finished_run, capsys):
    import lightning as L

    logged = {tag: points[-1][1] for tag, points in read_scalars(finished_run).items() if tag.startswith("val/")}
    module, datamodule = load_run(finished_run)
    assert run_precision(finished_run) == precision.resolve("cpu", "bf16-mixed")[0]  # the config's, or fp32
    trainer = L.Trainer(logger=False, enable_progress_bar=False, precision=run_precision(finished_run))
    metrics = trainer.validate(module, datamodule=datamodule)[0]
    assert metrics["val/acc"] == logged["val/acc"]
    assert metrics["val/mse"] == pytest.approx(logged["val/mse"], rel=1e-6)

    spec = importlib.util.spec_from_file_location("analyse_run", ROOT / "examples/analyse_run.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(str(finished_run))["val/acc"] == logged["val/acc"]
    out = capsys.readouterr().out
    assert "prior sigmoid(M)" in out and "unseen slice" in out


# --------------------------------------------------------------------------------------- predict
def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_writes_boolean_predictions_to_the_run_directory(finished_run, tiny_args, capsys):
    main(["predict", "-c", "boolean/2parity.yaml", "-c", "init/mask.yaml", *tiny_args[:-4],
          "--ckpt_path", str(finished_run / "checkpoints/last.ckpt")])
    rows = _read_csv(finished_run / "predictions.csv")
    assert len(rows) == 2**6
    assert set(rows[0]) == {"prediction", "label", "target", "unseen", "mdi"}
    assert sum(int(r["unseen"]) for r in rows) == 2**6 // 4  # 2parity: the quarter x0 = x1 = -1
    assert "wrote 64 predictions" in capsys.readouterr().out
    assert [p.name for p in finished_run.parents[1].iterdir()] == [finished_run.parent.name]  # no empty predict run


def test_predict_writes_arithmetic_predictions(tmp_path):
    args = ["-c", str(CONFIGS / "arithmetic/addition.yaml"), "--trainer.default_root_dir", str(tmp_path),
            "--data.init_args.num_digits", "2", "--data.init_args.train_fraction", "0.5",
            "--data.init_args.val_size", "10", "--data.init_args.test_size", "20",
            "--trainer.enable_progress_bar", "false"]
    main(["fit", *args, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
          "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "1",
          "--model.backbone.init_args.head_dim", "8", "--model.backbone.init_args.mlp_dim", "16"])
    main(["predict", *args, "--ckpt_path", "last", "--model.backbone.init_args.dim", "16",
          "--model.backbone.init_args.depth", "1", "--model.backbone.init_args.head_dim", "8",
          "--model.backbone.init_args.mlp_dim", "16"])
    (path,) = tmp_path.rglob("predictions.csv")
    rows = _read_csv(path)
    assert len(rows) == 20 and "prediction" in rows[0] and "digits" in rows[0]

"""TensorBoard that compares runs: readable run directories, the HPARAMS session, the learning-rate curve, tag groups.

One tiny fit and its test (seconds), read back from the event files the way TensorBoard reads them.
"""

import math
from types import SimpleNamespace

import pytest

from conftest import CONFIGS, TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.run.cli import _default_logger, run_name
from lightning_maskprior.run.rundir import StudyRunDir
from lightning_maskprior.run.tensorboard import read_hparams, read_scalars

STEPS = 6  # 48 seen points of the 6-bit cube, batch 16, 2 epochs


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A mask fit on 2parity (every step logged) and ``maskprior test`` of its last.ckpt; returns the root."""
    root = tmp_path_factory.mktemp("tensorboard") / "runs"
    args = ["-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"), *TINY_BOOLEAN,
            "--data.init_args.batch_size", "16", "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(root)]
    main(["fit", *args])
    main(["test", *args, "--ckpt_path", str(root / "2parity-mask-seed0/version_0/checkpoints/last.ckpt")])
    return root


def test_a_fit_logs_to_task_init_seed_and_its_test_beside_it(fitted):
    assert [p.name for p in fitted.iterdir()] == ["2parity-mask-seed0"]
    assert sorted(p.name for p in (fitted / "2parity-mask-seed0").iterdir()) == ["version_0", "version_1"]
    assert (fitted / "2parity-mask-seed0/version_0/checkpoints/last.ckpt").is_file()


def test_hparams_hold_the_run_config_and_declare_the_final_metrics(fitted):
    fit_dir, test_dir = fitted / "2parity-mask-seed0/version_0", fitted / "2parity-mask-seed0/version_1"
    params, metrics = read_hparams(fit_dir)
    expected = {
        "task": "boolean/2parity", "init": "mask", "seed": 0, "structure": "2parity: x0<->x1",
        "backbone": "TokenTransformer", "backbone/dim": 16, "backbone/depth": 2, "backbone/num_heads": 3,
        "optimizer": "Adam", "optimizer/lr": 1e-3, "optimizer/weight_decay": 1e-3, "data/batch_size": 16,
        "lr_schedule": "cosine", "init_options/open_value": 10, "trainer/max_epochs": 2,
    }
    assert {k: params.get(k) for k in expected} == pytest.approx(expected)
    assert params["trainer/precision"] in ("32-true", "bf16-mixed")  # what the run used (bf16 where native)
    assert {"val/acc", "val/mse", "val/unseen_acc", "val/mdi_acc", "val/loss", "test/acc", "test/loss"} <= set(metrics)

    scalars = read_scalars(fit_dir)
    assert "hp_metric" not in scalars  # no -1 placeholder
    val = [m for m in metrics if m.startswith("val/")]
    assert all(math.isfinite(scalars[m][-1][1]) for m in val), {m: scalars[m][-1] for m in val}
    # only the real validations: the declaration logged no placeholder point
    assert [step for step, _ in scalars["val/acc"]] == [STEPS // 2 - 1, STEPS - 1]

    # The test run has its own session (same config) with the test metrics.
    test_params, test_metrics = read_hparams(test_dir)
    assert test_params["task"] == "boolean/2parity" and test_params["seed"] == 0 and test_metrics == metrics
    test_scalars = read_scalars(test_dir)
    assert all(math.isfinite(test_scalars[m][-1][1]) for m in metrics if m.startswith("test/"))


def test_learning_rate_follows_the_cosine_schedule(fitted):
    scalars = read_scalars(fitted / "2parity-mask-seed0/version_0")
    for group in ("network", "prior"):  # mask: the prior M is a parameter group of its own
        lr = scalars[f"train/lr/{group}"]
        assert [step for step, _ in lr] == list(range(STEPS))
        for step, value in lr:
            assert value == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * step / STEPS)), rel=1e-5), step


def test_tag_groups_have_no_per_head_series_under_persistence_and_no_duplicates(fitted):
    tags = set(read_scalars(fitted / "2parity-mask-seed0/version_0"))
    persistence = {t for t in tags if t.startswith("persistence/")}
    assert {"persistence/score", "persistence/open_mass", "persistence/prior_drift"} <= persistence
    assert all(t.count("/") == 1 for t in persistence), sorted(persistence)
    assert "persistence_heads/open_mass/layer1/head2" in tags
    assert {t for t in tags if t.startswith("extrapolation/")} == {"extrapolation/closer_to_mdi"}
    assert {"val/unseen_acc", "val/unseen_mse"} <= tags


def test_run_names_and_where_the_default_name_is_kept(tmp_path):
    model = SimpleNamespace(task=SimpleNamespace(name="arithmetic/addition"), init_method="qk_opt")
    assert run_name(model, 3) == "addition-qk_opt-seed3"
    assert run_name(model, False) == "addition-qk_opt"  # seed_everything: false
    assert run_name(SimpleNamespace(task=SimpleNamespace(name="vision/my data"), init_method="mask"), 0) == \
        "my_data-mask-seed0"
    logger = _default_logger(str(tmp_path), model, 3)
    assert logger.name == "addition-qk_opt-seed3" and logger.save_dir == str(tmp_path)
    # A study's run directory (it holds run.json) already says task/init/seed: the logs stay in lightning_logs.
    StudyRunDir(tmp_path).run_record.write_text("{}")
    assert _default_logger(str(tmp_path), model, 3).name == "lightning_logs"


def test_a_configured_logger_keeps_its_name(tiny_args, tmp_path):
    logger = ('{"class_path": "lightning.pytorch.loggers.TensorBoardLogger", '
              f'"init_args": {{"save_dir": "{tmp_path / "mine"}", "name": "exp", "default_hp_metric": false}}}}')
    main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/default.yaml"), *tiny_args,
          "--trainer.max_epochs", "1", "--trainer.logger", logger])
    (run_dir,) = (tmp_path / "mine").glob("*/version_*")
    assert run_dir.parent.name == "exp"
    params, metrics = read_hparams(run_dir)
    assert params["init"] == "default" and "val/acc" in metrics

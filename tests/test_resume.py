"""Exact resume, signals and divergence: a run stopped anywhere and resumed equals the uninterrupted run.

Each case trains a tiny model three ways: uninterrupted; stopped by a signal (or a crash) at a chosen step;
resumed with ``--ckpt_path last``. Every scalar the runs logged must be equal, bit for bit, and the
resumed run must log into the interrupted run's own directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, ROOT, TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.run import status as run_status
from lightning_maskprior.run.tensorboard import read_scalars

TESTS = Path(__file__).resolve().parent
COMMON = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
          "--trainer.log_every_n_steps", "1"]

BOOLEAN = ["-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
           *TINY_BOOLEAN, "--data.init_args.batch_size", "16",  # 3 batches per epoch
           "--trainer.max_epochs", "3", "--trainer.check_val_every_n_epoch", "1", *COMMON]
ARITHMETIC = ["-c", str(CONFIGS / "arithmetic/addition.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
              "--data.init_args.num_digits", "2", "--data.init_args.train_fraction", "0.05",
              "--data.init_args.val_size", "200", "--data.init_args.eval_batch_size", "200",
              "--data.init_args.batch_size", "32", "--model.backbone.init_args.dim", "16",
              "--model.backbone.init_args.depth", "1", "--model.backbone.init_args.head_dim", "8",
              "--model.backbone.init_args.mlp_dim", "32", "--model.warmup_steps", "0",
              "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1", *COMMON]
VISION = ["-c", str(CONFIGS / "vision/digits.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
          "--data.init_args.max_train_size", "32", "--data.init_args.test_size", "16",
          "--data.init_args.img_size", "16", "--data.init_args.batch_size", "8",  # augmented: random crops
          "--model.backbone.init_args.model_kwargs",
          '{"embed_dim": 24, "depth": 2, "num_heads": 3, "drop_path_rate": 0.2}',  # stochastic depth draws RNG
          "--model.warmup_steps", "2", "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1", *COMMON]


def language(tmp_path: Path) -> list[str]:
    return ["-c", str(CONFIGS / "language/pydoc.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
            "--data.init_args.block_size", "16", "--data.init_args.vocab_size", "300",
            "--data.init_args.batch_size", "8", "--data.init_args.cache_dir", str(tmp_path / "cache"),
            "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "1",
            "--model.backbone.init_args.num_heads", "2", "--trainer.max_steps", "8",
            "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2", *COMMON]


def _fit(args: list[str], root: Path, *extra: str) -> int:
    try:
        main(["fit", *args, "--trainer.default_root_dir", str(root), *extra])
    except SystemExit as exit_info:
        return exit_info.code if isinstance(exit_info.code, int) else 1
    return 0


def _signal_at(step: int, signum: int = signal.SIGTERM) -> list[str]:
    return ["--trainer.callbacks+=resume_helpers.SignalAt", "--trainer.callbacks.step", str(step),
            "--trainer.callbacks.signum", str(signum)]


def assert_same_scalars(full: Path, resumed: Path) -> None:
    a, b = read_scalars(full), read_scalars(resumed)
    assert set(a) == set(b)
    different = {tag: (a[tag], b[tag]) for tag in a if a[tag] != b[tag]}
    assert not different, f"{len(different)} of {len(a)} tags differ, e.g. {next(iter(different.items()))}"


def check_resume(tmp_path: Path, args: list[str], stop: list[str], expected_rc: int) -> None:
    assert _fit(args, tmp_path / "full") == 0
    assert _fit(args, tmp_path / "resumed", *stop) == expected_rc
    (last,) = (tmp_path / "resumed").glob("*/version_0/checkpoints/last.ckpt")  # <task>-<init>-seed<seed>/
    assert _fit(args, tmp_path / "resumed", "--ckpt_path", "last") == 0
    # One run directory: the resumed run continued version_0 instead of starting version_1.
    assert [p.name for p in (tmp_path / "resumed").iterdir()] == [last.parents[2].name]
    assert [p.name for p in last.parents[2].iterdir()] == ["version_0"]
    assert_same_scalars(tmp_path / "full", tmp_path / "resumed")
    # last.ckpt holds the end of training, as the uninterrupted run's does (what test and load_run read), and
    # is the only "last": a signal's last.ckpt saved outside the ModelCheckpoint once made it save last-v1.ckpt
    (full,) = (tmp_path / "full").glob("*/version_0/checkpoints/last.ckpt")
    steps = [torch.load(p, map_location="cpu", weights_only=False)["global_step"] for p in (full, last)]
    assert steps[0] == steps[1], f"last.ckpt of the resumed run is at step {steps[1]}, the run ended at {steps[0]}"
    assert sorted(p.name for p in last.parent.glob("last*")) == ["last.ckpt"]


@pytest.fixture(autouse=True)
def _helpers_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # resume_helpers, by class path from the CLI


@pytest.mark.parametrize("step,signum", [
    (4, signal.SIGTERM),  # mid-epoch (epoch 1, batch 1)
    (5, signal.SIGINT),  # last batch of epoch 1: saved at the epoch's end, after its validation
    (0, signal.SIGTERM),  # the first step
], ids=["mid-epoch-sigterm", "epoch-boundary-sigint", "first-step"])
def test_boolean_resume_is_exact(tmp_path, step, signum):
    check_resume(tmp_path, BOOLEAN, _signal_at(step, signum), 128 + signum)


def test_a_resumed_run_ends_in_last_ckpt_even_from_a_checkpoint_that_does_not_claim_it(tmp_path):
    """A signal's last.ckpt whose ModelCheckpoint state names no "last" (the signal handler saves outside the
    ModelCheckpoint): the resumed run still ends in last.ckpt, not in a last-v1.ckpt beside a stale last.ckpt."""
    assert _fit(BOOLEAN, tmp_path, *_signal_at(0)) == 128 + signal.SIGTERM
    (last,) = tmp_path.glob("*/version_0/checkpoints/last.ckpt")
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    for key, state in checkpoint["callbacks"].items():
        if key.startswith("ModelCheckpoint"):
            state["last_model_path"] = ""
    torch.save(checkpoint, last)
    assert _fit(BOOLEAN, tmp_path, "--ckpt_path", "last") == 0
    assert sorted(p.name for p in last.parent.glob("last*")) == ["last.ckpt"]
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 9  # 3 epochs x 3 batches


def test_crash_without_checkpoint_resumes_from_last_and_hides_the_lost_steps(tmp_path):
    # Killed (no signal handler runs) after the epoch-1 checkpoint: the steps logged since then are
    # logged again by the resumed run; TensorBoard's purge_step hides the killed run's copies.
    args = BOOLEAN
    assert _fit(args, tmp_path / "full") == 0
    with pytest.raises(RuntimeError, match="crash at step 8"):
        main(["fit", *args, "--trainer.default_root_dir", str(tmp_path / "resumed"),
              "--trainer.callbacks+=resume_helpers.CrashAt", "--trainer.callbacks.step", "8"])
    assert _fit(args, tmp_path / "resumed", "--ckpt_path", "last") == 0
    assert len(list((tmp_path / "resumed").rglob("events.out.tfevents.*"))) == 2
    assert_same_scalars(tmp_path / "full", tmp_path / "resumed")


def test_arithmetic_resume_is_exact(tmp_path):
    check_resume(tmp_path, ARITHMETIC, _signal_at(3), run_status.EXIT_SIGTERM)


def test_vision_resume_with_augmentation_and_stochastic_depth_is_exact(tmp_path):
    check_resume(tmp_path, VISION, _signal_at(5), run_status.EXIT_SIGTERM)


def test_language_resume_mid_epoch_with_validation_inside_the_epoch_is_exact(tmp_path):
    check_resume(tmp_path, language(tmp_path), _signal_at(4), run_status.EXIT_SIGTERM)


def test_ckpt_path_last_without_a_checkpoint_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", *BOOLEAN, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", "last"])
    assert info.value.code == 2 and "no last.ckpt under" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ divergence
def test_divergence_stops_the_run_with_exit_code_3_and_names_step_and_loss(tmp_path, capsys):
    rc = _fit(BOOLEAN, tmp_path, "--model.optimizer.init_args.lr", "1e12")
    err = capsys.readouterr().err
    assert rc == run_status.EXIT_DIVERGED, err[-2000:]
    assert "diverged: the training loss is" in err and "at step" in err
    assert run_status.status_from_returncode(rc) == "diverged"
    assert not list(tmp_path.rglob("last.ckpt")) or all(  # nothing saved from the diverged step
        torch.isfinite(t).all() for ckpt in tmp_path.rglob("last.ckpt")
        for t in torch.load(ckpt, weights_only=True)["state_dict"].values())


def test_nan_predictions_never_count_as_correct():
    from lightning_maskprior.objectives import ClassificationObjective, DigitsObjective, RegressionObjective

    regression = RegressionObjective(label_values=[-1.0, 1.0])
    metrics = regression.make_metrics()
    batch = {"target": torch.tensor([1.0, -1.0, 1.0, -1.0]), "unseen": torch.tensor([True, True, False, False]),
             "mdi": torch.tensor([1.0, -1.0, 1.0, -1.0])}
    regression.update_metrics(metrics, torch.full((4, 1), float("nan")), batch)
    values = metrics.compute()
    assert values["acc"] == 0 and values["unseen_acc"] == 0 and values["mdi_acc"] == 1
    assert torch.isnan(values["mse"])

    digits = DigitsObjective(num_digits=2)
    metrics = digits.make_metrics()
    target = torch.zeros(3, 2, dtype=torch.long)  # argmax of an all-NaN row is 0: would look right
    digits.update_metrics(metrics, torch.full((3, 2 * 10), float("nan")), {"digits": target})
    assert metrics.compute()["seq_acc"] == 0 and metrics.compute()["digit_acc"] == 0

    classes = ClassificationObjective(num_classes=10)
    metrics = classes.make_metrics()
    logits = torch.randn(4, 10)
    logits[0] = float("nan")
    target = logits.argmax(dim=-1)
    target[0] = 0
    classes.update_metrics(metrics, logits, {"target": target})
    values = metrics.compute()
    assert values["top1"] == pytest.approx(0.75) and values["top5"] == pytest.approx(0.75)


# ------------------------------------------------------------------------------------- two processes
def _cli(args: list[str], root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "fit", *args,
                           "--trainer.default_root_dir", str(root)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("step", [2, 3], ids=["mid-epoch", "epoch-boundary"])
def test_ddp_resume_is_exact_and_sigterm_exits_143(tmp_path, step):
    # 2 processes: 2 batches per rank and epoch. The signal reaches rank 1 only; both ranks stop together.
    args = [*BOOLEAN, "-c", str(CONFIGS / "trainer/ddp.yaml"), "--trainer.max_epochs", "3"]
    full = _cli(args, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = _cli([*args, *_signal_at(step), "--trainer.callbacks.rank", "1"], tmp_path / "resumed")
    assert stopped.returncode == run_status.EXIT_SIGTERM, stopped.stderr[-3000:]
    assert "received SIGTERM" in stopped.stdout
    resumed = _cli([*args, "--ckpt_path", "last"], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_scalars(tmp_path / "full", tmp_path / "resumed")


# ------------------------------------------------------------------------------ resuming with changed options
def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_changed_learning_rate_takes_effect_on_resume_and_is_recorded(tmp_path):
    """The config's lr replaces the one the checkpoint's optimizer state restored, at the resumed step, and the
    change is recorded (changes.yaml, the console); another optimizer class is refused, naming both."""
    import yaml

    assert _fit([*BOOLEAN, "--trainer.max_epochs", "1"], tmp_path) == 0  # 3 steps at lr 0.001 (cosine)
    (run,) = tmp_path.glob("*/version_0")
    before = _files(tmp_path)
    other = _cli([*BOOLEAN, "--ckpt_path", "last", "--model.optimizer", "torch.optim.SGD",
                  "--model.optimizer.init_args.lr", "0.1"], tmp_path)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "was trained with model.optimizer torch.optim.Adam, the config asks for torch.optim.SGD" in other.stderr
    assert _files(tmp_path) == before
    resumed = _cli([*BOOLEAN, "--trainer.max_epochs", "2", "--ckpt_path", "last",
                    "--model.optimizer.init_args.lr", "0.05"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 3 with options changed from the run's record: model.optimizer.init_args.lr 0.001 -> " \
           "0.05, trainer.max_epochs 1 -> 2" in resumed.stdout + resumed.stderr
    assert yaml.safe_load((run / "changes.yaml").read_text()) == [
        {"step": 3, "changed": {"model.optimizer.init_args.lr": {"old": 0.001, "new": 0.05},
                                "trainer.max_epochs": {"old": 1, "new": 2}}}]
    lrs = dict(read_scalars(run)["train/lr/network"])
    # Step 3 is still at the first fit's schedule end (its cosine reached 0 there); then 0.05 on the longer schedule.
    assert max(v for s, v in lrs.items() if s < 3) < 0.0011 < 0.003 < min(v for s, v in lrs.items() if s >= 4)


def test_ckpt_path_last_resumes_the_run_of_this_config_not_the_newest(tmp_path):
    """With runs of several seeds and tasks under one root, ``--ckpt_path last`` resumes the run of this task, init
    and seed, and leaves the others' files alone; with none of them it is refused, naming the newest."""
    majority = [str(CONFIGS / "boolean/majority3.yaml") if a.endswith("2parity.yaml") else a for a in BOOLEAN]
    one = ["--trainer.max_epochs", "1"]
    assert _fit([*BOOLEAN, *one, "--seed_everything", "0"], tmp_path) == 0
    assert _fit([*majority, *one, "--seed_everything", "0"], tmp_path) == 0
    assert _fit([*BOOLEAN, *one, "--seed_everything", "1"], tmp_path) == 0  # the newest run
    others = {**_files(tmp_path / "2parity-mask-seed1"), **_files(tmp_path / "majority3-mask-seed0")}
    resumed = _cli([*BOOLEAN, "--trainer.max_epochs", "2", "--seed_everything", "0", "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from " + str(tmp_path / "2parity-mask-seed0/version_0/checkpoints/last.ckpt") in resumed.stdout
    assert {**_files(tmp_path / "2parity-mask-seed1"), **_files(tmp_path / "majority3-mask-seed0")} == others
    last = torch.load(tmp_path / "2parity-mask-seed0/version_0/checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == 6
    before = _files(tmp_path)
    none = _cli([*BOOLEAN, "--seed_everything", "7", "--ckpt_path", "last"], tmp_path)
    assert none.returncode == 2 and "Traceback" not in none.stderr, none.stderr[-3000:]
    assert "--ckpt_path last: none of the 3 run(s) under" in none.stderr and "seed_everything" in none.stderr
    assert _files(tmp_path) == before


def test_after_a_fallback_resume_the_next_last_ckpt_replaces_the_cut_short_one(tmp_path):
    """``--ckpt_path last`` falls back to the epoch checkpoint beside a cut-short last.ckpt; the resumed fit's next
    save is last.ckpt itself (not last-v1.ckpt beside the broken one), so load_run reopens the run."""
    from lightning_maskprior import load_run

    # One epoch: its epoch checkpoint was saved before the first last.ckpt, so it names no "last" of its own.
    assert _fit([*BOOLEAN, "--trainer.max_epochs", "1"], tmp_path) == 0
    (run,) = tmp_path.glob("*/version_0")
    last = run / "checkpoints/last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    resumed = _cli([*BOOLEAN, "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "is not a complete checkpoint (truncated?); using the newest intact one" in resumed.stdout
    assert sorted(p.name for p in last.parent.glob("last*")) == ["last.ckpt"]
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 9
    module, _ = load_run(run)
    assert module is not None


def test_evaluating_a_run_a_resume_changed_names_what_differs(tmp_path, capsys):
    """A resume that changed how the run is evaluated (here val_size) is in changes.yaml, not config.yaml:
    ``validate -c RUN/config.yaml`` says so in one line, with the option that measures the run as it ended; with
    that option given, or for a run never changed, it says nothing."""
    assert _fit([*ARITHMETIC, "--trainer.max_epochs", "1"], tmp_path) == 0
    assert _fit([*ARITHMETIC, "--trainer.max_epochs", "2", "--data.init_args.val_size", "100",
                 "--ckpt_path", "last"], tmp_path) == 0
    (run,) = tmp_path.glob("*/version_0")
    evaluate = ["validate", "-c", str(run / "config.yaml"), "--ckpt_path", str(run / "checkpoints/last.ckpt"),
                "--trainer.default_root_dir", str(tmp_path / "eval")]
    capsys.readouterr()
    main(evaluate)
    out = capsys.readouterr()
    assert ("maskprior: validate with data.init_args.val_size 200 (the run ended with 100): a resume of run "
            f"{run} changed them (changes.yaml); add --data.init_args.val_size 100") in out.out + out.err
    main([*evaluate, "--data.init_args.val_size", "100"])
    out = capsys.readouterr()
    assert "changes.yaml" not in out.out + out.err

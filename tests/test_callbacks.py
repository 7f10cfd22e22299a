"""Callbacks: persistence of the prior, extrapolation on the unseen slice, attention images.

Tiny CLI runs (seconds); DDP through a subprocess; the mask vs qk_opt comparison is slow-marked.
"""

import subprocess
import sys

import pytest
import torch
import yaml

from conftest import CONFIGS, ROOT
from lightning_maskprior.callbacks import AttentionMaps, ExtrapolationMonitor, PriorPersistence
from lightning_maskprior.callbacks.persistence import bilinear_drift, pearson
from lightning_maskprior.cli import main
from lightning_maskprior.objectives import RegressionObjective
from lightning_maskprior.run.tensorboard import read_hparams, read_scalars

PERSISTENCE = "lightning_maskprior.callbacks.PriorPersistence"


def callbacks_arg(every: int = 1, maps_every: int = 2, checkpoint: bool = False) -> list[str]:
    callbacks = [
        {"class_path": PERSISTENCE, "init_args": {"every_n_steps": every, "probe_size": 32}},
        {"class_path": "lightning_maskprior.callbacks.ExtrapolationMonitor"},
        {"class_path": "lightning_maskprior.callbacks.AttentionMaps", "init_args": {"every_n_steps": maps_every}},
    ]
    if checkpoint:
        callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                          "init_args": {"save_top_k": -1}})
    return ["--trainer.callbacks", yaml.safe_dump(callbacks, default_flow_style=True, width=10_000).strip()]


def fit(init: str, tiny_args, *extra: str) -> None:
    main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / f"init/{init}.yaml"),
          *tiny_args, *extra])


def steps(series) -> list[int]:
    return [s for s, _ in series]


# --------------------------------------------------------------------------------- pieces
def test_pearson_and_bilinear_drift_match_explicit_formulas():
    a, b = torch.randn(3, 20), torch.randn(3, 20)
    expected = torch.stack([torch.corrcoef(torch.stack([x, y]))[0, 1] for x, y in zip(a, b, strict=True)])
    torch.testing.assert_close(pearson(a, b).float(), expected, atol=1e-5, rtol=1e-5)
    assert pearson(torch.ones(1, 5), torch.randn(1, 5)).item() == 0  # constant row: 0, not NaN
    wq, wk, wq0, wk0 = (torch.randn(2, 4, 8) for _ in range(4))
    explicit = (wq.mT @ wk - wq0.mT @ wk0).flatten(1).norm(dim=1) / (wq0.mT @ wk0).flatten(1).norm(dim=1)
    torch.testing.assert_close(bilinear_drift(wq, wk, wq0, wk0).float(), explicit, atol=1e-5, rtol=1e-4)
    assert bilinear_drift(wq0, wk0, wq0, wk0).abs().max() < 1e-6


def test_extrapolation_counts_points_closer_to_the_mdi():
    class Module(torch.nn.Module):
        device = torch.device("cpu")

    class Trainer:
        sanity_checking, world_size, global_step = False, 1, 7

    monitor, module, logged = ExtrapolationMonitor(), Module(), {}
    module.objective = RegressionObjective([-1.0, 1.0])  # accuracy of the sign
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)
    batch = {"target": torch.tensor([1.0, 1.0, -1.0, 1.0]), "mdi": torch.tensor([-3.0, -3.0, -1.0, 1.0]),
             "unseen": torch.tensor([True, True, False, True]), "inputs": torch.zeros(4, 2)}
    monitor.on_validation_epoch_start(Trainer(), module)
    # unseen: pred -2.5 (closer to the MDI -3, wrong), 0.5 (closer to truth, right), 1 (MDI = truth: ties)
    monitor.on_validation_batch_end(Trainer(), module, torch.tensor([[-2.5], [0.5], [5.0], [1.0]]), batch, 0)
    monitor.on_validation_epoch_end(Trainer(), module)
    assert logged["extrapolation/closer_to_mdi"] == pytest.approx(1 / 3)
    assert logged["extrapolation/unseen_acc"] == pytest.approx(2 / 3)  # sign: -2.5 wrong, 0.5 and 1 right
    assert logged["extrapolation/unseen_mse"] == pytest.approx((3.5**2 + 0.5**2) / 3)
    assert monitor.history == [(7, logged_values(logged))]

    # A module that logs val/unseen_acc and val/unseen_mse itself: no second copy under extrapolation/.
    module.metric_tags = lambda: ["val/acc", "val/unseen_acc", "val/unseen_mse", "test/unseen_acc"]
    logged.clear()
    monitor.on_validation_epoch_start(Trainer(), module)
    monitor.on_validation_batch_end(Trainer(), module, torch.tensor([[-2.5], [0.5], [5.0], [1.0]]), batch, 0)
    monitor.on_validation_epoch_end(Trainer(), module)
    assert list(logged) == ["extrapolation/closer_to_mdi"]
    assert set(monitor.history[-1][1]) == {"unseen_acc", "unseen_mse", "closer_to_mdi"}  # history keeps all


def logged_values(logged: dict) -> dict:
    return {k.split("/")[1]: v for k, v in logged.items()}


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        PriorPersistence(every_n_steps=0)
    with pytest.raises(ValueError, match="probe_split must be 'train' or 'val', got 'test'"):
        PriorPersistence(probe_split="test")
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        AttentionMaps(every_n_steps=0)


# ------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("init", ["default", "mask"])
def test_every_init_logs_the_same_persistence_series(tiny_args, tmp_path, init):
    fit(init, tiny_args, "--data.init_args.batch_size", "16", *callbacks_arg(every=1))
    run = next((tmp_path / "runs").glob("*/version_*"))
    scalars = read_scalars(run)
    total = 2 * 3  # 48 seen points of the 6-bit cube, batch 16, 2 epochs
    assert steps(scalars["persistence/score"]) == list(range(total + 1))
    assert scalars["persistence/score"][0][1] == pytest.approx(1.0)
    for l in range(2):
        for h in range(3):
            for name in ("open_mass", "open_mass_rel", "attn_corr", "attn_corr_rel", "qk_drift"):
                assert len(scalars[f"persistence_heads/{name}/layer{l}/head{h}"]) == total + 1, name
            # gradients: from the update that produced each step, so none at step 0
            assert steps(scalars[f"persistence_heads/grad_q/layer{l}/head{h}"]) == list(range(1, total + 1))
        assert scalars[f"persistence_heads/qk_drift/layer{l}/head0"][0][1] == pytest.approx(0.0, abs=1e-6)
    # persistence/ holds only the summaries (one level: persistence/<metric>); the per-head series have their group
    assert all(tag.count("/") == 1 for tag in scalars if tag.startswith("persistence/"))
    assert {"persistence/score", "persistence/open_mass", "persistence/grad_q"} <= set(scalars)
    has_prior = init == "mask"
    assert ("persistence_heads/prior_corr/layer0/head0" in scalars) == has_prior
    assert ("persistence_heads/grad_prior/layer0/head0" in scalars) == has_prior
    open_mass = scalars["persistence/open_mass"][0][1]
    if has_prior:  # +10/-10 on x0<->x1 and the diagonal: nearly all mass on open entries at step 0
        assert open_mass > 0.99
        assert scalars["persistence_heads/prior_corr/layer0/head0"][0][1] == pytest.approx(1.0)
        assert steps(scalars["persistence/prior_drift"]) == list(range(total + 1))
    else:  # plain attention: about uniform, 8 open of 36 entries
        assert 0.1 < open_mass < 0.4
    assert len(scalars["extrapolation/closer_to_mdi"]) == 2
    # The module logs the unseen slice's accuracy and MSE (val/unseen_*): the monitor adds no copy of them.
    assert sorted(t for t in scalars if t.startswith("extrapolation/")) == ["extrapolation/closer_to_mdi"]
    assert len(scalars["val/unseen_acc"]) == len(scalars["val/unseen_mse"]) == 2
    images = image_steps(run)
    assert images["attention_maps/attention/layer1"] == [0, 2, 4, 6]
    assert ("attention_maps/prior/layer0" in images) == has_prior


def session_starts(path) -> int:
    """How many HPARAMS sessions an event file starts."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return sum(v.tag == "_hparams_/session_start_info" for e in EventFileLoader(str(path)).Load()
               for v in e.summary.value)


def image_steps(run) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for path in sorted(run.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance={"images": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["images"]:
            out.setdefault(tag, []).extend(e.step for e in accumulator.Images(tag))
    return out


def test_resume_continues_the_curves(tiny_args, tmp_path):
    """Fit 2 epochs (checkpoint each), resume from the first to 3: same run directory, no step missing."""
    runs = tmp_path / "runs"
    common = ["--data.init_args.batch_size", "16", *callbacks_arg(every=1, checkpoint=True)]
    fit("mask", tiny_args, *common)
    first = runs / "2parity-mask-seed0/version_0"
    ckpt = first / "checkpoints/epoch=0-step=3.ckpt"
    assert ckpt.is_file(), sorted(p.name for p in (first / "checkpoints").iterdir())
    fit("mask", tiny_args, *common, "--trainer.max_epochs", "3", "--ckpt_path", str(ckpt))
    assert sorted(p.name for p in (runs / "2parity-mask-seed0").iterdir()) == ["version_0"]  # continued, not new
    events = sorted(first.glob("events.out.tfevents.*"))
    assert len(events) == 2
    after = read_scalars(first)  # both event files; TensorBoard's purge_step hides the first run's steps > 3
    only_resumed = {}
    for path in events[1:]:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        only_resumed = {t: [e.step for e in accumulator.Scalars(t)] for t in accumulator.Tags()["scalars"]}
    for tag in ("persistence/score", "persistence_heads/open_mass/layer1/head2",
                "persistence_heads/grad_prior/layer0/head0"):
        assert only_resumed[tag] == list(range(4, 10)), tag  # the resumed process continues after step 3
        combined = steps(after[tag])
        assert combined == list(range(combined[0], 10)) and combined[0] <= 1, tag  # gradients start at step 1
    # relative values stay relative to the first run's step 0
    ref = after["persistence_heads/open_mass/layer1/head2"][0][1]
    mass = dict(after["persistence_heads/open_mass/layer1/head2"])
    for step, rel in after["persistence_heads/open_mass_rel/layer1/head2"]:
        assert rel == pytest.approx(mass[step] / ref, rel=1e-5)
    assert image_steps(first)["attention_maps/attention/layer0"][-3:] == [4, 6, 8]
    state = torch.load(first / "checkpoints/epoch=2-step=9.ckpt", weights_only=False)
    persistence = next(v for k, v in state["callbacks"].items() if k.startswith("PriorPersistence"))
    assert [s for s, _ in persistence["history"]] == list(range(10))
    extrapolation = next(v for k, v in state["callbacks"].items() if k.startswith("ExtrapolationMonitor"))
    assert [s for s, _ in extrapolation["history"]] == [3, 6, 9]


def test_ddp_logs_the_same_persistence_as_one_process(tmp_path):
    """Full-batch training (48 seen points: one batch, 24 per rank under DDP): same updates, same curves."""
    common = [
        "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
        "--data.init_args.n", "6", "--data.init_args.batch_size", "48", "--data.init_args.eval_batch_size", "64",
        "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "1",
        "--model.backbone.init_args.head_dim", "8", "--model.backbone.init_args.mlp_dim", "16",
        "--trainer.max_epochs", "3", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false",
        *callbacks_arg(every=1),
        "--trainer.precision", "32-true",  # bf16 rounding differs between one batch of 48 and two of 24
    ]
    # One process in this one; DDP in a subprocess (strategy="ddp" inside pytest would relaunch pytest).
    main(["fit", *common, "--trainer.default_root_dir", str(tmp_path / "single")])
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_maskprior.cli", "fit", *common, "-c", str(CONFIGS / "trainer/ddp.yaml"),
         "--trainer.default_root_dir", str(tmp_path / "ddp")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ddp_dir,) = (tmp_path / "ddp").glob("*/version_*")  # one run directory: rank zero's
    single, ddp = read_scalars(next((tmp_path / "single").glob("*/version_*"))), read_scalars(ddp_dir)
    prefixes = ("persistence/", "persistence_heads/", "extrapolation/")
    tags = sorted(t for t in single if t.startswith(prefixes))
    assert tags == sorted(t for t in ddp if t.startswith(prefixes))
    assert "persistence_heads/grad_prior/layer0/head0" in tags
    # The HPARAMS session: written once, by rank zero (one process wrote the event files), with the DDP run's config.
    events = list(ddp_dir.glob("events.out.tfevents.*"))
    assert len({path.name.rsplit(".", 2)[1] for path in events}) == 1  # events.out.tfevents.<time>.<host>.<pid>.<n>
    assert sum(session_starts(path) for path in events) == 1
    params, metrics = read_hparams(ddp_dir)
    assert params["trainer/world_size"] == 2 and params["task"] == "boolean/2parity" and "val/acc" in metrics
    for tag in tags:
        assert steps(ddp[tag]) == steps(single[tag]), tag  # each point once: rank zero logs
        for (_, a), (_, b) in zip(single[tag], ddp[tag], strict=True):
            assert b == pytest.approx(a, rel=1e-4, abs=1e-5), tag
    assert steps(single["persistence/score"]) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------- the thesis
@pytest.mark.slow
def test_mask_persists_and_qk_opt_fades_on_2parity(tmp_path):
    """the paper's thesis at CPU scale: 2parity, 6 epochs each (several minutes per run)."""
    scores = {}
    for init in ("mask", "qk_opt"):
        root = tmp_path / init
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_maskprior.cli", "fit", "-c", str(CONFIGS / "boolean/2parity.yaml"),
             "-c", str(CONFIGS / f"init/{init}.yaml"), "--trainer.enable_progress_bar", "false",
             "--trainer.default_root_dir", str(root)],
            cwd=ROOT, capture_output=True, text=True, timeout=3600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        scores[init] = read_scalars(next(root.glob("*/version_*")))["persistence/score"]
    assert min(v for _, v in scores["mask"]) >= 0.9
    assert scores["qk_opt"][-1][1] < 0.5

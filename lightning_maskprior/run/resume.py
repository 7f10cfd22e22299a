"""What a resumed fit trains with: the config's optimizer options and schedule, over those its checkpoint restored.

Lightning restores the optimizer and scheduler states of a checkpoint as they were, learning rate and weight decay
included, whatever the config now says. Here the config's options and its schedule take effect at the resumed step;
the run's record (record.py) says which of them changed there.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch.optim.lr_scheduler import LambdaLR

# Keys of a parameter group that are not the optimizer's options.
_NOT_OPTIONS = ("params", "lr", "initial_lr", "name")


class ResumedOptions(Callback):
    """On a resumed fit, the optimizer options of the config (``lr``, ``weight_decay``, ``betas``, the prior's weight
    decay, ...) replace the ones the checkpoint's optimizer state restored, and the learning rate schedule is the
    config's, at the resumed step: the rate is the config's ``lr`` times the schedule's factor there (cosine over
    the run's steps as the config now counts them, warm-up, or constant). The run's record says which options
    changed at that step (record.py). A config that changes nothing resumes exactly as the checkpoint left off."""

    def __init__(self) -> None:
        self.checkpoint_step: int | None = None

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Called before Lightning restores the loops from the checkpoint.
        self.checkpoint_step = int(checkpoint.get("global_step") or 0)
        continue_inside_epoch(checkpoint)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checkpoint_step is not None and trainer.optimizers:
            apply_config_options(trainer, pl_module)


def continue_inside_epoch(checkpoint: dict[str, Any]) -> bool:
    """A fit stopped by ``max_steps`` inside an epoch saved that epoch as processed, so Lightning would resume at the
    next one and skip the rest of it. Mark it as still in progress: the fit continues inside it, where the training
    loader stopped (its position is in the checkpoint). True if the checkpoint was such a stop."""
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs = fit_loop.get("epoch_progress") or {}
    batches = fit_loop.get("epoch_loop.batch_progress") or {}
    loaders = (fit_loop.get("state_dict") or {}).get("combined_loader") or []
    total, current = epochs.get("total") or {}, epochs.get("current") or {}
    stopped_inside = (
        batches.get("is_last_batch") is False and (batches.get("current") or {}).get("completed", 0) > 0
        and bool(loaders) and all(isinstance(s, dict) and s.get("_iterator_finished") is False for s in loaders)
        and all(p.get("started") == p.get("processed") == (p.get("completed") or 0) + 1 for p in (total, current))
    )
    if stopped_inside:
        for progress in (total, current):
            progress["processed"] -= 1
    return stopped_inside


def apply_config_options(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Set the restored optimizer's options to the config's, and its learning rates to the config's schedule at the
    current step."""
    fresh = pl_module.configure_optimizers()  # the config's optimizer (no state), built as the fit built its own
    fresh = fresh["optimizer"] if isinstance(fresh, dict) else fresh
    restored = trainer.optimizers[0]
    for group, new in zip(restored.param_groups, fresh.param_groups, strict=False):
        group.update({key: value for key, value in new.items() if key not in _NOT_OPTIONS})
        group["lr"] = new.get("initial_lr", new["lr"])
        if "initial_lr" in group or "initial_lr" in new:
            group["initial_lr"] = group["lr"]
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if isinstance(scheduler, LambdaLR):  # the module's schedule: a function of the step
            at_step(scheduler, trainer.global_step)


def at_step(scheduler: LambdaLR, step: int) -> None:
    """Put ``scheduler`` at ``step`` with its optimizer's current base rates (``initial_lr``), as if it had stepped
    there: each rate is its base times the schedule's factor at ``step``."""
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    scheduler.last_epoch = step
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in groups]

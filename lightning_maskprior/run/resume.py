"""What a resumed fit trains with: the config's optimizer options, over those its checkpoint's optimizer state holds.

Lightning restores the optimizer and scheduler states of a checkpoint as they were, learning rate and weight decay
included, whatever the config now says: a resumed fit given ``--model.optimizer.init_args.lr 0.05`` would record
0.05 in its config.yaml and train on with the old rate. Here every option of the config's optimizer that differs
from the restored one takes effect at the resumed step, and the change is recorded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_maskprior.run import atomic
from lightning_maskprior.run.rundir import RunDir

# Keys of a parameter group that are not the optimizer's options.
_NOT_OPTIONS = ("params", "lr", "initial_lr", "name")


class ResumedOptions(Callback):
    """On a resumed fit, the optimizer options of the config (``lr``, ``weight_decay``, ``betas``, the prior's weight
    decay, ...) replace the ones the checkpoint's optimizer state restored; a learning rate under a schedule keeps
    its place on the schedule (the new rate times the schedule's factor at that step). Each change is printed and
    appended to the run directory's ``changes.yaml`` with the step it took effect at. A config that changes
    nothing resumes exactly as the checkpoint left off."""

    def __init__(self) -> None:
        self.checkpoint_step: int | None = None

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.checkpoint_step = int(checkpoint.get("global_step") or 0)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checkpoint_step is None or not trainer.optimizers:
            return
        changes = apply_config_options(trainer, pl_module)
        if not changes:
            return
        step = trainer.global_step
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        shown = ", ".join(f"{option} {then!r} -> {now!r}" for option, (then, now) in changes.items())
        where = ""
        if log_dir is not None and trainer.is_global_zero:
            path = RunDir(log_dir).changes
            record(path, step, changes)
            where = f" (recorded in {path})"
        rank_zero_info(f"maskprior: resumed at step {step} with options the checkpoint did not train with: {shown}"
                       f"{where}")


def apply_config_options(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, tuple[Any, Any]]:
    """Set the restored optimizer's options to the config's where they differ; ``{option: (restored, config)}``."""
    fresh = pl_module.configure_optimizers()  # the config's optimizer (no state), built as the fit built its own
    fresh = fresh["optimizer"] if isinstance(fresh, dict) else fresh
    restored = trainer.optimizers[0]
    prior_decay = getattr(pl_module, "prior_weight_decay", None)
    changes: dict[str, tuple[Any, Any]] = {}
    for group, new in zip(restored.param_groups, fresh.param_groups, strict=False):
        for key, value in new.items():
            if key in _NOT_OPTIONS or _same(group.get(key), value):
                continue
            own = group.get("name") == "prior" and key == "weight_decay" and prior_decay is not None
            changes.setdefault("model.prior_weight_decay" if own else f"model.optimizer.init_args.{key}",
                               (_plain(group.get(key)), _plain(value)))
            group[key] = value
        then, now = group.get("initial_lr", group["lr"]), new.get("initial_lr", new["lr"])
        if not _same(then, now):
            scheduled = bool(trainer.lr_scheduler_configs) and "initial_lr" in group and then
            # Under a schedule the rate is initial_lr times the schedule's factor at this step: keep the factor.
            group["lr"] = group["lr"] * now / then if scheduled else now
            if "initial_lr" in group:
                group["initial_lr"] = now
            changes.setdefault("model.optimizer.init_args.lr", (_plain(then), _plain(now)))
    if "model.optimizer.init_args.lr" in changes:
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in restored.param_groups]
                scheduler._last_lr = [g["lr"] for g in restored.param_groups]
    return changes


def record(path: Path, step: int, changes: dict[str, tuple[Any, Any]]) -> None:
    """Append ``{step, changed: {option: {checkpoint, config}}}`` to the run's ``changes.yaml``."""
    try:
        entries = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else []
    except (OSError, yaml.YAMLError):
        entries = []
    entries = entries if isinstance(entries, list) else []
    entries.append({"step": step, "changed": {option: {"checkpoint": then, "config": now}
                                              for option, (then, now) in changes.items()}})
    atomic.write_text(path, yaml.safe_dump(entries, sort_keys=False))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:  # a tensor lr
        return value.item()
    return value


def _same(a: Any, b: Any) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b

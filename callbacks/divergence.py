"""Stop a run whose training loss is not finite, before the optimizer step, naming the step and the loss."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class Diverged(RuntimeError):
    """The training loss became NaN or infinite; the CLI exits with ``run.status.EXIT_DIVERGED`` (3)."""


class StopOnDivergence(Callback):
    """Raise :class:`Diverged` when the training loss is NaN or infinite on any rank (nothing is saved from that
    step), with what to try next in the message."""

    def __init__(self) -> None:
        self._batch_idx = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        finite = bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            raise Diverged(
                f"diverged: the training loss is {loss.detach().float().item()} at step {trainer.global_step} "
                f"(epoch {trainer.current_epoch}, batch {self._batch_idx}); nothing was saved from this step. "
                "Lower the learning rate (model.optimizer.init_args.lr), add warm-up (model.warmup_steps) or "
                "gradient clipping (trainer.gradient_clip_val)."
            )

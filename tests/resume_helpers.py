"""Test helpers for stopping a run at an exact step (imported by class path from the CLI in tests)."""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.callbacks import Callback


class SignalAt(Callback):
    """Send ``signum`` to this process during training batch ``step`` (0-based global step), as a scheduler would.

    Args:
        step: The global step at which the signal arrives (inside that batch, before its end).
        signum: The signal number (15 = SIGTERM, 2 = SIGINT).
        rank: Only this rank signals itself (-1: every rank).
    """

    def __init__(self, step: int, signum: int = 15, rank: int = 0) -> None:
        self.step, self.signum, self.rank = step, signum, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (-1, trainer.global_rank):
            os.kill(os.getpid(), self.signum)

    def state_dict(self) -> dict:
        return {}


class CrashAt(Callback):
    """Raise (as a SIGKILL would end the run: no checkpoint) at the start of global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


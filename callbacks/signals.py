"""Stop on SIGTERM / SIGINT with a resumable ``last.ckpt``.

SIGTERM and SIGINT (a scheduler's preemption, Ctrl+C) set a flag; at the end of the current training batch every
rank agrees to stop, ``last.ckpt`` is saved and the process exits with 128 + the signal (143, 130), so a script or
scheduler can tell the run did not finish and resume it (``--ckpt_path last``). A second Ctrl+C stops at once.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_maskprior.run.rundir import Checkpoint, RunDir


class Interrupted(SystemExit):
    """A signal stopped training after ``last.ckpt`` was saved; exits with 128 + the signal."""

    def __init__(self, signum: int, checkpoint: Path | None) -> None:
        super().__init__(128 + signum)
        self.signum, self.checkpoint = signum, checkpoint


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where ``last.ckpt`` goes: the ModelCheckpoint's directory, else ``<log_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath) / RunDir.LAST
    return RunDir(trainer.log_dir or trainer.default_root_dir).last_checkpoint


class StopOnSignal(Callback):
    """Stop gracefully on ``signals``: save ``last.ckpt`` at the end of the current batch, then exit 128 + signal.

    Args:
        signals: The signals that stop training gracefully.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._saved: Interrupted | None = None  # raised at the next hook after the checkpoint is saved

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: stop now, without a checkpoint
        self.received = signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Installed here, after Lightning's own SIGTERM handler (which would stop mid-validation and exit 0).
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        # Saved here, as ModelCheckpoint saves mid-epoch: Lightning resumes with the next batch. At the
        # epoch's last batch, wait for the epoch's end instead: a checkpoint from the last batch's end
        # resumes past the epoch's validation, which would then be missing from the curves.
        if batch_idx + 1 < trainer.num_training_batches:
            self._save_if_signalled(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_if_signalled(trainer, pl_module)

    # The exit waits for the next hook, so what Lightning logs after the save point (the batch's
    # metrics) is written as in the uninterrupted run; the resumed run continues after it.
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._exit_if_saved()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exit_if_saved()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exit_if_saved()

    def _exit_if_saved(self) -> None:
        if self._saved is not None:
            raise self._saved

    def _save_if_signalled(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:  # every rank stops at the same point (a signal may reach only one)
            signum = torch.tensor([self.received or 0], device=pl_module.device)
            signum = trainer.strategy.reduce(signum, reduce_op="max")
            stop, self.received = bool(signum.item()), int(signum.item()) or None
        if not stop or self._saved is not None:
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            print(f"\nreceived {signal.Signals(self.received).name} at step {trainer.global_step}: saved {path}; "
                  f"resume with --ckpt_path {path}", flush=True)
        self._saved = Interrupted(self.received, path)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class FinalCheckpoint(Callback):
    """Save ``last.ckpt`` when training ends, unless the checkpoint callback already saved that very step.

    A ModelCheckpoint that saves every n epochs (the arithmetic paper configs: every 5th, with the validation)
    leaves ``last.ckpt`` at the last multiple of n when ``max_epochs`` is not one, or when ``max_steps`` stops
    training mid-epoch; what tests and reopens the run would then see older weights than training ended with.
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Resumed from last.ckpt: it is the ModelCheckpoint's own "last", whoever saved it. A last.ckpt that
        # StopOnSignal or on_train_end saved is a stranger to the ModelCheckpoint's restored state, which would then
        # save the run's next "last" as last-v1.ckpt and leave last.ckpt (what test, predict and load_run read) at
        # the interrupted step.
        # Resumed from another checkpoint beside a cut-short last.ckpt (--ckpt_path last's fallback): the next save
        # replaces that last.ckpt too, instead of leaving it, unreadable, where load_run and test look.
        callback, last = trainer.checkpoint_callback, last_checkpoint_path(trainer)
        resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path else None
        cut_short = last.is_file() and not Checkpoint(last).is_intact()
        if (isinstance(callback, ModelCheckpoint) and callback.save_last and resumed is not None
                and (resumed == last.resolve() or (cut_short and resumed.parent == last.parent.resolve()))):
            callback.last_model_path = str(last)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        callback = trainer.checkpoint_callback
        if not isinstance(callback, ModelCheckpoint) or not callback.save_last:
            return
        step = getattr(callback, "_last_global_step_saved", None)  # Lightning's record of its latest save
        if step == trainer.global_step:
            return  # this step is saved
        if step is not None and not getattr(callback, "_last_checkpoint_saved", ""):
            return  # nothing saved yet: ModelCheckpoint's own on_train_end saves last.ckpt
        trainer.save_checkpoint(last_checkpoint_path(trainer))

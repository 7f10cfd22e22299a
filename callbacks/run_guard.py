"""What makes a run stoppable and exactly resumable: signals, the RNG state, divergence.

``RunGuard`` is a callback the ``maskprior`` CLI adds to every fit:

- SIGTERM and SIGINT (a scheduler's preemption, Ctrl+C) set a flag; at the end of the current training
  batch every rank agrees to stop, ``last.ckpt`` is saved and the process exits with 128 + the signal
  (143, 130), so a script or scheduler can tell the run did not finish and resume it.
- The RNG states (torch, numpy, Python; CUDA where present) of every rank go into each checkpoint and
  are restored when training resumes, so dropout and augmentation draw what the uninterrupted run drew.
- A non-finite training loss stops the run before the optimizer step, with the step and the loss in
  the message; the CLI exits with ``run_status.EXIT_DIVERGED`` (3).

The loader's position is Lightning's part: ``data.train_loader`` is a torchdata StatefulDataLoader
whose sampler is seeded per epoch, and Lightning saves its state in the checkpoint.
"""

from __future__ import annotations

import random
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_maskprior.run.rundir import RunDir


class Diverged(RuntimeError):
    """The training loss became NaN or infinite."""


class Interrupted(SystemExit):
    """A signal stopped training after ``last.ckpt`` was saved; exits with 128 + the signal."""

    def __init__(self, signum: int, checkpoint: Path | None) -> None:
        super().__init__(128 + signum)
        self.signum, self.checkpoint = signum, checkpoint


def rng_states() -> dict[str, Any]:
    """Every RNG's state, as tensors and plain Python values (so checkpoints load with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached": float(cached)}
    states = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where ``last.ckpt`` goes: the ModelCheckpoint's directory, else ``<log_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath) / RunDir.LAST
    return RunDir(trainer.log_dir or trainer.default_root_dir).last_checkpoint


class RunGuard(Callback):
    """Stop on SIGTERM/SIGINT with a resumable ``last.ckpt``; keep RNG states in checkpoints; fail on divergence.

    Args:
        signals: The signals that stop training gracefully.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._rng_to_restore: list[dict[str, Any]] | None = None
        self._saved: Interrupted | None = None  # raised at the next hook after the checkpoint is saved

    # ------------------------------------------------------------------------------------- signals
    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: stop now, without a checkpoint
        self.received = signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Installed here, after Lightning's own SIGTERM handler (which would stop mid-validation and exit 0).
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        if self._rng_to_restore is not None:
            states = self._rng_to_restore
            set_rng_states(states[trainer.global_rank] if trainer.global_rank < len(states) else states[0])
            self._rng_to_restore = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        # Saved here, as ModelCheckpoint saves mid-epoch: Lightning resumes with the next batch. At the
        # epoch's last batch, wait for the epoch's end instead: a checkpoint from the last batch's end
        # resumes past the epoch's validation, which would then be missing from the curves.
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
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

    # ----------------------------------------------------------------------------------- divergence
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        finite = bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            raise Diverged(
                f"diverged: the training loss is {loss.detach().float().item()} at step {trainer.global_step} "
                f"(epoch {trainer.current_epoch}, batch {trainer.fit_loop.epoch_loop.batch_idx}); nothing was "
                "saved from this step. Lower the learning rate (model.optimizer.init_args.lr), add warm-up "
                "(model.warmup_steps) or gradient clipping (trainer.gradient_clip_val)."
            )

    # ------------------------------------------------------------------------------------ RNG states
    def state_dict(self) -> dict[str, Any]:
        states = rng_states()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, states)  # every rank saves a checkpoint together
            return {"rng_states": gathered}
        return {"rng_states": [states]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied at train start, after everything that runs between restoring and the first batch.
        self._rng_to_restore = state_dict.get("rng_states")


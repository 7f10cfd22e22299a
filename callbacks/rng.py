"""Keep every rank's RNG states in checkpoints, so a resumed run draws what the uninterrupted run drew.

The states of torch, numpy and Python (and CUDA where present) go into each checkpoint and are restored when
training resumes, so dropout and augmentation continue exactly. The loader's position is Lightning's part:
``datamodules.loaders.train_loader`` is a torchdata StatefulDataLoader whose sampler is seeded per epoch, and
Lightning saves its state in the checkpoint.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


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


class RNGStates(Callback):
    """Save every rank's RNG states in each checkpoint; restore them when training resumes."""

    def __init__(self) -> None:
        self._to_restore: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        states = rng_states()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, states)  # every rank saves a checkpoint together
            return {"rng_states": gathered}
        return {"rng_states": [states]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied at train start, after everything that runs between restoring and the first batch.
        self._to_restore = state_dict.get("rng_states")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._to_restore is not None:
            states = self._to_restore
            set_rng_states(states[trainer.global_rank] if trainer.global_rank < len(states) else states[0])
            self._to_restore = None

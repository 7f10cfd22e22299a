"""What the callbacks share: a fixed probe batch, the reference structure, and logging at a given step.

The probe batch is drawn from a dataset of the datamodule with a seeded generator, so every rank and
every resumed run sees the same examples; under DDP rank zero's batch is broadcast to make sure.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torch.utils.data import default_collate

from lightning_maskprior.priors import Structure


def _dataset(trainer: L.Trainer, split: str):
    if split not in ("train", "val"):
        raise ValueError(f"probe split must be 'train' or 'val', got {split!r}")
    loader = trainer.train_dataloader if split == "train" else None
    if loader is None or not hasattr(loader, "dataset"):  # not yet loaded, or several loaders
        datamodule = trainer.datamodule
        if datamodule is None:
            raise ValueError("the probe batch comes from the datamodule, but the trainer has none")
        loader = getattr(datamodule, f"{split}_dataloader")()
    return loader.dataset


def probe_batch(trainer: L.Trainer, size: int, split: str = "train", seed: int = 0,
                broadcast: bool = True) -> Any:
    """``size`` examples of the ``split`` dataset, picked with ``seed`` and collated into one batch (CPU).

    With ``broadcast`` (a collective: every rank must call it) rank zero's batch goes to every rank.
    """
    dataset = _dataset(trainer, split)
    count = len(dataset)
    generator = torch.Generator().manual_seed(seed)
    index = torch.randperm(count, generator=generator)[: min(size, count)].sort().values.tolist()
    batch = dataset.__getitems__(index) if hasattr(dataset, "__getitems__") else [dataset[i] for i in index]
    if isinstance(batch, list):
        batch = default_collate(batch)
    if broadcast and trainer.world_size > 1:
        batch = trainer.strategy.broadcast(batch, src=0)
    return batch


def batch_inputs(batch: Any) -> Tensor:
    """What the module's forward takes: ``batch["inputs"]``, the first element of a tuple, or the batch."""
    if isinstance(batch, dict):
        return batch["inputs"]
    if isinstance(batch, (list, tuple)):
        return batch[0]
    return batch


def precision_context(pl_module: L.LightningModule):
    """The forward context of the run's precision (bf16 autocast under ``bf16-mixed``), so that a probe costs
    what a training forward costs and sees the attention the training sees; no-op outside a trainer."""
    try:
        trainer = pl_module.trainer
    except RuntimeError:  # "not attached to a Trainer"
        return contextlib.nullcontext()
    return trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()


def to_device(batch: Any, device: torch.device) -> Any:
    return move_data_to_device(batch, device)


def reference_structure(pl_module: L.LightningModule) -> Structure | None:
    """The structure the measurements compare against, the same for every init method.

    ``MaskPriorModule.structure`` is the task's structure (or the YAML override), mapped to the
    attention's sequence; it is set whatever the init, so ``default`` and the query/key inits are
    measured against the same pattern as ``mask``.
    """
    return getattr(pl_module, "structure", None)


def log_scalars(trainer: L.Trainer, values: dict[str, float], step: int) -> None:
    """Write ``values`` to every logger at ``step`` (rank zero only: loggers ignore other ranks)."""
    if trainer.global_rank != 0 or not values:
        return
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


def tensorboard(trainer: L.Trainer):
    """The first TensorBoard SummaryWriter among the trainer's loggers, or None."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


"""The datamodule contract: what MaskPriorModule and the callbacks need from a benchmark.

A maskprior datamodule says what its task is (:meth:`MaskPriorDataModule.task_spec`: the objective, the token count,
the oracle structure and the init defaults) and which dataset each split is (:meth:`MaskPriorDataModule.dataset`).
The base class owns the four loaders: the training loader is a torchdata StatefulDataLoader whose shuffling is seeded
per epoch and rank (its position goes into checkpoints, so a resumed fit continues exactly), and the evaluation
loaders cover every example exactly once, also under DDP (``loaders.py``). Subclass it for a task of your own.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import Dataset

from lightning_maskprior.datamodules.loaders import eval_loader, train_loader
from lightning_maskprior.task import TaskSpec

SPLITS = ("train", "val", "test", "predict")


class MaskPriorDataModule(L.LightningDataModule):
    """Base class of every maskprior datamodule.

    A subclass sets ``batch_size``, ``eval_batch_size``, ``seed`` and ``num_workers`` in its ``__init__``, builds
    its datasets in ``setup``, and implements :meth:`task_spec` and :meth:`dataset`. ``predict`` reads the test
    split unless :meth:`dataset` says otherwise.
    """

    batch_size: int
    eval_batch_size: int
    seed: int
    _num_workers: int = 0

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @num_workers.setter
    def num_workers(self, value: int) -> None:
        # Checked when set, in the subclass's __init__: the DataLoader would refuse it only once the fit has begun.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"num_workers must be a whole number >= 0 (0: load in the main process), got {value!r}")
        self._num_workers = value

    def task_spec(self) -> TaskSpec:
        """The task the model is built for (linked into ``MaskPriorModule(task=...)`` by the CLI)."""
        raise NotImplementedError(f"{type(self).__name__} must implement task_spec()")

    def dataset(self, split: str) -> Dataset:
        """The dataset of ``split`` (one of ``SPLITS``), once ``setup`` has run."""
        raise NotImplementedError(f"{type(self).__name__} must implement dataset(split)")

    def train_loader_options(self) -> dict[str, Any]:
        """Extra options of the training loader (e.g. ``drop_last``)."""
        return {}

    def train_dataloader(self):
        return train_loader(self.dataset("train"), self.batch_size, self.seed, self.num_workers,
                            **self.train_loader_options())

    def val_dataloader(self):
        return eval_loader(self.dataset("val"), self.eval_batch_size, self.num_workers)

    def test_dataloader(self):
        return eval_loader(self.dataset("test"), self.eval_batch_size, self.num_workers)

    def predict_dataloader(self):
        return eval_loader(self.dataset("predict"), self.eval_batch_size, self.num_workers)

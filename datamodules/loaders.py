"""Data helpers shared by the datamodules: tensor datasets of dict batches, exact DDP evaluation."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

# torchdata 0.11 calls a torch function that torch 2.14 deprecated, once per loader: not the user's concern.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class TensorDictDataset(Dataset):
    """Rows of equally long tensors, returned as dicts (``{"inputs": ..., "target": ...}``)."""

    def __init__(self, **tensors: Tensor) -> None:
        lengths = {name: len(t) for name, t in tensors.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"tensors have different lengths: {lengths}")
        self.tensors = tensors
        self.length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {name: t[index] for name, t in self.tensors.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, Tensor]:
        # Batched indexing: one gather per tensor instead of one per row (collate passes it through).
        index = torch.as_tensor(indices)
        return {name: t[index] for name, t in self.tensors.items()}


def _identity_collate(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return batch


class ExactDistributedSampler(DistributedSampler):
    """Each rank gets indices rank, rank + world, ...: every example exactly once, none padded.

    torch's DistributedSampler pads the dataset so every rank has equally many examples, which
    evaluates some examples twice. Evaluation needs no equal split (no gradients are synchronised),
    and Lightning leaves a DistributedSampler it is given alone.
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(self.rank, len(dataset), self.num_replicas))
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class EpochShuffleSampler(StatefulDistributedSampler):
    """Shuffles with ``seed + epoch`` and remembers how far into the epoch it got, for exact resume.

    The order of epoch e depends only on (seed, e), never on what the process did before, so a resumed
    run shuffles epoch e as the uninterrupted one did. Lightning calls ``set_epoch`` at each epoch start
    and saves the loader's state (torchdata's StatefulDataLoader, which includes this sampler's
    position) in every checkpoint, so a run stopped mid-epoch continues with the next unseen batch.
    It is a DistributedSampler, so Lightning leaves it in place under DDP: each rank takes every
    world-th index of the same permutation (padded to equal length, as torch's DistributedSampler).
    """

    def __init__(self, dataset: Dataset, seed: int = 0) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        super().__init__(dataset, num_replicas=dist.get_world_size() if distributed else 1,
                         rank=dist.get_rank() if distributed else 0, shuffle=True, seed=seed)

    # The epoch is part of the state: Lightning prefetches the first batch after a restart before it
    # calls set_epoch, so the restored sampler must already know which epoch's order it is in.
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.epoch = int(state_dict.get("epoch", self.epoch))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def worker_seed(seed: int, rank: int) -> int:
    """Seed of the generator that seeds a training loader's workers on DDP rank ``rank``: ``seed`` on rank 0
    (a single process is unchanged), a different one on every other rank."""
    return (int(seed) + 1_000_003 * int(rank)) % 2**63


def train_loader(dataset: Dataset, batch_size: int, seed: int, num_workers: int = 0,
                 drop_last: bool = False) -> StatefulDataLoader:
    """A shuffled loader whose position goes into checkpoints (exact resume, also mid-epoch and under DDP).

    The loader's own ``generator`` (not the global RNG) seeds worker processes, so creating a loader
    iterator does not advance the global RNG that dropout and augmentation draw from. Its seed differs per
    DDP rank (:func:`worker_seed`), so the workers of different ranks draw different augmentations, whether
    or not Lightning's worker seeding is on.
    """
    return StatefulDataLoader(
        dataset, batch_size=batch_size, sampler=EpochShuffleSampler(dataset, seed=seed),
        generator=torch.Generator().manual_seed(worker_seed(seed, _rank())), num_workers=num_workers,
        drop_last=drop_last,
        collate_fn=_identity_collate if _batched(dataset) else None, persistent_workers=num_workers > 0,
    )


def eval_loader(dataset: Dataset, batch_size: int, num_workers: int = 0) -> DataLoader:
    """An ordered loader that evaluates every example exactly once, also under DDP."""
    sampler = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sampler = ExactDistributedSampler(dataset)
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=sampler, num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),  # iterating must not advance the global RNG
        collate_fn=_identity_collate if _batched(dataset) else None,
        persistent_workers=num_workers > 0,
    )


def _batched(dataset: Dataset) -> bool:
    return hasattr(dataset, "__getitems__")

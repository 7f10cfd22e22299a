"""AttentionRecord: the attention maps of a study run at the start and the end of training, as arrays.

TensorBoard keeps the AttentionMaps callback's coloured images; a figure in the paper's layout needs the
numbers. The study's cell adds this callback to every fit (``cell.record_args``: ``<run_dir>/attention_maps.npz``),
and the report draws the first seed's maps side by side, start and end, per init (``figures.attention_figure``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback


class AttentionRecord(Callback):
    """Save the probe-averaged attention probabilities of every PriorAttention layer, at step 0 and at the end
    of training, with the structure they are measured against, to one ``.npz`` (rank zero only).

    Keys: ``start`` and ``end`` (float16, layers x heads x N x N, the mean over the probe batch), ``start_step``
    and ``end_step``, and ``structure`` (bool, the same shape; absent when the module has none). A resumed fit
    keeps the ``start`` of its first attempt.

    Args:
        path: The ``.npz`` file to write.
        probe_size: Number of probe examples averaged (the same examples as AttentionMaps' default probe).
        probe_split: Dataset the probe comes from: ``train`` or ``val``.
        probe_seed: Seed that picks the probe examples.
    """

    def __init__(self, path: str, probe_size: int = 64, probe_split: str = "train", probe_seed: int = 0) -> None:
        if probe_split not in ("train", "val"):
            raise ValueError(f"probe_split must be 'train' or 'val', got {probe_split!r}")
        self.path, self.probe_size, self.probe_split, self.probe_seed = Path(path), probe_size, probe_split, probe_seed

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 0:
            self._save(trainer, pl_module, "start")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            self._save(trainer, pl_module, "end")

    @torch.no_grad()
    def maps(self, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[np.ndarray, np.ndarray | None]:
        """(layers x heads x N x N attention probabilities averaged over the probe, the structure or None)."""
        from lightning_maskprior.attention import attention_layers, attention_probabilities
        from lightning_maskprior.callbacks.probe import batch_inputs, probe_batch, reference_structure, to_device

        probe = to_device(probe_batch(trainer, self.probe_size, self.probe_split, self.probe_seed, broadcast=False),
                          pl_module.device)
        probs = attention_probabilities(pl_module, batch_inputs(probe))
        maps = torch.stack([p.float().mean(0) for p in probs]).cpu().numpy()
        structure = reference_structure(pl_module)
        layers = attention_layers(pl_module)
        open_ = None
        if structure is not None:
            expanded = structure.expanded(len(layers), layers[0].num_heads)
            if tuple(expanded.shape) == maps.shape:
                open_ = expanded.bool().cpu().numpy()
        return maps, open_

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> None:
        maps, structure = self.maps(trainer, pl_module)
        arrays: dict[str, Any] = {}
        if self.path.is_file():
            with np.load(self.path) as old:
                arrays = {k: old[k] for k in old.files}
        arrays[when] = maps.astype(np.float16)
        arrays[f"{when}_step"] = np.array(trainer.global_step)
        if structure is not None:
            arrays["structure"] = structure
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial.npz")
        np.savez_compressed(partial, **arrays)
        os.replace(partial, self.path)

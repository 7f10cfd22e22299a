"""AttentionMaps: images of each layer's attention maps and of sigmoid(M) in TensorBoard, over training."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_maskprior.attention import attention_layers, attention_probabilities
from lightning_maskprior.callbacks.probe import batch_inputs, precision_context, probe_batch, tensorboard, to_device


def colour(maps: Tensor, cell: int, gap: int = 2) -> Tensor:
    """(H, N, N) values in [0, 1] -> one (H_px, W_px, 3) uint8 image, heads side by side (viridis)."""
    from matplotlib import colormaps

    heads, n, _ = maps.shape
    rgb = torch.as_tensor(colormaps["viridis"](maps.clamp(0, 1).cpu().numpy())[..., :3], dtype=torch.float32)
    rgb = rgb.repeat_interleave(cell, dim=1).repeat_interleave(cell, dim=2)  # (H, N*cell, N*cell, 3)
    side = n * cell
    image = torch.ones(side, heads * side + (heads - 1) * gap, 3)
    for h in range(heads):
        image[:, h * (side + gap): h * (side + gap) + side] = rgb[h]
    return (image * 255).round().to(torch.uint8)


class AttentionMaps(Callback):
    """Every ``every_n_steps`` steps (and at step 0) draw, for each PriorAttention layer ``l``:

    - ``attention_maps/attention/layer<l>``: the attention probabilities averaged over a fixed probe
      batch, one panel per head (query rows, key columns; colour scale 0..1, viridis);
    - ``attention_maps/prior/layer<l>``: ``sigmoid(scale * M)`` per prior head (layers with a prior).

    Rank zero only (images are not synchronised; nothing collective runs); needs a TensorBoard
    logger and does nothing without one. The last drawn step is kept in checkpoints so a resumed run
    neither repeats nor skips an image.

    Args:
        every_n_steps: Draw when the global step is a multiple of this.
        probe_size: Number of probe examples averaged.
        probe_split: Dataset the probe comes from: ``train`` or ``val``.
        probe_seed: Seed that picks the probe examples.
        max_pixels: Side of one head's panel, at most (each entry is a square of pixels).
    """

    def __init__(self, every_n_steps: int = 200, probe_size: int = 64, probe_split: str = "train",
                 probe_seed: int = 0, max_pixels: int = 128) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.probe_size = every_n_steps, probe_size
        self.probe_split, self.probe_seed, self.max_pixels = probe_split, probe_seed, max_pixels
        self.last_step = -1
        self._probe: Any = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, probe_split=self.probe_split)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0 or tensorboard(trainer) is None:
            return
        batch = probe_batch(trainer, self.probe_size, self.probe_split, self.probe_seed, broadcast=False)
        self._probe = to_device(batch, pl_module.device)
        if self.last_step < 0 and trainer.global_step == 0:
            self.draw(trainer, pl_module, 0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self._probe is not None and step % self.every_n_steps == 0 and step > self.last_step:
            self.draw(trainer, pl_module, step)

    @torch.no_grad()
    def draw(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        writer = tensorboard(trainer)
        layers = attention_layers(pl_module)
        with precision_context(pl_module):
            probs = attention_probabilities(pl_module, batch_inputs(self._probe))
        for l, (layer, p) in enumerate(zip(layers, probs, strict=True)):
            maps = p.float().mean(0)  # (H, N, N)
            cell = max(1, self.max_pixels // maps.shape[-1])
            writer.add_image(f"attention_maps/attention/layer{l}", colour(maps, cell), step, dataformats="HWC")
            bias = layer.prior_bias()
            if bias is not None:
                writer.add_image(f"attention_maps/prior/layer{l}", colour(bias.float().exp(), cell), step,
                                 dataformats="HWC")
        self.last_step = step

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = state_dict["last_step"]

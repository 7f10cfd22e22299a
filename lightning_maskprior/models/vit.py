"""Vision Transformer from timm whose attention layers carry the prior.

The model is timm's own (any ``vit_*`` / ``deit_*`` name), built from scratch or from a local checkpoint file, and
its attention layers are then swapped for PriorAttention with the same weights (``inject.inject_prior``), so every
block, the patch embedding, the pooling and timm's weight init are timm's. The task's patch-grid structure is mapped
onto the model's heads and prefix tokens (CLS, registers) by ``structure_for_sequence``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_maskprior.checkpoints import check_weights_file
from lightning_maskprior.inject import inject_prior
from lightning_maskprior.models.base import Backbone
from lightning_maskprior.priors import Structure
from lightning_maskprior.task import TaskSpec

# Set by the datamodule (TaskSpec.extras): one source of truth for the image and its patches.
_TASK_KEYS = ("img_size", "patch_size", "in_chans", "num_classes")


def map_structure_heads(structure: Structure, num_heads: int, mode: Literal["cycle", "split"]) -> Structure:
    """Give each of ``num_heads`` model heads a pattern from a structure with S heads.

    ``cycle``: model head h takes structure head h mod S (the impulse reference: with 9 offsets and
    3 heads, the heads are centre, up, right). ``split``: model head h opens the union of structure
    heads h, h + num_heads, h + 2 num_heads, ... so all S patterns are used (3 heads: {centre, left,
    up-right}, {up, down, down-left}, {right, up-left, down-right}). S in (1, num_heads): unchanged.
    """
    heads = structure.num_heads
    if heads in (1, num_heads):
        return structure
    if mode not in ("cycle", "split"):
        raise ValueError(f"structure_heads must be 'cycle' or 'split', got {mode!r}")
    open = structure.open
    if mode == "cycle" or heads < num_heads:
        mapped = open[:, [h % heads for h in range(num_heads)]]
    else:
        mapped = torch.stack([open[:, h::num_heads].any(dim=1) for h in range(num_heads)], dim=1)
    return Structure(mapped, name=f"{structure.name} ({mode} over {num_heads} heads)")


class VisionTransformer(Backbone):
    """A timm ViT (any ``vit_*`` or ``deit_*`` name) with PriorAttention, sized by the task; from scratch, or
    fine-tuned from a checkpoint file on disk (``checkpoint_path``).

    Image size, patch size, channels and classes come from the datamodule (``task.extras``), so a
    name like ``vit_tiny_patch16_224`` also builds the 32-px CIFAR variant (``img_size=32,
    patch_size=4`` on the datamodule). Everything else of timm's ``VisionTransformer`` can be set
    in ``model_kwargs``.

    How the prior meets the sequence (``structure_for_sequence``):

    - Heads: the task gives one pattern per 3x3 impulse offset (9); ``structure_heads`` decides
      which model head takes which (see ``map_structure_heads``). Default ``cycle``: head h takes
      offset h mod 9, the mapping of the impulse init's reference code, so Mask and Impulse get
      the same per-head structure.
    - Prefix tokens (CLS, registers): they attend to every token (the CLS token is the read-out:
      closing its row would starve the classifier), and patches do not attend to them, so each
      patch row is exactly its head's impulse at init (a learnable mask can still open them).

    Args:
        task: The image task; ``task.extras`` holds ``img_size``, ``patch_size``, ``in_chans``,
            ``num_classes``.
        model_name: A timm VisionTransformer name, e.g. ``vit_tiny_patch16_224``.
        model_kwargs: More arguments for ``timm.create_model`` (``drop_path_rate``, ``embed_dim``,
            ``depth``, ``num_heads``, ``global_pool``, ``class_token``, ...).
        structure_heads: ``cycle`` or ``split``: how the task's per-offset patterns go to heads.
        checkpoint_path: Start from these weights (a timm/PyTorch state dict saved with ``torch.save``,
            ``timm.models.save_checkpoint`` or as ``.safetensors``). timm adapts them to the task: the classifier is
            re-initialised when the number of classes differs and the position embedding is resampled to the
            task's grid. Nothing is downloaded.
    """

    def __init__(self, task: TaskSpec, model_name: str = "vit_tiny_patch16_224",
                 model_kwargs: dict[str, Any] | None = None,
                 structure_heads: Literal["cycle", "split"] = "cycle", checkpoint_path: str | None = None) -> None:
        super().__init__()
        import timm

        if structure_heads not in ("cycle", "split"):
            raise ValueError(f"structure_heads must be 'cycle' or 'split', got {structure_heads!r}")
        kwargs = dict(model_kwargs or {})
        missing = [k for k in _TASK_KEYS if k not in task.extras]
        if missing:
            raise ValueError(f"task {task.name!r} is not an image task: its extras lack {missing}")
        clash = sorted(set(kwargs) & {*_TASK_KEYS, "pretrained", "pretrained_cfg_overlay", "attn_layer"})
        if clash:
            raise ValueError(
                f"model_kwargs may not set {clash}: image geometry and classes come from the datamodule, "
                "pretrained weights come from checkpoint_path (a local file), and the attention is PriorAttention"
            )
        if checkpoint_path is not None:
            if not Path(checkpoint_path).is_file():
                raise FileNotFoundError(f"checkpoint_path {checkpoint_path} does not exist; expected a timm or "
                                        "PyTorch state dict file (nothing is downloaded)")
            check_weights_file(checkpoint_path, "checkpoint_path")  # a file cut short: one line, not a traceback
            kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(checkpoint_path)})
        self.model = timm.create_model(model_name, **{k: task.extras[k] for k in _TASK_KEYS}, **kwargs)
        if not hasattr(self.model, "blocks") or not hasattr(self.model, "pos_embed"):
            raise ValueError(f"{model_name!r} is not a timm VisionTransformer")
        inject_prior(self.model)
        self.structure_heads = structure_heads
        self.num_heads = self.model.blocks[0].attn.num_heads
        self.num_prefix_tokens = int(self.model.num_prefix_tokens)
        self.in_chans = int(task.extras["in_chans"])
        self.img_size = _pair(task.extras["img_size"])

    def patch_grid(self) -> tuple[int, int]:
        """(rows, columns) of the patch grid; patches are row-major after the prefix tokens."""
        rows, cols = self.model.patch_embed.grid_size
        return int(rows), int(cols)

    def structure_for_sequence(self, structure: Structure) -> Structure:
        """Map a structure over the patches to the attention's heads and sequence (prefix tokens first)."""
        rows, cols = self.patch_grid()
        if structure.seq_len != rows * cols:
            raise ValueError(
                f"structure is {structure.seq_len}x{structure.seq_len} but the model sees a {rows}x{cols} "
                f"grid of {rows * cols} patches"
            )
        structure = map_structure_heads(structure, self.num_heads, self.structure_heads)
        return structure.pad(self.num_prefix_tokens, attends_to_all=True)

    # ------------------------------------------- what the query/key inits read (see inits.py)
    def positional_embedding(self) -> Tensor:
        """(prefix + patches, dim): position embedding of each token; prefix rows add their token."""
        model = self.model
        pos = model.pos_embed[0].detach().clone()
        prefix = [t[0].detach() for t in (model.cls_token, model.reg_token) if t is not None]
        prefix = torch.cat(prefix) if prefix else pos[:0]
        if getattr(model, "no_embed_class", False):
            return torch.cat([prefix, pos])  # prefix tokens carry no position embedding
        pos[: len(prefix)] += prefix
        return pos

    @torch.no_grad()
    def scale_positional_embedding(self, factor: float) -> None:
        """Multiply the positional embedding in place (the impulse/QK-SVD reference scales it by 18)."""
        self.model.pos_embed.mul_(factor)

    def attention_norms(self) -> list[nn.Module]:
        """The LayerNorm before each block's attention (``block.norm1``), in order."""
        return [block.norm1 for block in self.model.blocks]

    def example_inputs(self, batch_size: int, generator: torch.Generator | None = None) -> Tensor:
        """Standard-normal images: the normalised input distribution, to first order."""
        return torch.randn(batch_size, self.in_chans, *self.img_size, generator=generator)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))

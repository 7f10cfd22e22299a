"""Backbone: the base class of the networks MaskPriorModule trains.

A backbone is an ``nn.Module`` built from PriorAttention layers whose constructor takes the
datamodule's TaskSpec as its first argument (the CLI passes it; YAML gives the rest in
``model.backbone.init_args``). Subclassing Backbone is what makes a class selectable as
``model.backbone`` on the command line.

Optional hooks the rest of the project looks for:

- ``structure_for_sequence(structure)``: map a structure over the task's tokens to the sequence
  the attention sees (e.g. add a CLS row); by default the structure is used as it is.
- the query/key init interface documented in ``lightning_maskprior/inits.py``
  (``positional_embedding``, ``scale_positional_embedding``, ``attention_norms``, ...).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Backbone(nn.Module):
    """Base class of the project's backbones (first constructor argument: the TaskSpec)."""


class TokenBackbone(Backbone):
    """A backbone over token ids with a learnable ``pos_embedding`` (1, N', dim) and pre-norm
    ``blocks`` (each with ``norm1`` before its attention): the query/key init hooks they share.

    Subclasses set ``vocab_size`` and ``seq_len`` and define ``positional_embedding()``.
    """

    @torch.no_grad()
    def scale_positional_embedding(self, factor: float) -> None:
        """Multiply the positional embedding in place (the QK-SVD reference scales it by 18)."""
        self.pos_embedding.mul_(factor)

    def attention_norms(self) -> list[nn.Module]:
        """The LayerNorm applied to the residual stream before each attention layer, in order."""
        return [block.norm1 for block in self.blocks]

    def example_inputs(self, batch_size: int, generator: torch.Generator | None = None) -> Tensor:
        """A batch of uniformly random token sequences (for Boolean tasks: uniform on the cube)."""
        return torch.randint(0, self.vocab_size, (batch_size, self.seq_len), generator=generator)

"""Backbone: the base class of the networks MaskPriorModule trains.

A backbone is an ``nn.Module`` built from PriorAttention layers whose constructor takes the
datamodule's TaskSpec as its first argument (the CLI passes it; YAML gives the rest in
``model.backbone.init_args``). Subclassing Backbone is what makes a class selectable as
``model.backbone`` on the command line.

The optional hooks the rest of the project reads (``num_prefix_tokens``, ``structure_for_sequence``,
``patch_grid``, and the query/key inits' ``positional_embedding``, ``attention_norms``...) are the public contract
:class:`~lightning_maskprior.contracts.PriorBackbone` (and :class:`~lightning_maskprior.contracts.QueryKeyBackbone`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Backbone(nn.Module):
    """Base class of the project's backbones (first constructor argument: the TaskSpec).

    Attributes:
        num_prefix_tokens: Tokens the attention sees before the task's own (a CLS token, registers); 0 here.
    """

    num_prefix_tokens: int = 0


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

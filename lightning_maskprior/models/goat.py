"""GOAT attention (arXiv 2601.15380, PyPI ``goat-attention``) in the token transformer: a prior learned from scratch.

    maskprior fit -c boolean/2parity.yaml --model.backbone.init_args.attention goat \\
        --model.backbone.init_args.num_heads 2

GOAT adds a parametric prior of its own to the attention logits (Fourier features of the relative and absolute
positions and a key "sink" term, all trainable), with no task structure: the nearest published alternative to a
structural mask. It needs the ``goat`` extra (``pip install ".[goat]"``). Its heads are ``dim / num_heads`` wide
(the token transformer's ``head_dim`` does not apply) and must be wider than its positional features
(``2 pos_rank + 1``, 17 by default): at width 64, 1 or 2 heads.

A :class:`GoatLayer` is a :class:`~lightning_maskprior.attention.PriorCarrier` without an ``M``: the callbacks
record and measure its attention like any other layer's; an init method that writes a prior or the query/key
weights refuses it (only ``default`` applies).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_maskprior.attention import PriorCarrier


class GoatLayer(PriorCarrier):
    """Self-attention by ``goat.GoatAttention`` (batch first), for the token transformer's blocks.

    Args:
        dim: Model width (GOAT's ``embed_dim``).
        num_heads: Heads, each ``dim / num_heads`` wide.
        seq_len: The sequence length (GOAT normalises its sink term by it: ``training_seq_len``).
        dropout: Dropout on the attention probabilities.
        options: More ``GoatAttention`` arguments (``pos_rank``, ``abs_rank``, ``enable_key_bias``, ``prior_init``...).
    """

    def __init__(self, dim: int, num_heads: int, seq_len: int, dropout: float = 0.0,
                 options: dict[str, Any] | None = None) -> None:
        super().__init__(num_heads)
        try:
            from goat import GoatAttention
        except ImportError:
            raise ValueError('attention "goat" needs goat-attention: pip install ".[goat]"') from None
        if dim % num_heads:
            raise ValueError(f"attention goat: dim {dim} is not divisible by num_heads {num_heads} (GOAT's heads are "
                             "dim / num_heads wide)")
        arguments = {"dropout": dropout, "training_seq_len": seq_len, **(options or {})}
        try:
            self.goat = GoatAttention(dim, num_heads, batch_first=True, **arguments)
        except (TypeError, ValueError) as err:
            raise ValueError(f"attention goat (dim {dim}, num_heads {num_heads}, options {options or {}}): {err}") \
                from None
        self.dim, self.head_dim, self.inner_dim = dim, dim // num_heads, dim

    def _reference(self) -> Tensor:
        return self.goat.q_proj.weight

    def set_prior(self, logits: Tensor, trainable: bool = True, scale: float = 1.0) -> None:
        raise ValueError("a GOAT attention layer learns its own prior from scratch and carries no M: use init default")

    def forward(self, x: Tensor) -> Tensor:
        out, weights = self.goat(x, x, x, need_weights=self.record_attention, average_attn_weights=False)
        if self.record_attention:
            self.last_attention = weights.detach()
        return out

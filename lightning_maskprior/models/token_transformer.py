"""GOTU's token transformer (Abbe et al. 2023), built from PriorAttention.

Bits in {-1, +1} are mapped to {0, 1} and embedded, a learnable positional embedding is added,
pre-norm blocks (attention, GELU MLP) follow, and the pooled sequence goes through LayerNorm + Linear.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_maskprior.attention import PriorAttention
from lightning_maskprior.models.base import TokenBackbone
from lightning_maskprior.priors import Structure
from lightning_maskprior.task import TaskSpec


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, dim: int, num_heads: int, head_dim: int | None, mlp_dim: int,
                 dropout: float = 0.0, qkv_bias: bool = False, causal: bool = False,
                 attention: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attention if attention is not None else PriorAttention(
            dim, num_heads, head_dim, qkv_bias=qkv_bias, attn_drop=dropout, proj_drop=dropout, causal=causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenTransformer(TokenBackbone):
    """A transformer over a sequence of discrete tokens with one pooled output.

    Args:
        task: The task (sequence length, vocabulary, output width); given by the datamodule.
        dim: Model width.
        depth: Number of blocks.
        num_heads: Attention heads per block.
        head_dim: Width of each head (GOTU: 64 regardless of ``dim``); default ``dim // num_heads``.
        mlp_dim: Hidden width of the MLP.
        pooling: ``mean`` over the tokens, or a learnable ``cls`` token read out at position 0.
            A CLS token attends to every token and no data token attends to it (see
            ``structure_for_sequence``).
            Or ``tokens``: the head reads every token listed in the task's
            ``extras["readout_positions"]`` (e.g. arithmetic answer tokens) and the output is
            (B, len(readout_positions), num_outputs).
        pos_init_std: Standard deviation of the positional embedding at init. Large values (GOTU
            uses 1) drown the prior's signal; 0.02 is the default here (arXiv 2608.00418).
        dropout: Dropout in attention and MLP.
        qkv_bias: Bias in the query/key/value projection (GOTU: none).
        attention: ``prior`` (PriorAttention: the prior ``M`` the init methods write) or ``goat``: GOAT's
            attention with its own learned-from-scratch prior (``models/goat.py``; ``head_dim`` does not apply,
            its heads are ``dim / num_heads`` wide; needs ``pip install ".[goat]"``).
        goat_options: More ``GoatAttention`` arguments when ``attention`` is ``goat`` (``pos_rank``, ...).
    """

    def __init__(
        self,
        task: TaskSpec,
        dim: int = 64,
        depth: int = 4,
        num_heads: int = 3,
        head_dim: int | None = 64,
        mlp_dim: int = 256,
        pooling: Literal["mean", "cls", "tokens"] = "mean",
        pos_init_std: float = 0.02,
        dropout: float = 0.0,
        qkv_bias: bool = False,
        attention: Literal["prior", "goat"] = "prior",
        goat_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if pooling not in ("mean", "cls", "tokens"):
            raise ValueError(f"pooling must be 'mean', 'cls' or 'tokens', got {pooling!r}")
        if attention not in ("prior", "goat"):
            raise ValueError(f"attention must be 'prior' or 'goat', got {attention!r}")
        self.readout_positions = list(task.extras.get("readout_positions", []))
        if pooling == "tokens" and not self.readout_positions:
            raise ValueError(f"pooling 'tokens' needs extras['readout_positions'], which task {task.name!r} lacks")
        if pooling != "tokens" and self.readout_positions:
            raise ValueError(
                f"task {task.name!r} reads its outputs at tokens {self.readout_positions}: set pooling 'tokens', "
                f"not {pooling!r}"
            )
        self.seq_len = task.seq_len
        self.vocab_size = task.vocab_size
        self.pooling = pooling
        self.num_prefix_tokens = 1 if pooling == "cls" else 0
        self.token_embedding = nn.Embedding(task.vocab_size, dim)
        self.pos_embedding = nn.Parameter(
            torch.randn(1, task.seq_len + self.num_prefix_tokens, dim) * pos_init_std
        )
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * pos_init_std) if pooling == "cls" else None
        def layer() -> nn.Module | None:
            if attention == "prior":
                return None
            from lightning_maskprior.models.goat import GoatLayer

            return GoatLayer(dim, num_heads, task.seq_len + self.num_prefix_tokens, dropout, goat_options)

        self.blocks = nn.ModuleList(
            Block(dim, num_heads, head_dim, mlp_dim, dropout, qkv_bias, attention=layer()) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, task.num_outputs)

    def structure_for_sequence(self, structure: Structure) -> Structure:
        """Map a structure over the data tokens to the sequence the attention sees."""
        if structure.seq_len != self.seq_len:
            n = structure.seq_len
            raise ValueError(f"structure is {n}x{n} but the sequence has {self.seq_len} tokens")
        return structure.pad(self.num_prefix_tokens, attends_to_all=True)

    def embed(self, tokens: Tensor) -> Tensor:
        """Token + positional embeddings (B, N', dim), CLS first when pooling is ``cls``."""
        x = self.token_embedding(tokens)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embedding

    # ------------------------------------------- what the query/key inits read (see inits.py)
    def positional_embedding(self) -> Tensor:
        """(N', dim): what each position of the attention's sequence carries, tokens aside.

        The CLS row (pooling ``cls``) is the CLS token plus its position: it carries no token.
        """
        pos = self.pos_embedding[0].detach().clone()
        if self.cls_token is not None:
            pos[0] += self.cls_token[0, 0].detach()
        return pos

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.shape[1] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} tokens per example, got {tokens.shape[1]}")
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        if self.pooling == "tokens":
            x = x[:, self.readout_positions]
        else:
            x = x[:, 0] if self.pooling == "cls" else x.mean(dim=1)
        return self.head(self.norm(x))

"""A GPT-style decoder (nanoGPT's layout) built from causal PriorAttention: next-token logits per position.

Token + learned positional embeddings, pre-norm blocks (causal attention, GELU MLP), a final LayerNorm
and a language-model head tied to the token embedding. The language prior (arXiv 2608.00418) is the task's
graded structure ``causal_relative_distance``: the mask init adds ``log sigmoid(10 * M)``,
M_ij = -max(i - j, 0), on top of the causal mask.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_maskprior.models.base import TokenBackbone
from lightning_maskprior.models.token_transformer import Block
from lightning_maskprior.priors import Structure
from lightning_maskprior.task import TaskSpec


class GPT(TokenBackbone):
    """Causal language model: (B, N) token ids -> (B, N, vocab) logits of the next token.

    Args:
        task: The task (block size ``seq_len`` and ``vocab_size``); given by the datamodule.
        dim: Model width (paper: 512).
        depth: Number of blocks (paper: 12).
        num_heads: Attention heads per block (paper: 12).
        head_dim: Width of each head; default ``dim // num_heads``. The paper's 512 / 12 is not an
            integer, so its config gives 64 (GPT-2's head width; 768 query/key/value features).
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        dropout: Dropout on embeddings, attention probabilities, and residual branches (paper: 0.2).
        qkv_bias: Bias in the query/key/value projection.
        tie_weights: Share the token embedding with the output head (as GPT-2 / nanoGPT).
        init_std: Standard deviation of the normal init of linear and embedding weights; the residual
            output projections get ``init_std / sqrt(2 * depth)`` (GPT-2).
    """

    def __init__(
        self,
        task: TaskSpec,
        dim: int = 512,
        depth: int = 12,
        num_heads: int = 12,
        head_dim: int | None = None,
        mlp_ratio: float = 4.0,
        dropout: float = 0.2,
        qkv_bias: bool = True,
        tie_weights: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.seq_len, self.vocab_size = task.seq_len, task.vocab_size
        self.token_embedding = nn.Embedding(task.vocab_size, dim)
        self.pos_embedding = nn.Parameter(torch.zeros(1, task.seq_len, dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, head_dim, int(mlp_ratio * dim), dropout, qkv_bias, causal=True)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, task.vocab_size, bias=False)
        self._init_weights(init_std, depth)
        if tie_weights:
            self.head.weight = self.token_embedding.weight

    def _init_weights(self, std: float, depth: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.pos_embedding, std=std)
        for block in self.blocks:  # residual projections: scaled so the stream's variance stays put
            nn.init.normal_(block.attn.proj.weight, std=std / math.sqrt(2 * depth))
            nn.init.normal_(block.mlp[-2].weight, std=std / math.sqrt(2 * depth))

    # ----------------------------------------------------------------- for the init methods
    def structure_for_sequence(self, structure: Structure) -> Structure:
        """The attention sees the tokens themselves: the structure must be seq_len x seq_len."""
        if structure.seq_len != self.seq_len:
            n = structure.seq_len
            raise ValueError(f"structure is {n}x{n} but the block has {self.seq_len} tokens")
        return structure

    def positional_embedding(self) -> Tensor:
        """(N, dim): what each position carries apart from its token (for the query/key inits)."""
        return self.pos_embedding[0]

    # ----------------------------------------------------------------------------- forward
    def forward(self, tokens: Tensor) -> Tensor:
        n = tokens.shape[1]
        if n > self.seq_len:
            raise ValueError(f"got {n} tokens, more than the block size {self.seq_len}")
        x = self.drop(self.token_embedding(tokens) + self.pos_embedding[:, :n])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

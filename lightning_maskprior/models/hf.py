"""A Hugging Face causal language model as a backbone, with the prior injected into its attention (``inject.py``).

    maskprior fit -c language/pydoc.yaml -c init/mask.yaml --model.backbone lightning_maskprior.models.HFCausalLM
    maskprior fit -c language/pydoc.yaml -c init/mask.yaml --model.backbone lightning_maskprior.models.HFCausalLM \\
        --model.backbone.init_args.model_type llama --model.backbone.init_args.config '{"num_key_value_heads": 2}'
    ... --model.backbone.init_args.pretrained_path /path/to/a/save_pretrained/directory

Needs the ``hf`` extra (``pip install ".[hf]"``). The model's own code computes everything; the datamodule's
vocabulary and block size size its embeddings, and the language prior (``log sigmoid(10 M)``, M_ij = -max(i - j, 0))
goes onto its attention logits with the mask init, as for the project's GPT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_maskprior.checkpoints import check_weights_directory
from lightning_maskprior.inject import inject_prior
from lightning_maskprior.models.base import Backbone
from lightning_maskprior.priors import Structure
from lightning_maskprior.task import TaskSpec


class HFCausalLM(Backbone):
    """A transformers causal LM (GPT-2, Llama, Qwen2, Mistral, ...): (B, N) token ids -> (B, N, vocab) logits.

    Args:
        task: The task (block size ``seq_len`` and ``vocab_size``); given by the datamodule.
        model_type: The transformers model type built from scratch (``gpt2``, ``llama``, ``qwen2``, ...).
        dim: Model width (``hidden_size``).
        depth: Number of blocks (``num_hidden_layers``).
        num_heads: Attention heads (``num_attention_heads``).
        dropout: Dropout of the model where its config has one (GPT-2: embeddings, attention, residuals).
        config: More config values for the model type, e.g. ``{"num_key_value_heads": 2}``; they win over the above.
        pretrained_path: A local ``save_pretrained`` directory to start from instead (nothing is downloaded); its
            vocabulary is resized to the task's if they differ, and its positions must cover the block.
    """

    def __init__(self, task: TaskSpec, model_type: str = "gpt2", dim: int = 128, depth: int = 4, num_heads: int = 4,
                 dropout: float = 0.0, config: dict[str, Any] | None = None,
                 pretrained_path: str | None = None) -> None:
        super().__init__()
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ValueError("HFCausalLM needs transformers: pip install \".[hf]\"") from None
        self.seq_len, self.vocab_size = task.seq_len, task.vocab_size
        if pretrained_path is not None:
            if not Path(pretrained_path).is_dir():
                raise FileNotFoundError(f"pretrained_path {pretrained_path} is not a directory; expected one written "
                                        "by save_pretrained (nothing is downloaded)")
            check_weights_directory(pretrained_path, "pretrained_path")  # a file cut short: one line, not a traceback
            model = AutoModelForCausalLM.from_pretrained(pretrained_path, local_files_only=True,
                                                         attn_implementation="sdpa")
            if model.get_input_embeddings().num_embeddings != task.vocab_size:
                model.resize_token_embeddings(task.vocab_size)
        else:
            values = {"vocab_size": task.vocab_size, "max_position_embeddings": task.seq_len, "hidden_size": dim,
                      "num_hidden_layers": depth, "num_attention_heads": num_heads,
                      "bos_token_id": None, "eos_token_id": None}  # GPT-2's 50256 is outside a task's vocabulary
            if model_type == "gpt2":
                values.update(n_inner=4 * dim, attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
            else:
                values.update(intermediate_size=4 * dim, attention_dropout=dropout)
            try:
                hf_config = AutoConfig.for_model(model_type, **{**values, **(config or {})})
            except ValueError as err:
                raise ValueError(f"model_type {model_type!r}: {err}") from None
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None and positions < task.seq_len:
            raise ValueError(f"the model has {positions} positions but the task's block has {task.seq_len} tokens")
        self.model = inject_prior(model)

    def structure_for_sequence(self, structure: Structure) -> Structure:
        """The attention sees the tokens themselves: the structure must be seq_len x seq_len."""
        if structure.seq_len != self.seq_len:
            n = structure.seq_len
            raise ValueError(f"structure is {n}x{n} but the block has {self.seq_len} tokens")
        return structure

    # --------------------------------------------------- the query/key init interface (lightning_maskprior/inits.py)
    def _learned_positions(self) -> nn.Embedding:
        """GPT-2's learned absolute positions; models with rotary positions (Llama family) have none to fit to."""
        positions = getattr(getattr(self.model, "transformer", None), "wpe", None)
        if not isinstance(positions, nn.Embedding):
            raise ValueError("the query/key inits (qk_svd, qk_opt, impulse) fit Wq, Wk to a learned positional "
                             f"embedding, which {type(self.model).__name__} does not have (its positions are "
                             "rotary); GPT-2 has one")
        return positions

    def positional_embedding(self) -> Tensor:
        """What each of the block's positions adds to its token: GPT-2's ``wpe`` rows (seq_len, dim)."""
        return self._learned_positions()(torch.arange(self.seq_len, device=self.model.device))

    @torch.no_grad()
    def scale_positional_embedding(self, factor: float) -> None:
        self._learned_positions().weight.mul_(factor)

    def attention_norms(self) -> list[nn.Module]:
        """The LayerNorm before each attention (GPT-2 blocks' ``ln_1``)."""
        self._learned_positions()
        return [block.ln_1 for block in self.model.transformer.h]

    def example_inputs(self, batch_size: int, generator: torch.Generator | None = None) -> Tensor:
        """Uniformly random token blocks."""
        return torch.randint(0, self.vocab_size, (batch_size, self.seq_len), generator=generator)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits

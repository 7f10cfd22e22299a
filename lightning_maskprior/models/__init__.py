"""Backbones whose attention carries the prior. Each takes the datamodule's TaskSpec as first argument."""

from lightning_maskprior.models.base import Backbone
from lightning_maskprior.models.gpt import GPT
from lightning_maskprior.models.hf import HFCausalLM
from lightning_maskprior.models.token_transformer import TokenTransformer
from lightning_maskprior.models.vit import VisionTransformer

__all__ = ["Backbone", "GPT", "HFCausalLM", "TokenTransformer", "VisionTransformer"]

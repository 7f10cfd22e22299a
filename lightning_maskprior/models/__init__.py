"""Backbones built from PriorAttention. Each takes the datamodule's TaskSpec as first argument."""

from lightning_maskprior.models.base import Backbone
from lightning_maskprior.models.gpt import GPT
from lightning_maskprior.models.token_transformer import TokenTransformer
from lightning_maskprior.models.vit import VisionTransformer

__all__ = ["Backbone", "GPT", "TokenTransformer", "VisionTransformer"]

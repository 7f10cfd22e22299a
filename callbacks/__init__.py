"""Lightning callbacks that measure the prior (installed as ``lightning_maskprior.callbacks``)."""

from lightning_maskprior.callbacks.attention_maps import AttentionMaps
from lightning_maskprior.callbacks.extrapolation import ExtrapolationMonitor
from lightning_maskprior.callbacks.persistence import PriorPersistence
from lightning_maskprior.callbacks.predictions import PredictionWriter

__all__: list[str] = ["AttentionMaps", "ExtrapolationMonitor", "PredictionWriter", "PriorPersistence"]

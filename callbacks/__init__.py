"""Lightning callbacks (installed as ``lightning_maskprior.callbacks``), each with one job.

Measuring the prior: PriorPersistence, AttentionMaps, AttentionRecord, ExtrapolationMonitor. Writing: PredictionWriter,
HparamsSession. Tuning: OptunaPruning (``maskprior tune`` adds it). Keeping a run safe to stop and resume (the CLI
adds these to every fit): StopOnSignal, FinalCheckpoint, RNGStates, StopOnDivergence.
"""

from lightning_maskprior.callbacks.attention_maps import AttentionMaps
from lightning_maskprior.callbacks.attention_record import AttentionRecord
from lightning_maskprior.callbacks.divergence import Diverged, StopOnDivergence
from lightning_maskprior.callbacks.extrapolation import ExtrapolationMonitor
from lightning_maskprior.callbacks.hparams import HparamsSession
from lightning_maskprior.callbacks.optuna_pruning import OptunaPruning
from lightning_maskprior.callbacks.persistence import PriorPersistence
from lightning_maskprior.callbacks.predictions import PredictionWriter
from lightning_maskprior.callbacks.rng import RNGStates
from lightning_maskprior.callbacks.signals import FinalCheckpoint, StopOnSignal

__all__: list[str] = ["AttentionMaps", "AttentionRecord", "Diverged", "ExtrapolationMonitor", "FinalCheckpoint",
                      "HparamsSession", "OptunaPruning", "PredictionWriter", "PriorPersistence", "RNGStates",
                      "StopOnDivergence", "StopOnSignal"]

"""lightning-maskprior: structural priors in transformer attention, as a learnable mask or in Wq/Wk."""

from lightning_maskprior.attention import PriorAttention, attention_layers, attention_probabilities
from lightning_maskprior.inits import INIT_METHODS, apply_init, register_init
from lightning_maskprior.priors import Structure, StructureSpec
from lightning_maskprior.task import Objective, TaskSpec

__version__ = "0.1.0"

__all__ = [
    "INIT_METHODS",
    "Objective",
    "PriorAttention",
    "Structure",
    "StructureSpec",
    "TaskSpec",
    "apply_init",
    "attention_layers",
    "attention_probabilities",
    "register_init",
]

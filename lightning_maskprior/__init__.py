"""lightning-maskprior: structural priors in transformer attention, as a learnable mask or in Wq/Wk."""

from lightning_maskprior.attention import PriorAttention, attention_layers, attention_probabilities
from lightning_maskprior.inits import INIT_METHODS, apply_init, register_init
from lightning_maskprior.priors import Structure, StructureSpec
from lightning_maskprior.task import Objective, TaskSpec

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "load_run":  # imported on first use: it needs Lightning
        from lightning_maskprior.runs import load_run

        return load_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "load_run",
    "register_init",
]

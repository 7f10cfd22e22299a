"""lightning-maskprior: structural priors in transformer attention, as a learnable mask or in Wq/Wk.

The public names below are imported on first use: ``import lightning_maskprior.<light module>`` (the study's
cell, a SLURM job, ``run_status``) then does not pay for importing torch and Lightning.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "PriorAttention": "attention",
    "attention_layers": "attention",
    "attention_probabilities": "attention",
    "INIT_METHODS": "inits",
    "apply_init": "inits",
    "register_init": "inits",
    "restoring_weights": "inits",
    "weights_restored": "inits",
    "Structure": "priors",
    "StructureSpec": "priors",
    "Objective": "task",
    "TaskSpec": "task",
    "inject_prior": "inject",
    "export_prior": "inject",
    "set_prior": "inject",
    "remove_prior": "inject",
    "load_injected": "inject",
    "load_run": "run.load",
    "run_precision": "run.load",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)

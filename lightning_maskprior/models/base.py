"""Backbone: the base class of the networks MaskPriorModule trains.

A backbone is an ``nn.Module`` built from PriorAttention layers whose constructor takes the
datamodule's TaskSpec as its first argument (the CLI passes it; YAML gives the rest in
``model.backbone.init_args``). Subclassing Backbone is what makes a class selectable as
``model.backbone`` on the command line.

Optional hooks the rest of the project looks for:

- ``structure_for_sequence(structure)``: map a structure over the task's tokens to the sequence
  the attention sees (e.g. add a CLS row); by default the structure is used as it is.
- the query/key init interface documented in ``lightning_maskprior/inits.py``
  (``positional_embedding``, ``scale_positional_embedding``, ``attention_norms``, ...).
"""

from __future__ import annotations

from torch import nn


class Backbone(nn.Module):
    """Base class of the project's backbones (first constructor argument: the TaskSpec)."""

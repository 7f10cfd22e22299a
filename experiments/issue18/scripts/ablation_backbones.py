"""Backbones for the issue-18 vision ablations (docs/notes/issue-18-plan.md), without a change to inits.py.

The impulse init (lightning_maskprior/inits.py, ``impulse_init``) does three things at once: it puts the 3x3
impulse structure into Wq/Wk (QK-SVD), scales the positional embedding by ``pos_scale`` (18), and sets mimetic
values ``Wproj Wv ~ 0.4 Z - 0.4 I``. The ``mask`` init does only the first part's counterpart (the prior M). To
tell the causes apart, ``ImpulseExtrasViT`` applies the other parts while the backbone is built, so ANY init method
(``default``, ``mask``, ``fixed``...) then runs on top of them, unchanged:

- ``pos_scale``: multiply the positional embedding (timm's pos_embed, CLS row included), as impulse does;
- ``value_alpha`` / ``value_beta``: mimetic values in every layer, as impulse does (0 / 0: timm's own init);
- ``qk_gain``: multiply the random Wq and Wk by this factor (the impulse's Wq/Wk have ~12.5x the Frobenius norm of
  timm's init on the digits ViT): content logits large enough to compete with a +-10 mask, without any structure;
- ``impulse_qk: true``: run the whole impulse init (QK structure + ``pos_scale`` + values) first; with
  ``init: mask`` on top, the mask prior is added to the impulse model ("mask_on_impulse").

This folder must be on the import path of every run (the study's child processes inherit the environment):

    export PYTHONPATH=$PWD/experiments/issue18/scripts
    maskprior study -c experiments/issue18/configs/study/digits_causes.yaml --parallel 2

and of anything that reopens these runs (``load_run``, ``attention_stats.py``). The same switches as init options
of ``mask`` / ``default`` would be the permanent form (the plan's "code change V"); the runs are equivalent.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_maskprior.attention import attention_layers
from lightning_maskprior.inits import _mimetic_value, impulse_init
from lightning_maskprior.models.vit import VisionTransformer
from lightning_maskprior.task import TaskSpec


class ImpulseExtrasViT(VisionTransformer):
    """The project's timm ViT, with parts of the impulse init applied at construction (see the module docstring).

    Args:
        task, model_name, model_kwargs, structure_heads: as ``VisionTransformer``.
        pos_scale: Factor on the positional embedding (impulse: 18). 1: unchanged.
        value_alpha, value_beta: Mimetic value init ``Wproj Wv ~ alpha Z - beta I`` in every layer (impulse: 0.4,
            0.4). Both 0: timm's init, unchanged.
        qk_gain: Factor on the query/key weights (not with ``impulse_qk``). 1: unchanged.
        impulse_qk: Apply the full impulse init (structure in Wq/Wk, with ``pos_scale`` and the value options above)
            instead of only the extras. Needs ``structure_heads: cycle`` (the impulse init's own head mapping).
        impulse_open_value, impulse_closed_noise, impulse_qk_scale: The impulse init's other options (its defaults).
    """

    def __init__(self, task: TaskSpec, model_name: str = "vit_tiny_patch16_224",
                 model_kwargs: dict[str, Any] | None = None,
                 structure_heads: Literal["cycle", "split"] = "cycle",
                 pos_scale: float = 1.0, value_alpha: float = 0.0, value_beta: float = 0.0,
                 qk_gain: float = 1.0, impulse_qk: bool = False, impulse_open_value: float = 1000.0,
                 impulse_closed_noise: float = 3.0, impulse_qk_scale: float = 7.0) -> None:
        super().__init__(task, model_name=model_name, model_kwargs=model_kwargs, structure_heads=structure_heads)
        if impulse_qk:
            if qk_gain != 1.0:
                raise ValueError("qk_gain applies to random Wq/Wk; the impulse init sets its own scale (qk_scale)")
            if structure_heads != "cycle":
                raise ValueError("impulse_qk needs structure_heads: cycle (the impulse init maps offset h mod 9 "
                                 "to head h), so that the mask and the QK structure agree head by head")
            impulse_init(self, None, open_value=impulse_open_value, closed_noise=impulse_closed_noise,
                         pos_scale=pos_scale, qk_scale=impulse_qk_scale, value_alpha=value_alpha,
                         value_beta=value_beta)
            return
        if pos_scale != 1.0:
            self.scale_positional_embedding(pos_scale)
        for layer in attention_layers(self):
            if value_alpha or value_beta:
                _mimetic_value(layer, value_alpha, value_beta)
            if qk_gain != 1.0:
                with torch.no_grad():
                    for weight in layer.query_key_weights():  # views into the fused qkv projection
                        weight.mul_(qk_gain)

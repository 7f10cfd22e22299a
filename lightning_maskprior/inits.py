"""Where a structure goes: one function per init method, in one registry.

An init method takes the backbone (any module holding PriorAttention layers), the task's Structure
(or None) and its own keyword options, and changes the backbone in place. ``mask``, ``zero`` and
``fixed`` put the structure into the additive prior; the query/key baselines put it into Wq/Wk.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from lightning_maskprior.attention import PriorAttention, attention_layers
from lightning_maskprior.priors import Structure, check_open_closed

InitMethod = Callable[..., None]
INIT_METHODS: dict[str, InitMethod] = {}


def register_init(name: str) -> Callable[[InitMethod], InitMethod]:
    """Decorator: register ``fn(backbone, structure, **options)`` under ``name``."""

    def decorator(fn: InitMethod) -> InitMethod:
        if name in INIT_METHODS:
            raise ValueError(f"init method {name!r} is already registered")
        INIT_METHODS[name] = fn
        return fn

    return decorator


def needs_structure(name: str) -> bool:
    """Whether init method ``name`` reads the structure."""
    return getattr(get_init(name), "needs_structure", False)


def get_init(name: str) -> InitMethod:
    if name not in INIT_METHODS:
        raise ValueError(f"unknown init method {name!r}; expected one of {sorted(INIT_METHODS)}")
    return INIT_METHODS[name]


def apply_init(name: str, backbone: nn.Module, structure: Structure | None, **options) -> None:
    """Apply init method ``name`` to ``backbone`` with ``structure`` and method-specific options."""
    fn = get_init(name)
    accepted = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(set(options) - set(accepted)) if not takes_any else []
    if unknown:
        valid = sorted(k for k in accepted if k not in ("backbone", "structure"))
        raise ValueError(f"init method {name!r} got unknown options {unknown}; it accepts {valid}")
    layers = attention_layers(backbone)
    if not layers:
        raise ValueError(f"{type(backbone).__name__} has no PriorAttention layers to initialise")
    if getattr(fn, "needs_structure", False) and structure is None:
        raise ValueError(f"init method {name!r} needs a structure, but the task gave none")
    fn(backbone, structure, **options)


def _structure_layers(backbone: nn.Module, structure: Structure) -> list[tuple[PriorAttention, torch.Tensor]]:
    """Pair each attention layer with its (heads, N, N) pattern, checking the sizes match."""
    layers = attention_layers(backbone)
    structure.for_model(len(layers), layers[0].num_heads)
    return [(layer, structure.layer(i)) for i, layer in enumerate(layers)]


def _mask_logits(structure: Structure, index: int, open: torch.Tensor, open_value: float,
                 closed_value: float) -> torch.Tensor:
    """M of layer ``index``: the structure's graded values if it has them, else open/closed values."""
    values = structure.layer_values(index)
    if values is not None:
        return values
    return torch.where(open, float(open_value), float(closed_value))


def _uses_structure(fn: InitMethod) -> InitMethod:
    fn.needs_structure = True
    return fn


@register_init("default")
def default_init(backbone: nn.Module, structure: Structure | None) -> None:
    """The architecture's own random init; no prior (plain attention)."""
    for layer in attention_layers(backbone):
        layer.clear_prior()


@register_init("mask")
@_uses_structure
def mask_init(backbone: nn.Module, structure: Structure, open_value: float = 10.0,
              closed_value: float = -10.0, scale: float = 1.0) -> None:
    """Learnable prior M: ``open_value`` on open pairs, ``closed_value`` on closed ones."""
    check_open_closed(open_value, closed_value)
    for index, (layer, open) in enumerate(_structure_layers(backbone, structure)):
        layer.set_prior(_mask_logits(structure, index, open, open_value, closed_value), True, scale)


@register_init("fixed")
@_uses_structure
def fixed_init(backbone: nn.Module, structure: Structure, open_value: float = 10.0,
               closed_value: float = -10.0, scale: float = 1.0) -> None:
    """The mask prior, frozen (not trained)."""
    check_open_closed(open_value, closed_value)
    for index, (layer, open) in enumerate(_structure_layers(backbone, structure)):
        layer.set_prior(_mask_logits(structure, index, open, open_value, closed_value), False, scale)


@register_init("zero")
def zero_init(backbone: nn.Module, structure: Structure | None, seq_len: int | None = None) -> None:
    """Learnable prior M = 0 everywhere (ablation): the mask's parameter, without the structure.

    The shape (heads, N, N) follows the structure if there is one (so it matches ``mask``),
    else it is one N x N prior shared by all heads, N given by ``seq_len``.
    """
    layers = attention_layers(backbone)
    if structure is not None:
        n, heads = structure.seq_len, structure.num_heads
    elif seq_len is not None:
        n, heads = seq_len, 1
    else:
        raise ValueError("init 'zero' needs a structure or seq_len to size the prior")
    for layer in layers:
        layer.set_prior(torch.zeros(heads, n, n), trainable=True)

"""Put a learnable prior into a model that already exists, and take it out again.

    import timm
    from lightning_maskprior import inject_prior, remove_prior, Structure

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False)   # or your own checkpoint
    inject_prior(model)                                  # every attention layer can now carry a prior M
    inject_prior(model, structure, init="mask")          # ... and M starts from ``structure``
    priors = export_prior(model)                         # the M of each layer (None where there is none)
    remove_prior(model)                                  # back to the model's own attention, same weights

Each supported attention layer is replaced by a :class:`~lightning_maskprior.attention.PriorAttention` holding the
same weights (``qkv``, ``proj``: timm's names), so the model's own code runs around it and, with no prior (or every
entry open), its outputs are the untouched model's to float tolerance. The callbacks, the init methods and
``attention.attention_layers`` then see the injected layers exactly as they see the project's own backbones.

Supported:

- timm's ``Attention`` (ViT, DeiT, ViT with register tokens, every global-pool variant), without ``qk_norm``,
  ``scale_norm``, a gate, or an output width other than its input's;
- Hugging Face decoder-only language models whose attention goes through the library's attention-function registry
  (tested: GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2, Gemma3, GPT-OSS): each attention module gets a
  :class:`HFPrior` (holding M) and the model runs the ``maskprior`` attention function, which adds
  ``log sigmoid(s M)`` to the model's own causal and padding mask, its rows and columns taken at the tokens'
  positions (``position_ids``), so a KV cache of any kind and left padding see the prior a full forward pass sees.
  Gemma2's logit soft-capping (before the prior) and GPT-OSS's attention sinks are computed as the models do.
  Needs ``pip install ".[hf]"``.

A model with priors keeps them through ``state_dict`` / ``load_state_dict`` (a fresh injected model takes M from
the state dict), and a Hugging Face one through ``save_pretrained`` and :func:`load_injected`.

Anything else that attends is refused, naming its class.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_maskprior.attention import (
    PriorAttention,
    PriorCarrier,
    active_copy,
    attention_layers,
    kernel_for,
    softmax_rows,
)
from lightning_maskprior.priors import Structure


class InjectedAttention(PriorAttention):
    """PriorAttention in place of a timm ``Attention`` (same weights, same call signature); ``original`` keeps
    the options to build that layer again (``remove_prior``)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, qkv_bias: bool, attn_drop: float,
                 proj_drop: float) -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        self.original = {"dim": dim, "num_heads": num_heads, "attn_head_dim": head_dim, "qkv_bias": qkv_bias,
                         "attn_drop": attn_drop, "proj_drop": proj_drop}

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("an injected attention layer takes no attn_mask / is_causal: the prior is its mask")
        return super().forward(x)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _save_scale(self, destination, prefix)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """The saved prior as it was saved (its shape: one M for all heads or one per head) and its scale."""
        _load_prior(self, state_dict, prefix, args)


def _timm_attention() -> type[nn.Module] | None:
    try:
        from timm.layers import Attention
    except ImportError:  # timm is a dependency; a trimmed install may lack it
        return None
    return Attention


def _unsupported(layer: nn.Module) -> list[str]:
    """What a timm Attention layer uses that PriorAttention does not implement."""
    problems = []
    if not isinstance(layer.q_norm, nn.Identity) or not isinstance(layer.k_norm, nn.Identity):
        problems.append("qk_norm")
    if not isinstance(getattr(layer, "norm", nn.Identity()), nn.Identity):
        problems.append("scale_norm")
    if getattr(layer, "gate", None) is not None:
        problems.append("gated")
    if layer.proj.bias is None:
        problems.append("proj_bias=False")
    if layer.proj.out_features != layer.qkv.in_features:
        problems.append("dim_out != dim")
    return problems


def _inject_layer(layer: nn.Module, where: str) -> InjectedAttention:
    problems = _unsupported(layer)
    if problems:
        raise ValueError(f"{where} ({type(layer).__module__}.{type(layer).__name__}) uses {problems}, which "
                         "PriorAttention does not implement; expected timm's plain multi-head Attention")
    new = InjectedAttention(layer.qkv.in_features, layer.num_heads, layer.head_dim, layer.qkv.bias is not None,
                            float(layer.attn_drop.p), float(layer.proj_drop.p))
    return _with_weights_of(layer, new)


def _with_weights_of(source: nn.Module, target: nn.Module) -> nn.Module:
    """``target`` holding ``source``'s ``qkv`` and ``proj`` weights, on its device and dtype, in its mode."""
    target.load_state_dict({k: v for k, v in source.state_dict().items() if k.startswith(("qkv.", "proj."))})
    weight = source.qkv.weight
    return target.to(device=weight.device, dtype=weight.dtype).train(source.training)


def _refuse_other_attention(model: nn.Module, supported: tuple[type, ...]) -> None:
    """Fail naming the class of a module that attends but cannot carry a prior (so no layer is left without)."""
    for name, module in model.named_modules():
        cls = type(module)
        if isinstance(module, supported) or not cls.__name__.endswith("Attention"):
            continue
        if any(isinstance(child, supported) for child in module.modules() if child is not module):
            continue  # a wrapper around a supported layer
        raise ValueError(f"{name or 'the model'} is a {cls.__module__}.{cls.__name__}, an attention module "
                         "inject_prior cannot carry a prior in; supported: timm.layers.Attention (ViT, DeiT and "
                         "their variants)")


def inject_prior(model: nn.Module, structure: Structure | None = None, init: str | None = None, *,
                 parameterisation: str | None = None, prior_rank: int | None = None,
                 **init_options: Any) -> nn.Module:
    """Make every attention layer of ``model`` a PriorAttention with the same weights; returns ``model``.

    Args:
        model: A timm model built from ``timm.layers.Attention`` (e.g. ``vit_*``, ``deit_*``), trained or not.
        structure: The structure M starts from (``init``); its sequence must be the model's (prefix tokens
            included: ``Structure.pad``), one pattern per head or one for all.
        init: An init method (``mask``, ``zero``, ``fixed``, ``default``...) applied after the injection; default:
            ``mask`` when a structure is given, else none (the layers carry no prior: the model is unchanged).
        parameterisation: How each layer holds M (``full``, ``relative``, ``low_rank``; attention.py), set before
            the init, which then projects its M onto it. For ``relative`` a timm ViT's offsets are 2-D over its patch
            grid, after its prefix tokens. None: as the layers hold it now (``full`` when newly injected).
        prior_rank: The rank of a ``low_rank`` prior (default: attention.DEFAULT_RANK).
        init_options: The init method's options (e.g. ``open_value``, ``closed_value``, ``trainable``).

    Layers that are PriorAttention already are left as they are, so injecting twice is harmless.
    """
    if _is_hf_model(model):
        _inject_hf(model)
        _parameterise(model, parameterisation, prior_rank)
        return _init(model, structure, init, init_options)
    attention = _timm_attention()
    supported = (PriorAttention,) + ((attention,) if attention is not None else ())
    _refuse_other_attention(model, supported)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if attention is not None and isinstance(child, attention) and not isinstance(child, PriorAttention):
                setattr(module, child_name, _inject_layer(child, f"{name}.{child_name}".lstrip(".")))
    if not attention_layers(model):
        raise ValueError(f"{type(model).__name__} has no attention layer inject_prior can carry a prior in; "
                         "supported: timm.layers.Attention (ViT, DeiT and their variants)")
    _check_sequence(model, structure)
    _parameterise(model, parameterisation, prior_rank)
    return _init(model, structure, init, init_options)


def _check_sequence(model: nn.Module, structure: Structure | None) -> None:
    """A timm ViT attends over a fixed number of tokens (prefix + patches): a structure of another size is refused
    when it is installed, not at the first forward. Models that take any image size are checked at the forward."""
    patches = getattr(getattr(model, "patch_embed", None), "num_patches", None)
    if structure is None or patches is None or getattr(model, "dynamic_img_size", False):
        return
    prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
    tokens = int(patches) + prefix
    if structure.seq_len != tokens:
        n = structure.seq_len
        raise ValueError(
            f"structure {structure.name!r} is {n}x{n} but {type(model).__name__} attends over {tokens} tokens "
            f"({prefix} prefix + {patches} patches); give one over every token (Structure.pad adds the prefix)"
        )


def _parameterise(model: nn.Module, parameterisation: str | None, rank: int | None) -> None:
    """Every layer holds M as ``parameterisation`` (None: unchanged); a relative prior's layout is the model's prefix
    tokens and, for a timm ViT, its patch grid."""
    if parameterisation is None and rank is None:
        return
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    grid = (int(grid[0]), int(grid[1])) if grid is not None else None
    prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
    for layer in attention_layers(model):
        layer.set_parameterisation(parameterisation or layer.parameterisation, rank, grid, prefix)


def _init(model: nn.Module, structure: Structure | None, init: str | None, options: dict[str, Any]) -> nn.Module:
    init = init or ("mask" if structure is not None else None)
    if init is not None:
        from lightning_maskprior.inits import apply_init

        apply_init(init, model, structure, **options)
    return model


class ExportedPrior(NamedTuple):
    """One layer's prior as :func:`export_prior` gives it: ``layer.set_prior(*prior)`` installs it again."""

    logits: Tensor  # M, (heads or 1, N, N)
    trainable: bool
    scale: float  # the attention adds log sigmoid(scale * M)


def export_prior(model: nn.Module) -> list[ExportedPrior | None]:
    """The prior of each attention layer, in forward order: M (a detached copy), whether it trains, and its scale;
    None where there is none. :func:`set_prior` puts them back."""
    priors = []
    for layer in attention_layers(model):
        matrix = layer.prior_matrix() if hasattr(layer, "prior_matrix") else layer.prior_logits
        if matrix is None:
            priors.append(None)
            continue
        trainable = any(p.requires_grad for p in _prior_parameters(layer))
        priors.append(ExportedPrior(matrix.detach().clone(), trainable, float(layer.prior_scale)))
    return priors


def set_prior(model: nn.Module, priors: list[ExportedPrior | Tensor | None]) -> nn.Module:
    """Install :func:`export_prior`'s list in ``model``'s attention layers, in forward order (a bare tensor: M at
    scale 1, trainable; None: no prior). Returns ``model``."""
    layers = attention_layers(model)
    if len(priors) != len(layers):
        raise ValueError(f"{len(priors)} priors for the {len(layers)} attention layers of {type(model).__name__}")
    for layer, prior in zip(layers, priors, strict=True):
        if prior is None:
            layer.clear_prior()
        elif isinstance(prior, Tensor):
            layer.set_prior(prior)
        else:
            layer.set_prior(*prior)
    return model


# A prior in a state dict: M (``prior_logits``, or the parameters of another parameterisation), created on loading
# where the layer has none yet; and its scale, saved by a timm layer where it is not 1 (so a checkpoint without a
# scaled prior has the keys it always had), by a Hugging Face one always, with whether M trains.
_SCALE_KEY = "prior_scale"
_TRAINABLE_KEY = "prior_trainable"  # Hugging Face layers: whether M trains (saved with M, like their scale)


def _prior_parameters(layer: nn.Module) -> list[nn.Parameter]:
    """The parameters that hold a layer's M (``prior_logits``, or another parameterisation's); empty without one."""
    return [param for name, param in layer.named_parameters(recurse=False) if name.startswith("prior_")]


def _has_prior(layer: nn.Module) -> bool:
    return bool(_prior_parameters(layer))


def _save_scale(layer: PriorCarrier, destination: dict, prefix: str) -> None:
    if _has_prior(layer) and layer.prior_scale != 1.0:
        destination[prefix + _SCALE_KEY] = torch.tensor(float(layer.prior_scale))


def _prior_names(state_dict: dict, prefix: str) -> list[str]:
    """The prior parameters (``prior_logits``, ``prior_offsets``...) that ``state_dict`` holds for the layer at
    ``prefix``."""
    names = (key[len(prefix):] for key in state_dict if key.startswith(prefix))
    return [name for name in names if name.startswith("prior_") and "." not in name
            and name not in (_SCALE_KEY, _TRAINABLE_KEY)]


def _load_prior(layer: PriorCarrier, state_dict: dict, prefix: str, args: tuple) -> None:
    """``nn.Module._load_from_state_dict`` for a prior carrier: a prior the state dict has and the layer has not
    yet, or holds in another shape (one M for all heads or one per head), is created first (so a fresh injected model
    loads a trained one), and a saved scale is taken. Where the state dict holds M in another parameterisation than
    the layer does, the layer's own parameters go: it then holds M the way it was saved, never both (the first would
    shadow the loaded one, even with ``strict=False``)."""
    saved_names = _prior_names(state_dict, prefix)
    if saved_names:
        for name in set(layer.prior_parameters()) - set(saved_names):
            setattr(layer, name, None)
    for name in saved_names:
        held = getattr(layer, name, None)
        if held is not None and held.shape != state_dict[prefix + name].shape:
            setattr(layer, name, None)
    for name in saved_names:
        if getattr(layer, name, None) is None:
            saved = state_dict[prefix + name]
            setattr(layer, name, nn.Parameter(torch.empty_like(saved, device=layer._reference().device,
                                                               dtype=layer._reference().dtype)))
    nn.Module._load_from_state_dict(layer, state_dict, prefix, *args)
    layer.adopt_held_parameterisation()  # a relative or low-rank prior loads as one
    key = prefix + _SCALE_KEY
    if key in state_dict:
        layer.prior_scale = float(state_dict[key])
        _drop_unexpected(args, key)


def _drop_unexpected(args: tuple, key: str) -> None:
    """``key`` is read by the layer: no unexpected key of ``load_state_dict``."""
    unexpected = args[3]  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    if key in unexpected:
        unexpected.remove(key)


def remove_prior(model: nn.Module) -> nn.Module:
    """The inverse of :func:`inject_prior`: every injected layer becomes the model's own attention layer again,
    with the current weights (the prior is dropped; ``export_prior`` first to keep it). Returns ``model``."""
    if _is_hf_model(model):
        return _remove_hf(model)
    attention = _timm_attention()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, InjectedAttention) and attention is not None:
                setattr(module, child_name, _with_weights_of(child, attention(**child.original)))
    return model


# ------------------------------------------------------------------------------------------ Hugging Face
HF_IMPLEMENTATION = "maskprior"  # the name of the attention function (and its mask) in transformers' registries
# The families whose injected attention is tested (tests/test_inject_hf.py): a full forward pass, step-by-step
# decoding with a KV cache and save / load. Others pass if they use none of the refused features.
TESTED_FAMILIES = "GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2, Gemma3, GPT-OSS"


class HFPrior(PriorCarrier):
    """The prior of one Hugging Face attention module, held as ``module.maskprior``: M and what the callbacks read.
    The module's own projections stay where they are; ``maskprior_attention`` adds the prior to its logits.

    Its query/key and value/output weights are views into the module's own projections, so the structure-free and
    query/key inits (``mimetic``, ``qk_svd``, ``qk_opt``) write the model itself: GPT-2's fused ``c_attn`` /
    ``c_proj`` (``Conv1D``, stored (in, out)) and the Llama family's ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``.
    Grouped-query attention (fewer key/value heads than query heads) has no per-head Wk to write; those inits
    refuse it.

    M is a parameter of the model (``...maskprior.prior_logits`` in its state dict); its scale and whether it trains
    are kept in the model's config (``config.maskprior``, by the module's ``index`` among the model's attention
    modules), so that ``save_pretrained`` writes them to ``config.json`` and :func:`load_injected` restores them.
    """

    def __init__(self, module: nn.Module, num_heads: int, head_dim: int, dim: int, index: int = 0) -> None:
        super().__init__(num_heads)
        self._module = [module]  # a list: the attention module owns this one, not the other way round
        self.dim, self.head_dim, self.inner_dim = dim, head_dim, num_heads * head_dim
        self.index = index

    def _reference(self) -> Tensor:
        return next(self._module[0].parameters())

    def attention_module(self) -> nn.Module:
        return self._module[0]

    def set_prior(self, logits: Tensor, trainable: bool = True, scale: float = 1.0) -> None:
        super().set_prior(logits, trainable, scale)
        self._record({"scale": float(self.prior_scale), "trainable": bool(trainable)})

    def clear_prior(self) -> None:
        super().clear_prior()
        self._record(None)

    def _record(self, entry: dict | None) -> None:
        """Write this layer's scale and trainability into the model's config (None: no prior)."""
        config = getattr(self._module[0], "config", None)
        if config is None:
            return
        records = {k: v for k, v in (getattr(config, HF_IMPLEMENTATION, None) or {}).items() if k != str(self.index)}
        if entry is not None:
            records[str(self.index)] = entry
        setattr(config, HF_IMPLEMENTATION, dict(sorted(records.items(), key=lambda item: int(item[0]))) or None)

    @property
    def prior_size(self) -> int:
        """N: the tokens the prior has rows and columns for (0 without a prior)."""
        held = self.prior_parameters()
        if "prior_logits" in held:
            return held["prior_logits"].shape[-1]
        if "prior_left" in held:
            return held["prior_left"].shape[-2]
        if "prior_prefix_rows" in held:
            return held["prior_prefix_rows"].shape[-1]
        if "prior_offsets" in held:
            return ((held["prior_offsets"].shape[1] + 1) // 2) * ((held["prior_offsets"].shape[2] + 1) // 2)
        return 0

    def __deepcopy__(self, memo: dict) -> HFPrior:
        """A copy that serves the same attention module, or that module's copy where the whole model is copied:
        PEFT copies the prior alone (``modules_to_save``), which must not copy the model's weights with it."""
        module = self._module[0]
        memo[id(self._module)] = [memo.get(id(module), module)]
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        return copied

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """M, and beside it its scale and whether it trains (``prior_scale``, ``prior_trainable``)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.has_prior:
            destination[prefix + _SCALE_KEY] = torch.tensor(float(self.prior_scale))
            destination[prefix + _TRAINABLE_KEY] = torch.tensor(self._trainable())

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """The saved prior as it was saved: its shape (one M for all heads or one per head), scale and trainability
        replace the layer's."""
        _load_prior(self, state_dict, prefix, args)
        trainable = state_dict.get(prefix + _TRAINABLE_KEY)
        if trainable is not None:
            for param in _prior_parameters(self):
                param.requires_grad_(bool(trainable))
            _drop_unexpected(args, prefix + _TRAINABLE_KEY)
        if self.has_prior:
            self._record({"scale": float(self.prior_scale), "trainable": self._trainable()})

    def _trainable(self) -> bool:
        return any(param.requires_grad for param in _prior_parameters(self))

    def _projections(self, grad: bool = False) -> tuple[Tensor | None, ...]:
        """Wq, Wk, Wv (inner, dim), Wproj (dim, inner) in (out, in) layout, and the query and key biases (None where
        absent); with ``grad`` the same views of the parameters' gradients (None where there is none yet)."""
        def read(param: Tensor | None) -> Tensor | None:
            return param.grad if grad and param is not None else param

        module, inner = self._module[0], self.inner_dim
        if hasattr(module, "c_attn") and hasattr(module, "c_proj"):  # GPT-2: Conv1D weights are (in, out)
            w, b, o = read(module.c_attn.weight), read(module.c_attn.bias), read(module.c_proj.weight)
            q, k, v = (None, None, None) if w is None else (w.T[:inner], w.T[inner : 2 * inner], w.T[2 * inner :])
            qb, kb = (None, None) if b is None else (b[:inner], b[inner : 2 * inner])
            return q, k, v, None if o is None else o.T, qb, kb
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
            raise ValueError(f"{type(module).__name__} has neither GPT-2's c_attn/c_proj nor q_proj/k_proj/v_proj/"
                             "o_proj: its query/key weights cannot be reached")
        q, k, v, o = (getattr(module, n) for n in names)
        if k.out_features != inner:
            raise ValueError(f"{type(module).__name__} uses grouped-query attention ({k.out_features // self.head_dim} "
                             f"key/value heads for {self.num_heads} query heads): there is no Wk per query head to "
                             "write or measure; set num_key_value_heads to num_attention_heads")
        return read(q.weight), read(k.weight), read(v.weight), read(o.weight), read(q.bias), read(k.bias)

    @property
    def has_query_key_weights(self) -> bool:
        module = self._module[0]
        if hasattr(module, "c_attn") and hasattr(module, "c_proj"):
            return True
        k = getattr(module, "k_proj", None)
        return isinstance(k, nn.Linear) and k.out_features == self.inner_dim

    def query_key_weights(self, grad: bool = False) -> tuple[Tensor, Tensor]:
        q, k = self._projections(grad)[:2]
        if q is None or k is None:
            return None, None
        return q.unflatten(0, (self.num_heads, self.head_dim)), k.unflatten(0, (self.num_heads, self.head_dim))

    def value_output_weights(self) -> tuple[Tensor, Tensor]:
        return self._projections()[2:4]

    def query_key_biases(self) -> tuple[Tensor, ...]:
        return tuple(b for b in self._projections()[4:] if b is not None)


def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


POSITIONS_ARGUMENT = "maskprior_positions"  # each query's position in its own sequence (_positions_hook)

# Arguments an attention function may receive that carry no term of the attention: the cache's and the layer's
# bookkeeping, whatever release passes them. An argument outside these and the library's common ones
# (``TransformersKwargs``) may be a term the injected attention would not compute, so it is refused by name.
_BOOKKEEPING = frozenset({"dropout", "scaling", "use_cache", "cache", "past_key_values", "past_key_value",
                          "cache_position", "layer_idx", "output_attentions", "head_mask", POSITIONS_ARGUMENT})
_COMPUTED = frozenset({"softcap", "s_aux", "sliding_window"})  # computed here, or already in the mask


def _known_arguments() -> frozenset[str]:
    """The keyword arguments ``maskprior_attention`` accepts: the library's common ones, the bookkeeping ones and
    those it computes (``softcap``, the sinks ``s_aux``) or its mask already holds (``sliding_window``)."""
    from transformers.utils import TransformersKwargs

    return frozenset(TransformersKwargs.__annotations__) | _BOOKKEEPING | _COMPUTED


def _sequence_positions(args: tuple, kwargs: dict) -> Tensor | None:
    """Each query token's position within its own sequence, (batch or 1, queries), from what the decoder is called
    with: the 2-D attention mask (its real tokens counted, over the cache and the new tokens: left or right padding
    shifts no sequence), else ``position_ids`` (packed sequences restart there), else the tokens the cache holds.
    None where the call gives no tokens to count (the attention then counts the keys its mask opens)."""
    inputs = kwargs.get("input_ids", args[0] if args else None)
    inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
    if not isinstance(inputs, Tensor) or inputs.dim() < 2:
        return None
    queries = inputs.shape[1]
    mask, position_ids = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if isinstance(mask, Tensor) and mask.dim() == 2:
        return (mask.long().cumsum(-1) - 1)[:, -queries:]
    if isinstance(position_ids, Tensor) and position_ids.dim() == 2:
        return position_ids
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    seen = cache.get_seq_length() if cache is not None else 0
    return (torch.arange(queries, device=inputs.device) + seen)[None]


@torch.compiler.disable
def _check_positions(positions: Tensor, size: int) -> None:
    """Refuse a token past the prior: one host synchronisation per forward pass (run eagerly under compilation)."""
    last = int(positions.max())
    if last >= size:
        raise ValueError(f"prior is {size}x{size} but the attention sees a token at position {last} (positions 0 to "
                         f"{size - 1})")


def _positions_hook(decoder: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the decoder (``model.base_model``): give its attention functions each query's position in
    its own sequence (``maskprior_positions``), after checking that none is past the smallest prior."""
    sizes = [prior.prior_size for module in _hf_attention_modules(decoder) if (prior := _prior_of(module))
             and prior.has_prior]
    if not sizes:
        return None
    positions = _sequence_positions(args, kwargs)
    if positions is None:
        return None
    _check_positions(positions, min(sizes))
    return args, {**kwargs, POSITIONS_ARGUMENT: positions}


def _prior_at_positions(bias: Tensor, query: Tensor, key: Tensor, attention_mask: Tensor | None,
                        positions: Tensor | None) -> Tensor:
    """The prior's rows at the queries' positions and columns at the keys' positions: (B or 1, heads or 1, q, kv).

    A query's position is its place in its own sequence (``positions``, from ``_positions_hook``; without them the
    number of keys its mask row opens, less one). A key's position is counted back from the query's along the row
    of the model's mask: the keys a query sees are, in slot order, the tokens of its own sequence up to itself
    (or its sliding window), one position each, whatever the cache holds and wherever padding or another packed
    sequence sits. Keys a query does not see are clamped into the prior; the mask keeps them closed. Nothing here
    reads a value back to the host, and no index leaves the prior.
    """
    n, q_len, kv_len = bias.shape[-1], query.shape[2], key.shape[2]
    if attention_mask is None:  # causal, no padding: the queries are the last slots
        slots = torch.arange(kv_len, device=query.device)
        opened = (slots[None, :] <= slots[-q_len:, None])[None]
    else:
        row = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask
        if row.shape[0] > 1 and row.stride(0) == 0:  # one mask for the whole batch: count it once
            row = row[:1]
        opened = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    seen = opened.cumsum(-1)  # (B, q, kv): keys opened so far in each query's row
    count = seen[..., -1:]
    rows = count - 1 if positions is None else positions.reshape(-1, q_len, 1).to(seen.dtype)
    columns = (rows - count + seen).clamp(0, n - 1)
    rows = rows.clamp(0, n - 1).expand(columns.shape[0], q_len, 1)
    picked = bias[:, rows[..., 0]]  # (heads, B, q, n)
    return picked.gather(-1, columns.expand(bias.shape[0], *columns.shape)).transpose(0, 1)


def _probabilities(query: Tensor, keys: Tensor, additive: Tensor | None, scale: float | None,
                   softcap: float | None, sinks: Tensor | None) -> Tensor:
    """The attention probabilities with the model's extra terms, as its own eager attention computes them: the
    logits soft-capped (``softcap * tanh(logits / softcap)``) before the mask and the prior are added; a sink per
    head (``sinks``) taking a share of each row's softmax and giving nothing back."""
    if softcap is None and sinks is None:  # scale None: SDPA's default, 1 / sqrt(head width)
        return PriorAttention.reference_probs(query, keys, additive, is_causal=False, scale=scale)
    logits = (query @ keys.transpose(-2, -1)).float() * (query.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if additive is not None:
        logits = logits + additive
    if sinks is None:
        return softmax_rows(logits).to(query.dtype)
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    return softmax_rows(torch.cat([logits, sink], dim=-1))[..., :-1].to(query.dtype)


def maskprior_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                        **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """transformers' attention function for an injected prior: the model's mask (causal and padding, additive,
    from ``eager_mask``) plus ``log sigmoid(s M)`` at the tokens' positions (:func:`_prior_at_positions`).

    Where the project's own layers use their explicit kernel (a CPU, :func:`~lightning_maskprior.attention.kernel_for`)
    and there is a prior, it computes the attention the same way: the logits in float32 with the mask and the prior
    added, so under bf16 autocast neither the sum nor M's gradient is rounded to 8 bits, and no grad-requiring mask
    sends SDPA to its unfused math kernel. A model with soft-capping or sinks always takes this path (SDPA computes
    neither). Elsewhere, and without a prior, the library's own SDPA attention runs.

    An argument it does not know is a term of the model's attention it would not compute: refused, by name.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    unknown = kwargs.keys() - _known_arguments()
    if unknown:
        raise ValueError(f"{type(module).__name__} passes {sorted(unknown)} to its attention function, terms the "
                         "injected prior's attention does not compute; inject_prior cannot carry a prior in it")
    softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
    positions = kwargs.pop(POSITIONS_ARGUMENT, None)
    prior = _prior_of(module)
    bias = prior.attention_bias() if prior is not None else None
    recording = prior is not None and prior.record_attention
    if bias is not None:
        bias = _prior_at_positions(bias, query, key, attention_mask, positions)
    extra_terms = softcap is not None or sinks is not None
    explicit = extra_terms or (bias is not None and kernel_for(query.device.type) == "explicit")
    if explicit or recording:
        groups = getattr(module, "num_key_value_groups", 1)
        keys, values = (repeat_kv(key, groups), repeat_kv(value, groups)) if groups > 1 else (key, value)
        additive = None  # the model's mask and the prior, added to the logits in float32
        for term in (attention_mask, bias):
            if term is not None:
                additive = term.float() if additive is None else additive + term
        probs = _probabilities(query, keys, additive, kwargs.get("scaling"), softcap, sinks)
        if recording:
            prior.last_attention = probs.detach()
        if explicit:
            out = F.dropout(probs, kwargs.get("dropout") or 0.0) @ values
            return out.transpose(1, 2).contiguous(), None
    if bias is not None:
        bias = bias.to(query.dtype)
        attention_mask = bias if attention_mask is None else attention_mask + bias
    return sdpa_attention_forward(module, query, key, value, attention_mask, **{**kwargs, "is_causal": False})


def _prior_of(module: nn.Module) -> HFPrior | None:
    """The prior acting in an attention module: its ``maskprior``, or under PEFT (``modules_to_save=["maskprior"]``)
    the copy of the active adapter (the original where adapters are disabled)."""
    prior = getattr(module, HF_IMPLEMENTATION, None)
    copy_run = active_copy(prior) if isinstance(prior, nn.Module) else None
    prior = prior if copy_run is None else copy_run  # PEFT's ModulesToSaveWrapper runs one of its copies
    return prior if isinstance(prior, HFPrior) else None


def _register_hf() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(HF_IMPLEMENTATION, maskprior_attention)
    AttentionMaskInterface.register(HF_IMPLEMENTATION, eager_mask)  # always an additive mask the prior adds to


def _hf_attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")
            and not isinstance(m, PriorCarrier)]


def _unsupported_feature(model: nn.Module, layers: list[nn.Module]) -> str | None:
    """What ``model``'s attention computes that the injected attention would not (None: nothing found)."""
    config = model.config
    attention_config = getattr(config, "attn_config", None)  # MPT keeps its attention options apart
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder architecture"
    if getattr(config, "add_cross_attention", False) or any(getattr(m, "is_cross_attention", False) for m in layers):
        return "cross-attention"
    if (getattr(config, "alibi", False) or getattr(attention_config, "alibi", False)
            or getattr(config, "position_embedding_type", None) == "alibi" or config.model_type == "bloom"):
        return "ALiBi position biases"
    if (getattr(config, "relative_attention_num_buckets", None) or getattr(config, "position_bias_num_buckets", None)
            or str(getattr(config, "position_embedding_type", "")).startswith("relative")):
        return "relative position biases of its own"
    both_ways = sorted({type(m).__name__ for m in layers if getattr(m, "is_causal", False) is not True})
    if both_ways or not getattr(config, "is_causal", True):
        return f"attention both ways ({', '.join(both_ways) or 'config.is_causal'} is not causal)"
    if not getattr(model, "_supports_attention_backend", False):
        return "an attention it computes in its own code, not through transformers' attention functions"
    return None


def _inject_hf(model: nn.Module) -> None:
    config = model.config
    layers = _hf_attention_modules(model)
    feature = _unsupported_feature(model, layers)
    if feature is not None:
        raise ValueError(f"{type(model).__name__} uses {feature}, which the injected prior's attention does not "
                         "compute; inject_prior supports decoder-only causal language models whose attention runs "
                         f"through transformers' attention functions (tested: {TESTED_FAMILIES})")
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention module inject_prior can carry a prior in")
    _register_hf()
    previous = config._attn_implementation
    if previous != HF_IMPLEMENTATION:
        _warn_flash(model, previous)
        try:
            model.set_attn_implementation(HF_IMPLEMENTATION)
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{type(model).__name__} does not run its attention through transformers' attention "
                             f"registry ({err}); inject_prior cannot add a prior to it") from None
        model._maskprior_previous_attention = previous or "sdpa"
        _probe(model)
    for index, layer in enumerate(layers):
        if not isinstance(getattr(layer, HF_IMPLEMENTATION, None), HFPrior):
            heads = int(getattr(layer, "num_heads", None) or config.num_attention_heads)
            head_dim = int(getattr(layer, "head_dim", None) or config.hidden_size // heads)
            layer.maskprior = HFPrior(layer, heads, head_dim, int(config.hidden_size), index)
    if getattr(model, "_maskprior_hook", None) is None:
        model._maskprior_hook = model.base_model.register_forward_pre_hook(_positions_hook, with_kwargs=True)


def _warn_flash(model: nn.Module, previous: str | None) -> None:
    """Flash attention takes no additive term: the model switches to the injected attention, and says so once."""
    if previous and "flash" in previous:
        warnings.warn(f"{type(model).__name__} was set to {previous}, which cannot add a prior to its logits; "
                      f"inject_prior switches it to the injected attention ({HF_IMPLEMENTATION}: SDPA or the explicit "
                      "kernel), and remove_prior switches it back", stacklevel=4)


def _probe(model: nn.Module) -> None:
    """One forward pass of two tokens, without a prior and without touching any random state: a model whose own
    code cannot run the injected attention is refused now, with the model set back as it was."""
    parameter = next(model.parameters())
    if parameter.is_meta:  # not materialised yet: nothing can run
        return
    tokens = torch.zeros(1, 2, dtype=torch.long, device=parameter.device)
    devices = [parameter.device] if parameter.device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(input_ids=tokens, use_cache=False)
    except Exception as err:
        model.set_attn_implementation(model.__dict__.pop("_maskprior_previous_attention"))
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{type(model).__name__} cannot run the injected prior's attention (a forward pass fails: "
                         f"{type(err).__name__}: {first}); inject_prior supports decoder-only causal language "
                         f"models whose attention runs through transformers' attention functions (tested: "
                         f"{TESTED_FAMILIES})") from None


def _remove_hf(model: nn.Module) -> nn.Module:
    """Back to the model's own attention; the first step that can fail (setting the attention back) comes first, so
    a failure leaves the model injected as it was."""
    previous = getattr(model, "_maskprior_previous_attention", None)
    if previous is not None:
        try:
            model.set_attn_implementation(previous)
        except (ValueError, ImportError) as err:
            raise ValueError(f"remove_prior cannot set {type(model).__name__}'s attention back to {previous} "
                             f"({err}); the model keeps its priors") from None
        del model._maskprior_previous_attention
    for layer in _hf_attention_modules(model):
        if HF_IMPLEMENTATION in layer._modules:
            del layer._modules[HF_IMPLEMENTATION]
    if getattr(model.config, HF_IMPLEMENTATION, None) is not None:
        setattr(model.config, HF_IMPLEMENTATION, None)
    hook = getattr(model, "_maskprior_hook", None)
    if hook is not None:
        hook.remove()
        del model._maskprior_hook
    return model


# ------------------------------------------------------------------------------------------ save and load
def load_injected(path: str | Path, model_class: type | None = None, **from_pretrained: Any) -> nn.Module:
    """A Hugging Face model saved with ``save_pretrained`` after :func:`inject_prior`, with its priors.

        inject_prior(model, structure, init="mask", scale=10.0)
        model.save_pretrained("dir")
        model = load_injected("dir")                # in another process: M, its scale and layout come back

    ``from_pretrained`` builds the model and its weights; the priors are then injected and each M is read from the
    saved weights, with the scale and trainability ``config.json`` recorded for it. A directory saved without a
    prior gives the model injected with none.

    Args:
        path: A local directory written by ``save_pretrained`` (safetensors; nothing is downloaded).
        model_class: The class to load with (default: ``AutoModelForCausalLM``); the one that was saved.
        from_pretrained: More arguments for ``from_pretrained`` (``dtype``, ``attn_implementation``...).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory; load_injected expects one written by save_pretrained")
    from lightning_maskprior.checkpoints import check_weights_directory

    check_weights_directory(path, "load_injected")  # a weights file cut short: a CheckpointError naming it
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    with _load_report_held() as held:
        model, info = model_class.from_pretrained(path, output_loading_info=True, local_files_only=True,
                                                  **from_pretrained)
    problems = [k for k in info.get("unexpected_keys", ()) if f".{HF_IMPLEMENTATION}." not in k]
    if problems or info.get("missing_keys") or info.get("mismatched_keys"):
        for record in held:  # the library's report, as it would have been shown
            logging.getLogger(record.name).handle(record)
    records = getattr(model.config, HF_IMPLEMENTATION, None) or {}
    setattr(model.config, HF_IMPLEMENTATION, None)
    from lightning_maskprior.checkpoints import non_finite_priors

    inject_prior(model)
    priors = _saved_priors(path)
    bad = non_finite_priors({"state_dict": priors})
    if bad is not None:
        raise ValueError(f"{path} holds a prior that is not finite: {bad}; expected finite prior logits (saved from "
                         "a diverged model, or edited)")
    model.load_state_dict(priors, strict=False)
    for layer in attention_layers(model):
        record = records.get(str(layer.index))
        if not _has_prior(layer):
            if record is not None:
                raise ValueError(f"{path}'s config.json records a prior for attention module {layer.index}, but its "
                                 "weights hold none")
            continue
        scale = record.get("scale") if isinstance(record, dict) else None
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not torch.isfinite(torch.tensor(scale)):
            raise ValueError(f"{path}'s config.json records no scale for the prior of attention module {layer.index} "
                             f"({HF_IMPLEMENTATION}.{layer.index}: {record!r}); expected the config.json "
                             "save_pretrained wrote with the prior ({\"scale\": ..., \"trainable\": ...})")
        layer.prior_scale = float(scale)
        for param in _prior_parameters(layer):
            param.requires_grad_(bool(record.get("trainable", True)))
        layer._record(record)
    return model


def _saved_priors(path: Path) -> dict[str, Tensor]:
    """The prior tensors (``...maskprior.prior_*``) of the safetensors weights ``save_pretrained`` wrote in ``path``."""
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    index = path / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / SAFE_WEIGHTS_NAME).is_file():
        files = [SAFE_WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"{path} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}: load_injected "
                                "reads the safetensors weights save_pretrained writes")
    priors = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as weights:
            priors.update({k: weights.get_tensor(k) for k in weights.keys() if f".{HF_IMPLEMENTATION}.prior_" in k})
    return priors


@contextmanager
def _load_report_held() -> Iterator[list[logging.LogRecord]]:
    """Hold back transformers' loading report within the block (it would call the saved priors unexpected keys);
    the held records are yielded, for the caller to show when something else was reported."""
    held: list[logging.LogRecord] = []

    class Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if "LOAD REPORT" in record.getMessage():
                held.append(record)
                return False
            return True

    logger, hold = logging.getLogger("transformers.modeling_utils"), Hold()
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)

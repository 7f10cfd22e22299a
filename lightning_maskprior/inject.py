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
  (GPT-2, and the Llama family: Llama, Qwen2, Mistral...): each attention module gets a :class:`HFPrior` (holding
  M) and the model runs the ``maskprior`` attention function, which adds ``log sigmoid(s M)`` to the model's own
  causal and padding mask and hands over to the library's SDPA attention (on a CPU, with a prior, it computes the
  attention as the project's explicit kernel does). Needs ``pip install ".[hf]"``.

Anything else that attends is refused, naming its class.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_maskprior.attention import PriorAttention, PriorCarrier, attention_layers, kernel_for
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


def inject_prior(model: nn.Module, structure: Structure | None = None, init: str | None = None,
                 **init_options: Any) -> nn.Module:
    """Make every attention layer of ``model`` a PriorAttention with the same weights; returns ``model``.

    Args:
        model: A timm model built from ``timm.layers.Attention`` (e.g. ``vit_*``, ``deit_*``), trained or not.
        structure: The structure M starts from (``init``); its sequence must be the model's (prefix tokens
            included: ``Structure.pad``), one pattern per head or one for all.
        init: An init method (``mask``, ``zero``, ``fixed``, ``default``...) applied after the injection; default:
            ``mask`` when a structure is given, else none (the layers carry no prior: the model is unchanged).
        init_options: The init method's options (e.g. ``open_value``, ``closed_value``, ``trainable``).

    Layers that are PriorAttention already are left as they are, so injecting twice is harmless.
    """
    if _is_hf_model(model):
        _inject_hf(model)
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
    return _init(model, structure, init, init_options)


def _init(model: nn.Module, structure: Structure | None, init: str | None, options: dict[str, Any]) -> nn.Module:
    init = init or ("mask" if structure is not None else None)
    if init is not None:
        from lightning_maskprior.inits import apply_init

        apply_init(init, model, structure, **options)
    return model


def export_prior(model: nn.Module) -> list[Tensor | None]:
    """The prior logits M of each attention layer, in forward order (a detached copy; None where there is none)."""
    return [None if layer.prior_logits is None else layer.prior_logits.detach().clone()
            for layer in attention_layers(model)]


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


class HFPrior(PriorCarrier):
    """The prior of one Hugging Face attention module, held as ``module.maskprior``: M and what the callbacks read.
    The module's own projections stay where they are; ``maskprior_attention`` adds the prior to its logits.

    Its query/key and value/output weights are views into the module's own projections, so the structure-free and
    query/key inits (``mimetic``, ``qk_svd``, ``qk_opt``) write the model itself: GPT-2's fused ``c_attn`` /
    ``c_proj`` (``Conv1D``, stored (in, out)) and the Llama family's ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``.
    Grouped-query attention (fewer key/value heads than query heads) has no per-head Wk to write; those inits
    refuse it.
    """

    def __init__(self, module: nn.Module, num_heads: int, head_dim: int, dim: int) -> None:
        super().__init__(num_heads)
        self._module = [module]  # a list: the attention module owns this one, not the other way round
        self.dim, self.head_dim, self.inner_dim = dim, head_dim, num_heads * head_dim

    def _reference(self) -> Tensor:
        return next(self._module[0].parameters())

    def attention_module(self) -> nn.Module:
        return self._module[0]

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


def maskprior_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                        **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """transformers' attention function for an injected prior: the model's mask (causal and padding, additive,
    from ``eager_mask``) plus ``log sigmoid(s M)``.

    Where the project's own layers use their explicit kernel (a CPU, :func:`~lightning_maskprior.attention.kernel_for`)
    and there is a prior, it computes the attention the same way: the logits in float32 with the mask and the prior
    added, so under bf16 autocast neither the sum nor M's gradient is rounded to 8 bits, and no grad-requiring mask
    sends SDPA to its unfused math kernel. Elsewhere, and without a prior, the library's own SDPA attention runs.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    prior = getattr(module, "maskprior", None)
    bias = prior.attention_bias() if isinstance(prior, HFPrior) else None
    recording = isinstance(prior, HFPrior) and prior.record_attention
    if bias is not None:
        q_len, kv_len, n = query.shape[2], key.shape[2], bias.shape[-1]
        if kv_len > n:
            raise ValueError(f"prior is {n}x{n} but the attention sees {kv_len} tokens")
        bias = bias[None, :, kv_len - q_len:kv_len, :kv_len]  # the query rows of a KV cache
    explicit = bias is not None and kernel_for(query.device.type, query.dtype) == "explicit"
    if explicit or recording:
        groups = getattr(module, "num_key_value_groups", 1)
        keys, values = (repeat_kv(key, groups), repeat_kv(value, groups)) if groups > 1 else (key, value)
        additive = None  # the model's mask and the prior, added to the logits in float32
        for term in (attention_mask, bias):
            if term is not None:
                additive = term.float() if additive is None else additive + term
        # scaling None: SDPA's default, 1 / sqrt(head width)
        probs = PriorAttention.reference_probs(query, keys, additive, is_causal=False, scale=kwargs.get("scaling"))
        if recording:
            prior.last_attention = probs.detach()
        if explicit:
            out = F.dropout(probs, kwargs.get("dropout") or 0.0) @ values
            return out.transpose(1, 2).contiguous(), None
    if bias is not None:
        bias = bias.to(query.dtype)
        attention_mask = bias if attention_mask is None else attention_mask + bias
    return sdpa_attention_forward(module, query, key, value, attention_mask, **{**kwargs, "is_causal": False})


def _register_hf() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(HF_IMPLEMENTATION, maskprior_attention)
    AttentionMaskInterface.register(HF_IMPLEMENTATION, eager_mask)  # always an additive mask the prior adds to


def _hf_attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")
            and not isinstance(m, PriorCarrier)]


def _inject_hf(model: nn.Module) -> None:
    config = model.config
    layers = _hf_attention_modules(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention module inject_prior can carry a prior in")
    not_causal = sorted({type(m).__name__ for m in layers if getattr(m, "is_causal", False) is not True})
    if getattr(config, "is_encoder_decoder", False) or not_causal:
        which = ", ".join(not_causal) or "an encoder-decoder"
        raise ValueError(f"{type(model).__name__} is not a decoder-only causal model ({which} attends both ways); "
                         "inject_prior supports Hugging Face causal language models (GPT-2, Llama, Qwen2, Mistral...)")
    _register_hf()
    previous = config._attn_implementation
    if previous != HF_IMPLEMENTATION:
        try:
            model.set_attn_implementation(HF_IMPLEMENTATION)
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{type(model).__name__} does not run its attention through transformers' attention "
                             f"registry ({err}); inject_prior cannot add a prior to it") from None
        model._maskprior_previous_attention = previous or "sdpa"
    for layer in layers:
        if not isinstance(getattr(layer, "maskprior", None), HFPrior):
            heads = int(getattr(layer, "num_heads", None) or config.num_attention_heads)
            head_dim = int(getattr(layer, "head_dim", None) or config.hidden_size // heads)
            layer.maskprior = HFPrior(layer, heads, head_dim, int(config.hidden_size))


def _remove_hf(model: nn.Module) -> nn.Module:
    for layer in _hf_attention_modules(model):
        if isinstance(getattr(layer, "maskprior", None), HFPrior):
            del layer.maskprior
    previous = getattr(model, "_maskprior_previous_attention", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        del model._maskprior_previous_attention
    return model

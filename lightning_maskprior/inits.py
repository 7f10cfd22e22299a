"""Where a structure goes: one function per init method, in one registry.

An init method takes the backbone (any module holding PriorAttention layers, or injected ones), the task's Structure
(or None) and its own keyword options, and changes the backbone in place. ``mask``, ``zero`` and
``fixed`` put the structure into the additive prior; the query/key baselines (``qk_svd``,
``qk_opt``, ``impulse``) put it into Wq/Wk; ``mimetic`` needs no structure.

Any init method, the project's or one of your own (``--model.init my_pkg.inits:my_init``), follows one contract,
:class:`InitMethod`; the query/key inits read the backbone's hooks that
:class:`~lightning_maskprior.contracts.QueryKeyBackbone` documents (``positional_embedding``,
``scale_positional_embedding``, ``attention_norms``, and ``example_inputs`` and ``patch_grid`` where an option
needs them), and leave its ``num_prefix_tokens`` (a CLS token, registers) out of their fit. ``TokenTransformer``
implements all but ``patch_grid``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import typing
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from jsonargparse.typing import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from torch import Tensor, nn

from lightning_maskprior import contracts
from lightning_maskprior.attention import PriorCarrier, attention_layers, attention_probabilities
from lightning_maskprior.plugins import PluginError, leading, parameters_of, registrar, resolve, shown, without_default
from lightning_maskprior.priors import IMPULSE_OFFSETS, Structure, check_open_closed, grid_impulse


class InitMethod(Protocol):
    """Where a structure goes: ``fn(backbone, structure, **options)`` changes the backbone in place.

    ``backbone`` is a :class:`~lightning_maskprior.contracts.PriorBackbone`; ``structure`` is the task's
    :class:`~lightning_maskprior.priors.Structure` mapped onto the attention's sequence (None where the task has
    none). Every option after them has a default (``model.init_options`` and the task's ``init_defaults`` override
    them), and their annotations give their checks (``PositiveFloat`` and the other constrained types of
    jsonargparse give ranges). Register one with ``register_init(name, uses_structure=...)``, or name it by import
    path (``--model.init my_pkg.inits:my_init``).

    Attributes:
        uses_structure: True where the method places the structure (it then needs one, and gets the task's as it
            is); False or absent where it only measures against it (the structure's heads are then merged where they
            do not fit the model's). ``register_init`` sets it; a function named by import path sets it itself.
    """

    uses_structure: bool

    def __call__(self, backbone: Any, structure: Structure | None, /, **options: Any) -> None: ...


def check_init(name: str, fn: Any) -> None:
    """A PluginError naming init method ``name`` where ``fn`` is not an :class:`InitMethod`."""
    expected = "fn(backbone, structure, **options) (see lightning_maskprior.inits.InitMethod)"
    params = parameters_of("init method", name, fn, expected)
    given, options = leading(params, 2)
    if len(given) < 2:
        raise PluginError(f"init method {name!r} takes ({shown(params)}); expected {expected}: its first two "
                          "parameters receive the backbone and the task's Structure (or None)")
    required = without_default(options)
    if required:
        raise PluginError(f"init method {name!r}: option(s) {', '.join(required)} have no default; expected a default "
                          "for every option after (backbone, structure) (init_options override them)")
    flag = getattr(fn, "uses_structure", False)
    if not isinstance(flag, bool):
        raise PluginError(f"init method {name!r}: uses_structure must be True or False, got {flag!r}")


def uses_structure(fn: Any) -> bool:
    """Whether init method ``fn`` places the structure (:attr:`InitMethod.uses_structure`)."""
    return bool(getattr(fn, "uses_structure", False))


INIT_METHODS: dict[str, InitMethod] = {}
_register = registrar("init", INIT_METHODS, "init method", check_init)


def register_init(name: str, uses_structure: bool = False) -> Callable[[InitMethod], InitMethod]:
    """Decorator: register ``fn(backbone, structure, **options)`` under ``name`` (the contract:
    :class:`InitMethod`, checked now).

    Args:
        name: The name ``model.init`` takes.
        uses_structure: The method places the task's structure (``mask``, ``qk_svd``...): it needs one, and gets it
            as the task gives it. False: it only measures against it (``default``, ``mimetic``...).
    """

    def decorator(fn: InitMethod) -> InitMethod:
        fn.uses_structure = uses_structure or bool(getattr(fn, "uses_structure", False))
        return _register(name)(fn)

    return decorator


def get_init(name: str) -> InitMethod:
    """Init method ``name``: a registered one, or ``module.path:function`` of your own (``plugins.resolve``)."""
    return resolve("init", name)


def check_init_options(name: str, options: dict) -> InitMethod:
    """Init method ``name``, once ``options`` are known to be its own, of its types and in its ranges (declared in
    its signature); a ValueError naming the option and what it expects otherwise."""
    fn = get_init(name)
    accepted = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(set(options) - set(accepted)) if not takes_any else []
    if unknown:
        valid = sorted(k for k in accepted if k not in ("backbone", "structure"))
        raise ValueError(f"init method {name!r} got unknown options {unknown}; it accepts {valid}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - a function of your own may annotate with names it imports only for checkers
        hints = {}
    for key, value in options.items():
        if key in accepted:
            _check_option_type(name, key, value, accepted[key], hints.get(key))
    return fn


_RESTORING: ContextVar[bool] = ContextVar("restoring_weights", default=False)


@contextlib.contextmanager
def restoring_weights(restoring: bool = True) -> Iterator[None]:
    """Within it, the modules built take their weights from a checkpoint next (a resumed fit, ``test`` or ``predict``
    with ``--ckpt_path``, ``load_from_checkpoint``): an init skips work whose only result is weights the checkpoint
    replaces (QK-Opt's fit), and keeps what the checkpoint does not hold (which priors exist, which are trained).
    ``restoring=False`` undoes it inside, for modules that train from their init (a structure estimator's)."""
    token = _RESTORING.set(restoring)
    try:
        yield
    finally:
        _RESTORING.reset(token)


def weights_restored() -> bool:
    """Whether the module being built takes its weights from a checkpoint next (:func:`restoring_weights`). An init
    of your own may skip fitting weights then; whatever is not in the model's ``state_dict`` it must still set."""
    return _RESTORING.get()


def apply_init(name: str, backbone: nn.Module, structure: Structure | None, **options) -> None:
    """Apply init method ``name`` to ``backbone`` with ``structure`` and method-specific options."""
    fn = check_init_options(name, options)
    layers = attention_layers(backbone)
    if not layers:
        raise ValueError(f"{type(backbone).__name__} has no attention layer that carries a prior "
                         "(PriorAttention, or one that inject_prior added)")
    if uses_structure(fn) and structure is None:
        raise ValueError(f"init method {name!r} needs a structure, but the task gave none")
    fn(backbone, structure, **options)


# The ranges of init options, declared once in the init functions' signatures with jsonargparse's constrained
# types, and what an error says each one expects.
RANGES: dict[type, str] = {PositiveFloat: "a number > 0", NonNegativeFloat: "a number >= 0",
                           PositiveInt: "a whole number > 0", NonNegativeInt: "a whole number >= 0"}


def _check_option_type(init: str, key: str, value, param: inspect.Parameter, hint: object = None) -> None:
    """A number where the init method takes a number, an integer where it takes one (YAML gives strings as is),
    in the range its constrained type declares (``PositiveFloat``: > 0, ...)."""
    if hint in RANGES:
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        try:
            if not number:
                raise ValueError
            hint(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"init method {init!r}: init_options.{key} must be {RANGES[hint]}, got {value!r}") from None
        return
    annotation = param.annotation.__name__ if isinstance(param.annotation, type) else str(param.annotation)
    annotation = annotation.replace(" ", "")
    kind = next((k for k in ("bool", "int", "float") if annotation in (k, f"{k}|None", f"None|{k}")), None)
    if kind is None or (value is None and "None" in annotation):
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    fits = {"bool": isinstance(value, bool), "int": number and isinstance(value, int), "float": number}[kind]
    if not fits:
        expected = {"bool": "true or false", "int": "an integer", "float": "a number"}[kind]
        raise ValueError(
            f"init method {init!r}: init_options.{key} must be {expected}, got {value!r} ({type(value).__name__})"
        )
    if kind == "float" and not math.isfinite(value):
        raise ValueError(f"init method {init!r}: init_options.{key} must be a finite number, got {value!r}")


def _structure_layers(backbone: nn.Module, structure: Structure) -> list[tuple[PriorCarrier, torch.Tensor]]:
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


def _apply_extras(backbone: nn.Module, init: str, pos_scale: float, value_alpha: float, value_beta: float,
                  qk_gain: float) -> None:
    """The parts of the impulse init that are not its structure, for ablations: positions x
    ``pos_scale``, mimetic values ``Wproj Wv ~ value_alpha Z - value_beta I`` and the random Wq, Wk x ``qk_gain``.
    The defaults (1, 0, 0, 1) leave the backbone untouched and draw no random numbers."""
    if pos_scale != 1.0:
        _backbone_method(backbone, "scale_positional_embedding", init)(pos_scale)
    for layer in attention_layers(backbone):
        if value_alpha or value_beta:
            _mimetic_value(layer, value_alpha, value_beta)
        if qk_gain != 1.0:
            with torch.no_grad():
                for weight in layer.query_key_weights():  # views into the fused qkv projection
                    weight.mul_(qk_gain)


def _install_prior(backbone: nn.Module, structure: Structure, open_value: float, closed_value: float,
                   scale: float, trainable: bool) -> None:
    """M of every layer from the structure (``mask``: trainable; ``fixed``: frozen)."""
    for index, (layer, open) in enumerate(_structure_layers(backbone, structure)):
        layer.set_prior(_mask_logits(structure, index, open, open_value, closed_value), trainable, scale)


@register_init("default")
def default_init(backbone: nn.Module, structure: Structure | None, pos_scale: PositiveFloat = 1.0,
                 value_alpha: float = 0.0, value_beta: float = 0.0, qk_gain: PositiveFloat = 1.0) -> None:
    """The architecture's own random init; no prior (plain attention).

    ``pos_scale``, ``value_alpha``, ``value_beta`` and ``qk_gain`` add the impulse init's non-structural parts
    (positions x18, mimetic values 0.4 / 0.4, its query/key scale) for ablations; the defaults change nothing.
    """
    _apply_extras(backbone, "default", pos_scale, value_alpha, value_beta, qk_gain)
    for layer in attention_layers(backbone):
        layer.clear_prior()


@register_init("mask", uses_structure=True)
def mask_init(backbone: nn.Module, structure: Structure, open_value: float = 10.0,
              closed_value: float = -10.0, scale: PositiveFloat = 1.0, pos_scale: PositiveFloat = 1.0,
              value_alpha: float = 0.0, value_beta: float = 0.0, qk_gain: PositiveFloat = 1.0) -> None:
    """Learnable prior M: ``open_value`` on open pairs, ``closed_value`` on closed ones.

    ``pos_scale``, ``value_alpha``, ``value_beta``, ``qk_gain``: as for ``default`` (ablations; no change by default).
    """
    check_open_closed(open_value, closed_value)
    _apply_extras(backbone, "mask", pos_scale, value_alpha, value_beta, qk_gain)
    _install_prior(backbone, structure, open_value, closed_value, scale, True)


@register_init("fixed", uses_structure=True)
def fixed_init(backbone: nn.Module, structure: Structure, open_value: float = 10.0,
               closed_value: float = -10.0, scale: PositiveFloat = 1.0, pos_scale: PositiveFloat = 1.0,
               value_alpha: float = 0.0, value_beta: float = 0.0, qk_gain: PositiveFloat = 1.0) -> None:
    """The mask prior, frozen (not trained). Extras as for ``mask``."""
    check_open_closed(open_value, closed_value)
    _apply_extras(backbone, "fixed", pos_scale, value_alpha, value_beta, qk_gain)
    _install_prior(backbone, structure, open_value, closed_value, scale, False)


@register_init("zero")
def zero_init(backbone: nn.Module, structure: Structure | None, seq_len: PositiveInt | None = None) -> None:
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


# ================================================================== query/key baselines
def _backbone_method(backbone: nn.Module, name: str, init: str):
    method = getattr(backbone, name, None)
    if method is None:
        raise ValueError(
            f"init {init!r} needs {type(backbone).__name__}.{name}() (see "
            "lightning_maskprior.contracts.QueryKeyBackbone)"
        )
    return method


def _normed_positions(backbone: nn.Module, init: str) -> list[Tensor]:
    """Each attention layer's view of the positions: its pre-attention norm applied to them (N', dim)."""
    positions = _backbone_method(backbone, "positional_embedding", init)()
    norms = _backbone_method(backbone, "attention_norms", init)()
    layers = attention_layers(backbone)
    if len(norms) != len(layers):
        raise ValueError(f"backbone gave {len(norms)} attention norms for {len(layers)} attention layers")
    with torch.no_grad():
        return [norm(positions).float() for norm in norms]


def _fitted_layers(init: str, layers: list[int] | None, norm: str, count: int) -> set[int]:
    """The attention layers (0 nearest the input) whose Wq/Wk an init fits, ``layers`` or every one, once its
    ``layers`` and ``norm`` options are known to be valid."""
    if norm not in ("fitted", "default"):
        raise ValueError(f"init method {init!r}: init_options.norm must be 'fitted' or 'default', got {norm!r}")
    if layers is None:
        return set(range(count))
    valid = bool(layers) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in layers)
    if not valid:
        raise ValueError(f"init method {init!r}: init_options.layers must list attention layers among "
                         f"0..{count - 1} (the backbone has {count}), got {layers!r}")
    return set(layers)


def _set_query_key(layer: PriorCarrier, wq: Tensor, wk: Tensor, norm: str = "fitted") -> None:
    """Write per-head (heads, head_dim, dim) Wq and Wk into the layer's projections (zero-padded); zero their biases.

    ``norm="default"`` rescales each head's Wq and Wk to the Frobenius norm the layer's own init gave it."""
    q, k = layer.query_key_weights()
    with torch.no_grad():
        for target, value in ((q, wq), (k, wk)):
            if norm == "default":
                value = value * (target.norm(dim=(-2, -1)) / value.norm(dim=(-2, -1)).clamp_min(1e-12))[:, None, None]
            target.zero_()
            rows, cols = value.shape[-2], value.shape[-1]
            target[:, :rows, :cols] = value.to(target.dtype)
        for bias in layer.query_key_biases():
            bias.zero_()


def _factor(a: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Rank-``rank`` split of (..., d, d) ``a`` by SVD: ``L = U sqrt(S)`` and ``R = sqrt(S) V^T``."""
    u, s, vh = torch.linalg.svd(a)
    root = s[..., :rank].sqrt()
    return u[..., :rank] * root.unsqueeze(-2), root.unsqueeze(-1) * vh[..., :rank, :]


def _truncated_pinv(x: Tensor, rank: int) -> Tensor:
    """Pseudo-inverse of (N, dim) ``x`` keeping its ``rank`` largest singular values: (dim, N)."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    keep = torch.zeros_like(s, dtype=torch.bool)
    keep[:rank] = s[:rank] > s[0] * 1e-6
    inv = torch.where(keep, 1.0 / s.clamp_min(1e-30), torch.zeros_like(s))
    return vh.transpose(-2, -1) @ (inv.unsqueeze(-1) * u.transpose(-2, -1))


def svd_query_key(positions: Tensor, target: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """QK-SVD for one layer: Wq, Wk (heads, head_dim, dim) with ``X Wq^T Wk X^T`` proportional to ``target``.

    ``A = X^+ T X^+^T`` (X = ``positions``, (N, dim), pseudo-inverse truncated to ``head_dim``),
    ``A ~ U S V^T`` at rank ``head_dim``, ``Wq^T = U sqrt(S)``, ``Wk = sqrt(S) V^T``, each divided by
    its Frobenius norm. At rank >= rank(A) and full-row-rank X, ``X Wq^T Wk X^T = T / (|Wq| |Wk|)``.
    """
    pinv = _truncated_pinv(positions.double(), head_dim)
    a = pinv @ target.double() @ pinv.transpose(-2, -1)  # (heads, dim, dim)
    left, right = _factor(a, min(head_dim, a.shape[-1]))
    left = left / torch.linalg.matrix_norm(left, keepdim=True)
    right = right / torch.linalg.matrix_norm(right, keepdim=True)
    return left.transpose(-2, -1).float(), right.float()


def _fit_svd_layer(backbone: nn.Module, positions: Tensor, target: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """:func:`svd_query_key` over the backbone's patch/position tokens only.

    Prefix tokens (a CLS token, a ViT's register tokens: ``backbone.num_prefix_tokens``) are left out of the
    pseudo-inverse and the target, as in the reference, which fits the pattern on the patch positions
    ``pe[1:]``; their rows and columns then follow from their own embedding.
    """
    prefix = contracts.prefix_tokens(backbone)
    return svd_query_key(positions[prefix:], target[..., prefix:, prefix:], head_dim)


@register_init("qk_svd", uses_structure=True)
def qk_svd_init(backbone: nn.Module, structure: Structure, open_value: float = 10000.0,
                closed_value: float = 0.0, pos_scale: PositiveFloat = 18.0, qk_scale: PositiveFloat = 7.0,
                layers: list[int] | None = None, norm: Literal["fitted", "default"] = "fitted") -> None:
    """Structured QK by SVD (Zheng et al. 2025): the structure's logit pattern put into Wq, Wk.

    The target ``open_value``/``closed_value`` pattern is mapped through the pseudo-inverse of the
    layer-normed positional embeddings and factored by a rank-``head_dim`` SVD; Wq and Wk are
    Frobenius-normalised and multiplied by ``qk_scale``. The positional embedding is first scaled
    by ``pos_scale`` so that positions, not token content, dominate the normalised input (the
    normalisation itself undoes the scale, so the fit is unchanged). Defaults: the reference's
    (arithmetic pattern 10000 / 0, positions x18, QK x7).

    ``layers`` (0 nearest the input; default every one) are the layers that get the structure; the others keep
    the architecture's init. ``norm``: ``fitted`` keeps the fit's Wq, Wk (times ``qk_scale``); ``default`` rescales
    each head's to the Frobenius norm the architecture's init gave it (the structure in their direction alone).
    """
    check_open_closed(open_value, closed_value)
    pairs = _structure_layers(backbone, structure)
    fitted = _fitted_layers("qk_svd", layers, norm, len(pairs))
    _backbone_method(backbone, "scale_positional_embedding", "qk_svd")(pos_scale)
    for index, ((layer, open), positions) in enumerate(zip(pairs, _normed_positions(backbone, "qk_svd"), strict=True)):
        if index in fitted:
            target = torch.where(open, float(open_value), float(closed_value)).expand(layer.num_heads, -1, -1)
            wq, wk = _fit_svd_layer(backbone, positions, target, layer.head_dim)
            _set_query_key(layer, qk_scale * wq, qk_scale * wk, norm)
        layer.clear_prior()


def fit_query_key(inputs: Tensor, target: Tensor, head_dim: int, steps: int = 2000, lr: float = 1e-4,
                  renorm_every: int = 100) -> tuple[Tensor, Tensor, list[float]]:
    """QK-Opt for one layer: Adam on Wq, Wk (heads, head_dim, dim) so softmax attention matches ``target``.

    ``inputs`` (B or 1, N, dim) are what the attention sees (its normalised input); ``target``
    (heads, N, N) holds one distribution per row. Loss: MSE between ``softmax(q k^T / sqrt(head_dim))``
    and ``target``. As in the reference, the weights start uniform in +-sqrt(1 / (head_dim heads)),
    and every ``renorm_every`` steps they are rescaled to the initial mean norm of a query vector: the
    reference holds Q as (heads, dim, rank) and K as (heads, rank, dim) and normalises both over axis 1,
    so each query vector of Wq (length dim) and each input feature's column of Wk (length head_dim) gets
    that norm, and ``|Wk|_F / |Wq|_F = sqrt(dim / head_dim)``. Returns Wq, Wk and the loss every
    ``renorm_every`` steps (and the last).
    """
    heads, dim = target.shape[0], inputs.shape[-1]
    bound = (1.0 / (head_dim * heads)) ** 0.5
    wq = nn.Parameter((torch.rand(heads, head_dim, dim) * 2 - 1) * bound)
    wk = nn.Parameter((torch.rand(heads, head_dim, dim) * 2 - 1) * bound)
    norm0 = wq.detach().norm(dim=-1).mean()
    optimizer = torch.optim.Adam([wq, wk], lr=lr)
    x = (inputs if inputs.dim() == 3 else inputs.unsqueeze(0)).float().unsqueeze(1)  # (B, 1, N, dim)
    losses = []
    for step in range(steps + 1):
        if renorm_every and step % renorm_every == 0 and step < steps:
            with torch.no_grad():
                wq.mul_(norm0 / wq.norm(dim=-1, keepdim=True).clamp_min(1e-12))  # over dim: each query vector
                wk.mul_(norm0 / wk.norm(dim=-2, keepdim=True).clamp_min(1e-12))  # over head_dim, as the reference
        q, k = x @ wq.transpose(-2, -1), x @ wk.transpose(-2, -1)  # (B, heads, N, head_dim)
        probs = (q @ k.transpose(-2, -1) / head_dim**0.5).softmax(dim=-1)
        loss = F.mse_loss(probs, target.expand_as(probs))
        if step % max(1, renorm_every) == 0 or step == steps:
            losses.append(loss.item())
        if step == steps:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return wq.detach(), wk.detach(), losses


def _attention_inputs(backbone: nn.Module, inputs, index: int) -> Tensor:
    """What attention layer ``index`` receives (its normalised input) when the backbone runs ``inputs``."""
    module = attention_layers(backbone)[index].attention_module()
    captured = []

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args[0] if args else kwargs["hidden_states"]).detach())

    handle = module.register_forward_pre_hook(capture, with_kwargs=True)
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad():
            backbone(inputs)
    finally:
        handle.remove()
        backbone.train(was_training)
    return captured[0]


@register_init("qk_opt", uses_structure=True)
def qk_opt_init(backbone: nn.Module, structure: Structure, steps: PositiveInt = 2000, lr: PositiveFloat = 1e-4,
                renorm_every: NonNegativeInt = 100, fit_on: Literal["positions", "inputs"] = "positions",
                probe_size: PositiveInt = 256, pos_scale: PositiveFloat = 1.0, qk_scale: PositiveFloat = 1.0,
                layers: list[int] | None = None, norm: Literal["fitted", "default"] = "fitted") -> None:
    """Structured QK by optimisation (Zheng et al. 2024): fit Wq, Wk so attention matches the structure.

    Each layer's Wq, Wk are fitted with Adam (``steps``, ``lr``; every ``renorm_every`` steps the
    feature vectors are renormalised) so that the softmax attention matches the structure, each
    row spread evenly over its open entries (MSE). ``fit_on``:

    - ``positions`` (the reference): the layer-normed positional embeddings, after scaling them
      by ``pos_scale``. Layers with the same pattern share one fit (the reference fits once).
    - ``inputs``: what each attention layer really receives for ``probe_size`` examples from
      ``backbone.example_inputs``; layers are fitted in order, each seeing the layers before it
      already initialised, so the fit holds on real inputs at step 0.

    ``qk_scale`` multiplies the fitted Wq and Wk; ``layers`` and ``norm`` as in :func:`qk_svd_init`. Defaults:
    the paper's arithmetic runs (2000 steps, lr 1e-4, renormalise every 100).
    """
    if fit_on not in ("positions", "inputs"):
        raise ValueError(f"fit_on must be 'positions' or 'inputs', got {fit_on!r}")
    pairs = _structure_layers(backbone, structure)
    chosen = _fitted_layers("qk_opt", layers, norm, len(pairs))
    if pos_scale != 1.0:
        _backbone_method(backbone, "scale_positional_embedding", "qk_opt")(pos_scale)
    if weights_restored():  # the fitted Wq, Wk come from the checkpoint: no fit (minutes with fit_on=inputs)
        for layer, _ in pairs:
            layer.clear_prior()
        return
    if fit_on == "positions":
        positions = _normed_positions(backbone, "qk_opt")
    else:
        probe = _backbone_method(backbone, "example_inputs", "qk_opt")(probe_size)
    fitted: dict[bytes, tuple[Tensor, Tensor]] = {}
    for index, (layer, open) in enumerate(pairs):
        if index not in chosen:
            layer.clear_prior()
            continue
        target = (open.float() / open.sum(-1, keepdim=True)).expand(layer.num_heads, -1, -1)
        if fit_on == "positions":
            key = open.numpy().tobytes() + positions[index].numpy().tobytes()
            if key not in fitted:
                fitted[key] = fit_query_key(positions[index], target, layer.head_dim, steps, lr, renorm_every)[:2]
            wq, wk = fitted[key]
        else:
            layer.clear_prior()
            seen = _attention_inputs(backbone, probe, index)
            wq, wk, _ = fit_query_key(seen, target, layer.head_dim, steps, lr, renorm_every)
        _set_query_key(layer, qk_scale * wq, qk_scale * wk, norm)
        layer.clear_prior()


# ================================================================== mimetic and impulse
def mimetic_pair(dim: int, alpha: float, beta: float, sign: float, rank: int) -> tuple[Tensor, Tensor]:
    """``L`` (dim, rank), ``R`` (rank, dim) with ``L R`` ~ ``alpha Z + sign beta I`` (Trockman & Kolter).

    Z is uniform with variance 1/dim (as in the reference); the split is an SVD truncated to ``rank``.
    """
    bound = (3.0 / dim) ** 0.5
    z = (torch.rand(dim, dim, dtype=torch.float64) * 2 - 1) * bound
    left, right = _factor(alpha * z + sign * beta * torch.eye(dim, dtype=torch.float64), min(rank, dim))
    return left.float(), right.float()


def mimetic_values(dim: int, inner_dim: int, alpha: float, beta: float) -> tuple[Tensor, Tensor]:
    """Wv (inner_dim, dim) and Wproj (dim, inner_dim) with ``Wproj Wv ~ alpha Z - beta I``, every head alive.

    The target is split by SVD at rank ``r = min(inner_dim, dim)``, ``L R`` with ``L = U sqrt(S)`` and
    ``R = sqrt(S) V^T`` (:func:`mimetic_pair`), and carried through the attention's ``inner_dim`` features by
    a matrix ``Q`` (inner_dim, r) with orthonormal columns: ``Wv = Q R``, ``Wproj = L Q^T``, so
    ``Wproj Wv = L Q^T Q R = L R`` exactly. Where the attention is as wide as the model or narrower
    (``inner_dim <= dim``, the reference's ViT), ``Q`` is the identity and this is the reference's split.
    Where it is wider, writing ``R`` into the first ``r`` rows alone would leave the last heads with zero
    Wv rows and Wproj columns, which get zero gradient for the whole run; ``Q`` is then drawn uniformly
    (QR of a Gaussian matrix), which spreads the same product over every head.
    """
    left, right = mimetic_pair(dim, alpha, beta, -1.0, inner_dim)
    rank = right.shape[0]
    if inner_dim <= dim:
        return right, left
    spread, upper = torch.linalg.qr(torch.randn(inner_dim, rank, dtype=torch.float64))
    spread = spread * upper.diagonal().sign()  # the unique Haar-distributed orthonormal frame
    spread = spread.float()
    return spread @ right, left @ spread.transpose(0, 1)


def _mimetic_value(layer: PriorCarrier, alpha: float, beta: float) -> None:
    """Wproj Wv ~ alpha Z - beta I in one attention layer (:func:`mimetic_values`)."""
    wv, wproj = mimetic_values(layer.dim, layer.inner_dim, alpha, beta)
    value, output = layer.value_output_weights()
    with torch.no_grad():
        value.copy_(wv)
        output.copy_(wproj)


@register_init("mimetic")
def mimetic_init(backbone: nn.Module, structure: Structure | None, qk_alpha: float = 0.7,
                 qk_beta: float = 0.7, value_alpha: float = 0.4, value_beta: float = 0.4) -> None:
    """Mimetic init (Trockman & Kolter 2023): each head's ``Wq^T Wk ~ qk_alpha Z + qk_beta I``, and
    ``Wproj Wv ~ value_alpha Z - value_beta I``, Z random (variance 1/dim), split by SVD. No structure."""
    for layer in attention_layers(backbone):
        qs, ks = [], []
        for _ in range(layer.num_heads):
            left, right = mimetic_pair(layer.dim, qk_alpha, qk_beta, 1.0, layer.head_dim)
            qs.append(left.transpose(0, 1))
            ks.append(right)
        _set_query_key(layer, torch.stack(qs), torch.stack(ks))
        _mimetic_value(layer, value_alpha, value_beta)
        layer.clear_prior()


@register_init("impulse")
def impulse_init(backbone: nn.Module, structure: Structure | None, open_value: float = 1000.0,
                 closed_noise: NonNegativeFloat = 3.0, pos_scale: PositiveFloat = 18.0,
                 qk_scale: PositiveFloat = 7.0,
                 value_alpha: float = 0.4, value_beta: float = 0.4) -> None:
    """Impulse init (vision; Zheng et al. 2025): each head's attention over the patch grid is a 3x3 impulse.

    The structure is the task's if it gives one, else ``grid_impulse`` on ``backbone.patch_grid()``
    with head h taking offset h mod 9 (centre, up, right, left, down, up-left, up-right, down-left,
    down-right). Wq, Wk follow QK-SVD with the reference's target: ``open_value`` on open entries,
    ``closed_noise`` x truncated normal (std 0.6) noise elsewhere; positions x``pos_scale``, QK
    x``qk_scale``. As in the reference, the values get the mimetic ``Wproj Wv ~ 0.4 Z - 0.4 I``
    (set ``value_alpha = value_beta = 0`` to leave them alone).
    """
    layers = attention_layers(backbone)
    if structure is None:
        height, width = _backbone_method(backbone, "patch_grid", "impulse")()
        heads = layers[0].num_heads
        offsets = [IMPULSE_OFFSETS[h % len(IMPULSE_OFFSETS)] for h in range(heads)]
        structure = grid_impulse(height, width, offsets, name=f"impulse {height}x{width}")
        to_sequence = getattr(backbone, "structure_for_sequence", None)
        structure = to_sequence(structure) if to_sequence is not None else structure
    pairs = _structure_layers(backbone, structure)
    _backbone_method(backbone, "scale_positional_embedding", "impulse")(pos_scale)
    for (layer, open), positions in zip(pairs, _normed_positions(backbone, "impulse"), strict=True):
        open = open.expand(layer.num_heads, -1, -1)
        noise = nn.init.trunc_normal_(torch.empty(open.shape), std=0.6)
        target = torch.where(open, float(open_value), closed_noise * noise)
        wq, wk = _fit_svd_layer(backbone, positions, target, layer.head_dim)
        _set_query_key(layer, qk_scale * wq, qk_scale * wk)
        if value_alpha or value_beta:
            _mimetic_value(layer, value_alpha, value_beta)
        layer.clear_prior()


@register_init("mask_impulse", uses_structure=True)
def mask_impulse_init(backbone: nn.Module, structure: Structure, open_value: float = 10.0,
                      closed_value: float = -10.0, scale: PositiveFloat = 1.0, impulse_open_value: float = 1000.0,
                      closed_noise: NonNegativeFloat = 3.0, pos_scale: PositiveFloat = 18.0,
                      qk_scale: PositiveFloat = 7.0,
                      value_alpha: float = 0.4, value_beta: float = 0.4) -> None:
    """Both places at once (an ablation): the impulse init puts ``structure`` into Wq, Wk (with its
    positions x``pos_scale`` and mimetic values), and the learnable prior M gets the same structure as ``mask``.
    ``impulse_open_value`` is the impulse's ``open_value``; the other options are ``mask``'s and ``impulse``'s."""
    impulse_init(backbone, structure, open_value=impulse_open_value, closed_noise=closed_noise,
                 pos_scale=pos_scale, qk_scale=qk_scale, value_alpha=value_alpha, value_beta=value_beta)
    mask_init(backbone, structure, open_value=open_value, closed_value=closed_value, scale=scale)


# ================================================================== measuring the structure
@torch.no_grad()
def open_attention_mass(backbone: nn.Module, inputs, structure: Structure) -> Tensor:
    """Mean attention probability on open entries, per layer and head (layers, heads), for ``inputs``.

    1.0 means every query puts all its mass on the pairs the structure opens; uniform attention
    gives the open fraction of each row.
    """
    probs = attention_probabilities(backbone, inputs)
    open = structure.expanded(len(probs), probs[0].shape[1]).to(probs[0].device)
    return torch.stack([(p * o).sum(-1).mean(dim=(0, 2)) for p, o in zip(probs, open, strict=True)])

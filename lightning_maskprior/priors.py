"""Structure: which token pairs should interact, per layer and head, and the builders that make one.

A Structure is Booleans, and optionally graded values. Where it goes (an additive mask, the query/key
weights, nowhere) is decided by an init method in ``inits.py``; the open/closed values belong to that
init, unless the structure is graded (real-valued, like the language prior -max(i - j, 0)): then the
mask inits use its values as M.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_maskprior.plugins import PluginError, leading, parameters_of, registrar, resolve, shown

Pair = tuple[int, int]


class Structure:
    """Open token pairs as a Boolean tensor of shape (layers, heads, N, N).

    ``open[l, h, i, j]`` is True when token i may attend to token j in layer l, head h. A size-1
    layer or head axis means "the same in every layer/head". Every row must have an open entry:
    a row that is all closed adds one constant to every logit, softmax cancels it, and the row
    becomes fully open (arXiv 2608.00418). Builders keep the diagonal open for that reason.

    A *graded* structure also carries real ``values``: the mask inits (``mask``, ``fixed``) use them
    as the prior logits M instead of their open/closed values (the language prior, arXiv 2608.00418:
    M_ij = -max(i - j, 0) on the causal pattern). Inits that only read ``open`` are unaffected.

    Args:
        open: Boolean tensor of shape (N, N), (heads, N, N) or (layers, heads, N, N).
        name: A short description for logs and error messages.
        values: Optional real tensor of prior logits, shaped like ``open`` (size-1 layer/head axes
            broadcast, independently of ``open``'s).
    """

    def __init__(self, open: Tensor, name: str = "structure", values: Tensor | None = None) -> None:
        open = torch.as_tensor(open)
        if open.dtype != torch.bool:
            if not torch.all((open == 0) | (open == 1)):
                raise ValueError(f"{name}: structure entries must be Boolean (0/1), got other values")
            open = open.bool()
        while open.dim() < 4:
            open = open.unsqueeze(0)
        if open.dim() != 4 or open.shape[-1] != open.shape[-2]:
            raise ValueError(
                f"{name}: structure must have shape (layers, heads, N, N), got {tuple(open.shape)}"
            )
        empty = ~open.any(dim=-1)
        if empty.any():
            layer, head, row = (int(i) for i in empty.nonzero()[0])
            raise ValueError(
                f"{name}: row {row} (layer {layer}, head {head}) has no open entry; an all-closed "
                "row is uniform attention after softmax. Open at least its diagonal entry."
            )
        self.open = open.cpu()
        self.name = name
        self.values = None if values is None else _check_values(values, open.shape, name)

    @property
    def num_layers(self) -> int:
        return self.open.shape[0]

    @property
    def num_heads(self) -> int:
        return self.open.shape[1]

    @property
    def seq_len(self) -> int:
        return self.open.shape[-1]

    def __repr__(self) -> str:
        return (
            f"Structure({self.name!r}, layers={self.num_layers}, heads={self.num_heads}, "
            f"N={self.seq_len}, open={self.open.float().mean().item():.3f})"
        )

    def layer(self, index: int) -> Tensor:
        """The (heads, N, N) Boolean pattern of layer ``index`` (broadcast if shared)."""
        return self.open[index if self.num_layers > 1 else 0]

    @property
    def graded(self) -> bool:
        """Whether the structure carries real values (used as M by the mask inits)."""
        return self.values is not None

    def layer_values(self, index: int) -> Tensor | None:
        """The (heads or 1, N, N) graded values of layer ``index``, or None for a Boolean structure."""
        if self.values is None:
            return None
        return self.values[index if self.values.shape[0] > 1 else 0]

    def for_model(self, num_layers: int, num_heads: int) -> Structure:
        """Check the structure fits a model with ``num_layers`` x ``num_heads`` (size-1 axes broadcast)."""
        if self.num_layers not in (1, num_layers):
            raise ValueError(
                f"{self.name} has {self.num_layers} layers but the model has {num_layers} "
                "(give 1 to share one pattern across layers)"
            )
        if self.num_heads not in (1, num_heads):
            raise ValueError(
                f"{self.name} has {self.num_heads} heads but the model has {num_heads} "
                "(give 1 to share one pattern across heads)"
            )
        return self

    def union_over_heads(self) -> Structure:
        """One pattern shared by every head: the pairs any head opens (Boolean; graded values are dropped)."""
        return Structure(self.open.any(dim=1, keepdim=True), name=f"{self.name} (union over heads)")

    def expanded(self, num_layers: int, num_heads: int) -> Tensor:
        """The open pattern as a full (num_layers, num_heads, N, N) tensor."""
        self.for_model(num_layers, num_heads)
        return self.open.expand(num_layers, num_heads, -1, -1)

    def logits(self, open_value: float, closed_value: float) -> Tensor:
        """Prior logits M: ``open_value`` on open pairs, ``closed_value`` elsewhere (float32)."""
        check_open_closed(open_value, closed_value)
        return torch.where(self.open, float(open_value), float(closed_value))

    def reorder(self, order: list[int], name: str | None = None) -> Structure:
        """The same structure over the tokens rearranged: new token t is old token ``order[t]``."""
        if sorted(order) != list(range(self.seq_len)):
            raise ValueError(f"{self.name}: {order} is not an ordering of its {self.seq_len} tokens")
        index = torch.tensor(order)
        values = None if self.values is None else self.values[..., index, :][..., index]
        return Structure(self.open[..., index, :][..., index], name=name or self.name, values=values)

    def pad(self, before: int = 0, attends_to_all: bool = True) -> Structure:
        """Prepend ``before`` extra tokens (e.g. a CLS token).

        The new tokens attend to everything (``attends_to_all``) or only to themselves; the original
        tokens do not attend to them, so the original structure is unchanged on its own tokens.
        """
        if before == 0:
            return self
        if self.graded:
            raise ValueError(f"{self.name}: padding a graded structure is not supported")
        layers, heads, n, _ = self.open.shape
        out = torch.zeros(layers, heads, n + before, n + before, dtype=torch.bool)
        out[..., before:, before:] = self.open
        if attends_to_all:
            out[..., :before, :] = True
        else:
            idx = torch.arange(before)
            out[..., idx, idx] = True
        return Structure(out, name=f"{self.name}+{before}")


def _check_values(values: Tensor, open_shape: torch.Size, name: str) -> Tensor:
    values = torch.as_tensor(values, dtype=torch.float32).cpu()
    while values.dim() < 4:
        values = values.unsqueeze(0)
    fits = values.dim() == 4 and values.shape[-2:] == open_shape[-2:] and all(
        v in (1, o) or o == 1 for v, o in zip(values.shape[:2], open_shape[:2], strict=True)
    )
    if not fits:
        raise ValueError(
            f"{name}: graded values have shape {tuple(values.shape)}, which does not fit the open "
            f"pattern {tuple(open_shape)} (layers|1, heads|1, N, N)"
        )
    if not torch.isfinite(values).all():
        raise ValueError(f"{name}: graded values must be finite (the causal mask is the attention's job)")
    return values


def check_open_closed(open_value: float, closed_value: float) -> None:
    if not open_value > closed_value:
        raise ValueError(
            f"open value ({open_value}) must be greater than closed value ({closed_value})"
        )


# ------------------------------------------------------------------------------------ builders
class StructureBuilder(Protocol):
    """A structure from its token count: ``fn(seq_len, **options) -> Structure`` over the task's ``seq_len`` tokens.

    Named by ``--model.structure NAME`` or ``{builder: NAME, options: {...}}``: a registered builder
    (``register_structure(name)``: ``full``, ``diagonal``, ``cyclic_window``...) or an import path
    (``my_pkg.structures:ring``).
    """

    def __call__(self, seq_len: int, /, **options: Any) -> Structure: ...


def check_structure_builder(name: str, fn: Any) -> None:
    """A PluginError naming structure builder ``name`` where ``fn`` is not a :class:`StructureBuilder`."""
    expected = "fn(seq_len, **options) -> Structure (see lightning_maskprior.priors.StructureBuilder)"
    params = parameters_of("structure builder", name, fn, expected)
    given, _ = leading(params, 1)
    if not given:
        raise PluginError(f"structure builder {name!r} takes ({shown(params)}); expected {expected}: its first "
                          "parameter receives the task's token count")


STRUCTURE_BUILDERS: dict[str, StructureBuilder] = {}
_register = registrar("structure", STRUCTURE_BUILDERS, "structure builder", check_structure_builder)


def register_structure(name: str) -> Callable[[StructureBuilder], StructureBuilder]:
    """Decorator: register ``fn(seq_len, **options) -> Structure`` as structure builder ``name``, which
    ``--model.structure NAME`` (or ``{builder: NAME, options: {...}}``) names (the contract:
    :class:`StructureBuilder`, checked now)."""
    return _register(name)


def build_structure(name: str, seq_len: int, options: dict[str, Any] | None = None) -> Structure:
    """The structure builder ``name`` (registered, or ``module.path:function``) makes over ``seq_len`` tokens with
    ``options``; a PluginError naming the builder where the options do not fit its signature or it does not give
    a Structure."""
    builder = resolve("structure", name)
    options = dict(options or {})
    try:
        inspect.signature(builder).bind(seq_len, **options)
    except TypeError as err:
        accepted = [p for p in list(inspect.signature(builder).parameters)[1:]]
        raise PluginError(f"structure builder {name!r}: {err} (its options: {', '.join(accepted) or 'none'})") from None
    structure = builder(seq_len, **options)
    if not isinstance(structure, Structure):
        raise PluginError(f"structure builder {name!r} returned a {type(structure).__name__}; expected a Structure "
                          "(lightning_maskprior.priors.Structure)")
    return structure


def _pairs_to_open(n: int, pairs: Iterable[Sequence[int]], symmetric: bool, diagonal: bool) -> Tensor:
    open = torch.eye(n, dtype=torch.bool) if diagonal else torch.zeros(n, n, dtype=torch.bool)
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"a pair must have two token indices, got {list(pair)}")
        i, j = (int(t) for t in pair)
        for t in (i, j):
            if not 0 <= t < n:
                raise ValueError(f"pair {list(pair)} has token {t}, outside 0..{n - 1}")
        open[i, j] = True
        if symmetric:
            open[j, i] = True
    return open


def pairs(n: int, open_pairs: Iterable[Sequence[int]], symmetric: bool = True,
          diagonal: bool = True, name: str = "pairs") -> Structure:
    """Every layer and head: the listed pairs open (both ways if ``symmetric``), plus the diagonal."""
    return Structure(_pairs_to_open(n, open_pairs, symmetric, diagonal), name=name)


def pairs_per_head(n: int, head_pairs: Sequence[Iterable[Sequence[int]]], symmetric: bool = True,
                   diagonal: bool = True, name: str = "pairs_per_head") -> Structure:
    """Head h opens the pairs in ``head_pairs[h]`` (shared by every layer), plus the diagonal."""
    heads = [_pairs_to_open(n, p, symmetric, diagonal) for p in head_pairs]
    return Structure(torch.stack(heads), name=name)


@register_structure("diagonal")
def diagonal(n: int, name: str = "diagonal") -> Structure:
    """Each token attends only to itself (Majority: no off-diagonal interactions)."""
    return Structure(torch.eye(n, dtype=torch.bool), name=name)


@register_structure("cyclic_window")
def cyclic_window(n: int, offsets: Sequence[int] = (0, 1, 2), name: str = "cyclic_window",
                  open_diagonal: bool = True) -> Structure:
    """Token i attends to tokens (i + o) mod n for each offset o, in every layer.

    Composed over layers the receptive field grows, so a window of three consecutive bits (Cyclic3's
    monomials x_i x_{i+1} x_{i+2}) is covered already by the first layer. ``open_diagonal`` (the default)
    also opens every token's own entry, whatever the offsets; False keeps exactly the offsets' pairs
    (offsets without 0 then close the own entry, as ``configs/boolean/cyclic3_small.yaml`` does).
    """
    open = torch.zeros(n, n, dtype=torch.bool)
    idx = torch.arange(n)
    for offset in offsets:
        open[idx, (idx + int(offset)) % n] = True
    if open_diagonal:
        open |= torch.eye(n, dtype=torch.bool)
    return Structure(open, name=name)


@register_structure("full")
def full(n: int, name: str = "full") -> Structure:
    """Every pair open: the prior is a constant and has no effect."""
    return Structure(torch.ones(n, n, dtype=torch.bool), name=name)


def grid_impulse(height: int, width: int, offsets: Sequence[Pair] | None = None,
                 name: str = "grid_impulse") -> Structure:
    """Per-head 3x3 impulse on a ``height`` x ``width`` patch grid (row-major tokens).

    Head h: patch (r, c) attends to patch (r + dr, c + dc) for the h-th offset (dr, dc); at the
    border, where that neighbour does not exist, it keeps its own entry open so no row is empty.
    Default offsets: centre, up, right, left, down, up-left, up-right, down-left, down-right.
    """
    offsets = list(offsets if offsets is not None else IMPULSE_OFFSETS)
    n = height * width
    heads = []
    rows = torch.arange(height).repeat_interleave(width)
    cols = torch.arange(width).repeat(height)
    for dr, dc in offsets:
        open = torch.zeros(n, n, dtype=torch.bool)
        r2, c2 = rows + dr, cols + dc
        inside = (r2 >= 0) & (r2 < height) & (c2 >= 0) & (c2 < width)
        src = torch.arange(n)
        open[src[inside], (r2 * width + c2)[inside]] = True
        open[src[~inside], src[~inside]] = True
        heads.append(open)
    return Structure(torch.stack(heads), name=name)


@register_structure("causal_relative_distance")
def causal_relative_distance(n: int, name: str = "causal relative distance") -> Structure:
    """The language prior (arXiv 2608.00418): token i attends to j <= i, graded M_ij = -max(i - j, 0).

    Applied as ``log sigmoid(s * M)`` (the mask init's ``scale``, s = 10 in the paper) on top of the
    causal mask: the diagonal gets log sigmoid(0) = -0.69, the previous token log sigmoid(-s), and so on.
    """
    idx = torch.arange(n)
    distance = idx[:, None] - idx[None, :]
    return Structure(distance >= 0, name=name, values=(-distance).clamp(max=0).float())


# (row offset, column offset): centre, up, right, left, down, up-left, up-right, down-left, down-right
IMPULSE_OFFSETS: list[Pair] = [
    (0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1),
]


# ------------------------------------------------------------------------------ digit arithmetic
# Operand tokens: a's digits then b's digits, each most significant first: for 3 digits the tokens
# are [a2 a1 a0 b2 b1 b0], and token i holds the digit of power 10^(num_digits - 1 - i % num_digits).
def digit_powers(num_digits: int) -> Tensor:
    """(2 num_digits,) the power of ten of each operand digit token, both operands most significant first."""
    return num_digits - 1 - torch.arange(2 * num_digits) % num_digits


def _operand_heads(heads: list[Tensor], name: str) -> Structure:
    eye = torch.eye(len(heads[0]), dtype=torch.bool)
    return Structure(torch.stack([h | eye for h in heads]), name=name)


def digit_addition(num_digits: int = 3, num_heads: int = 4, name: str = "addition") -> Structure:
    """Addition of two ``num_digits``-digit operands: even heads sum aligned digits, odd heads carry.

    Sum heads: each digit and the other operand's digit of the same power attend to each other.
    Carry heads: each digit attends to every digit (of both operands) of a lower power, where its
    carry comes from. One head gets both patterns. Every head keeps the diagonal open.
    """
    power = digit_powers(num_digits)
    a_side = torch.arange(2 * num_digits) < num_digits
    aligned = (power[:, None] == power[None, :]) & (a_side[:, None] != a_side[None, :])
    carry = power[None, :] < power[:, None]
    if num_heads == 1:
        return _operand_heads([aligned | carry], name)
    return _operand_heads([aligned if h % 2 == 0 else carry for h in range(num_heads)], name)


def digit_multiplication(num_digits: int = 3, num_heads: int = 4, name: str = "multiplication") -> Structure:
    """Multiplication: the num_digits^2 cross-operand digit pairs (a_i, b_j), spread over heads.

    Pairs are grouped by their cyclic shift s = (j - i) mod num_digits: each shift pairs every digit
    of a with exactly one digit of b. Shift s goes to head s mod num_heads (so every pair is covered
    however few heads there are); heads beyond num_digits open every cross pair. Symmetric, with
    the diagonal open.
    """
    n = 2 * num_digits
    heads = [torch.zeros(n, n, dtype=torch.bool) for _ in range(num_heads)]
    for i in range(num_digits):
        for j in range(num_digits):
            h = (j - i) % num_digits % num_heads
            heads[h][i, num_digits + j] = heads[h][num_digits + j, i] = True
    for h in range(num_digits, num_heads):
        heads[h][:num_digits, num_digits:] = heads[h][num_digits:, :num_digits] = True
    return _operand_heads(heads, name)


def with_answer_tokens(structure: Structure, num_digits: int, num_answer: int, lsd_first: bool = False) -> Structure:
    """Append ``num_answer`` answer tokens (most significant first, or least with ``lsd_first``) to an
    operand-digit structure whose operands are written most significant first.

    The answer token of power p attends to the operand digits that answer digit depends on and to itself
    (:func:`with_readout_dependencies`), in every layer and head. Operand tokens do not attend to answer
    tokens (which carry no data).
    """
    layers, heads, n, _ = structure.open.shape
    if n != 2 * num_digits:
        raise ValueError(f"{structure.name} has {n} tokens, expected 2 * {num_digits} operand digits")
    padded = torch.zeros(layers, heads, n + num_answer, n + num_answer, dtype=torch.bool)
    padded[..., :n, :n] = structure.open
    padded[..., n:, n:] = torch.eye(num_answer, dtype=torch.bool)  # every row needs an open entry; replaced below
    answer_power = torch.arange(num_answer) if lsd_first else num_answer - 1 - torch.arange(num_answer)
    # answer tokens get a power no answer digit reaches, so that no answer row opens another answer token
    token_powers = torch.cat([digit_powers(num_digits), torch.full((num_answer,), num_answer)])
    reads = {n + k: int(power) for k, power in enumerate(answer_power)}
    out = with_readout_dependencies(Structure(padded, name=structure.name), token_powers, reads)
    return Structure(out.open, name=f"{structure.name}+{num_answer} answer tokens")


def with_readout_dependencies(structure: Structure, token_powers: Tensor, readout_powers: dict[int, int]) -> Structure:
    """Replace the rows of the tokens an answer digit is read at by that digit's dependencies.

    The answer digit of power p is a function of the operand digits of power <= p alone (higher digits
    cannot reach it; lower ones bring the carries), for addition and multiplication alike. So token t
    reading the digit of power ``readout_powers[t]`` attends to the tokens of power <= that and to itself,
    in every layer and head. Other rows keep ``structure``'s pattern.

    Args:
        structure: A structure over the operand tokens.
        token_powers: (N,) the power of ten of each token's digit, in the tokens' order.
        readout_powers: Read-out token position -> power of the answer digit read there.
    """
    n = structure.seq_len
    if len(token_powers) != n:
        raise ValueError(f"{structure.name} has {n} tokens but {len(token_powers)} token powers were given")
    out = structure.open.clone()
    eye = torch.eye(n, dtype=torch.bool)
    for token, power in readout_powers.items():
        out[..., token, :] = (token_powers <= power) | eye[token]
    return Structure(out, name=f"{structure.name}, read-out rows by answer dependencies")


# ------------------------------------------------------------------------------- user structures
@dataclass
class StructureSpec:
    """A structure given in YAML. Exactly one of ``pairs``, ``heads``, ``layers``, ``file`` or ``builder``.

    Args:
        pairs: Open token pairs ``[[i, j], ...]``, the same in every layer and head.
        heads: One list of pairs per head: ``[[[0, 1]], [[1, 2]], [[2, 0]]]``.
        layers: One entry per layer, each a list of per-head pair lists.
        file: A ``.pt`` or ``.npy`` file holding a Boolean array of shape (N, N), (heads, N, N) or
            (layers, heads, N, N).
        builder: A structure builder, called as ``builder(seq_len, **options)``: a registered one (``full``,
            ``diagonal``, ``cyclic_window``, ``causal_relative_distance``) or ``module.path:function`` of your own
            (:class:`StructureBuilder`). ``--model.structure NAME`` is the same with
            no options.
        options: The builder's options, e.g. ``{offsets: [0, 1]}`` for ``cyclic_window``.
        symmetric: Open (j, i) whenever (i, j) is listed.
        diagonal: Keep every token's own entry open (recommended: an all-closed row is uniform).
    """

    pairs: list[list[int]] | None = None
    heads: list[list[list[int]]] | None = None
    layers: list[list[list[list[int]]]] | None = None
    file: str | None = None
    builder: str | None = None
    options: dict[str, Any] | None = None
    symmetric: bool = True
    diagonal: bool = True

    def build(self, seq_len: int) -> Structure:
        given = [k for k in ("pairs", "heads", "layers", "file", "builder") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a structure needs exactly one of pairs, heads, layers, file or builder; got {given or 'none'}"
            )
        if self.options and self.builder is None:
            raise ValueError(f"structure options {self.options} are a builder's: give builder too")
        if self.builder is not None:
            structure = build_structure(self.builder, seq_len, self.options)
        elif self.file is not None:
            structure = load_structure_file(self.file)
        elif self.pairs is not None:
            structure = pairs(seq_len, self.pairs, self.symmetric, self.diagonal, name="yaml pairs")
        elif self.heads is not None:
            structure = pairs_per_head(seq_len, self.heads, self.symmetric, self.diagonal, "yaml heads")
        else:
            layer_list = [
                torch.stack([_pairs_to_open(seq_len, p, self.symmetric, self.diagonal) for p in layer])
                for layer in self.layers
            ]
            if len({t.shape[0] for t in layer_list}) != 1:
                raise ValueError("every layer of a structure must list the same number of heads")
            structure = Structure(torch.stack(layer_list), name="yaml layers")
        if structure.seq_len != seq_len:
            n = structure.seq_len
            source = f" (structure file {self.file})" if self.file is not None else ""
            raise ValueError(f"structure is {n}x{n} but the sequence has {seq_len} tokens{source}")
        return structure


STRUCTURE_FILE_CONTENT = (
    "a Boolean (0/1) tensor of shape (N, N), (heads, N, N) or (layers, heads, N, N), saved with torch.save "
    "(.pt) or numpy.save (.npy)"
)


def load_structure_file(path: str | Path) -> Structure:
    """Load a Boolean structure from a ``.pt`` (torch.save) or ``.npy`` file, safely (no pickled objects)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"structure file {path} does not exist; expected {STRUCTURE_FILE_CONTENT}")
    if path.suffix == ".npy":
        data = _read_npy(path)
    elif path.suffix in (".pt", ".pth"):
        data = _read_pt(path)
    else:
        raise ValueError(f"structure file {path} must end in .pt or .npy, not {path.suffix!r}")
    if data.dim() not in (2, 3, 4) or data.shape[-1] != data.shape[-2]:
        raise ValueError(f"structure file {path} holds a tensor of shape {tuple(data.shape)}; "
                         f"expected {STRUCTURE_FILE_CONTENT}")
    if data.dtype != torch.bool:
        other = data[(data != 0) & (data != 1)]
        if other.numel():
            raise ValueError(f"structure file {path} holds values other than 0 and 1 (e.g. {other[0].item()}); "
                             f"expected {STRUCTURE_FILE_CONTENT}")
    return Structure(data, name=path.name)


def _read_npy(path: Path) -> Tensor:
    import numpy as np

    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise ValueError(f"structure file {path} is not a .npy array (no NumPy header; a text file?); "
                         f"expected {STRUCTURE_FILE_CONTENT}")
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as err:
        reason = "it holds pickled Python objects" if "pickle" in str(err).lower() else _first_line(err)
        raise ValueError(f"structure file {path} cannot be read safely ({reason}); "
                         f"expected {STRUCTURE_FILE_CONTENT}") from None
    except Exception as err:  # noqa: BLE001 - truncated or corrupt: say which file
        raise ValueError(f"structure file {path} is not a readable .npy array ({_first_line(err)}); "
                         f"expected {STRUCTURE_FILE_CONTENT}") from None
    if not (array.dtype == np.bool_ or np.issubdtype(array.dtype, np.number)):
        raise ValueError(f"structure file {path} holds {array.dtype} values; expected {STRUCTURE_FILE_CONTENT}")
    return torch.from_numpy(array)


def _read_pt(path: Path) -> Tensor:
    import pickle
    import zipfile

    if not zipfile.is_zipfile(path):
        raise ValueError(f"structure file {path} is not a torch.save file (truncated, or another format); "
                         f"expected {STRUCTURE_FILE_CONTENT}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"structure file {path} holds Python objects other than tensors, which are not loaded "
                         f"from files; expected {STRUCTURE_FILE_CONTENT}") from None
    except Exception as err:  # noqa: BLE001 - truncated or corrupt: say which file
        raise ValueError(f"structure file {path} is not a readable torch.save file ({_first_line(err)}); "
                         f"expected {STRUCTURE_FILE_CONTENT}") from None
    if not isinstance(data, Tensor):
        held = f"a {type(data).__name__}"
        if isinstance(data, dict):
            held = f"a dict with keys {sorted(map(str, data))[:6]}"
        raise ValueError(f"structure file {path} holds {held}; expected {STRUCTURE_FILE_CONTENT}")
    if data.is_complex():
        raise ValueError(f"structure file {path} holds {data.dtype} values; expected {STRUCTURE_FILE_CONTENT}")
    return data


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    first = lines[0][:200] if lines else ""
    # Never pass on a library's advice to load the file unsafely.
    return type(err).__name__ if not first or "weights_only" in first or "allow_pickle" in first else first

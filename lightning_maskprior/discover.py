"""Where a structure comes from when there is no oracle: estimators that read the training data, in one registry.

    maskprior discover -c boolean/2parity.yaml --method fourier --out structure.yaml
    maskprior fit -c boolean/2parity.yaml -c init/mask.yaml --model.structure structure.yaml

An estimator takes a datamodule (set up for ``fit``) and its own options and returns a :class:`Discovery`: the
open pairs and, for each, the evidence and whether the training data identify it. It reads the training split only
(and, for ``fourier``, the seen condition the task declares), never the evaluation split or the task's built-in
structure. The result is written as the YAML that ``--model.structure`` reads (:class:`~lightning_maskprior.priors.
StructureSpec`: ``pairs`` or ``heads``, symmetric, diagonal open), with a confidence report as comments. Each
estimator's options are declared once, in its signature (types, ranges, defaults) and its docstring: the command's
options, ``--model.structure {discover: NAME, options: {...}}`` and the API reference all read that declaration.

``fourier`` (Boolean tasks): the min-degree interpolator (MDI) of the training data, the function a transformer
learns from it (Abbe et al., 2023), and what the seen region can hide. The seen condition depends on a few variables
T; a product of the target whose part on T is a product B that the seen region turns into something else (its MDI
there, :func:`~lightning_maskprior.fourier.collapses`) reaches the data as that image: wherever x0 = 1 or x1 = 1,
``x0 x1 = x0 + x1 - 1`` (a pair into variables), ``x2 x5 x8 = x2 x8 + x5 x8 - x8`` (a triple into pairs). The rule:

- a pair of variables in a monomial of the MDI of degree >= 2 is *identifiable* where every product that could have
  produced that monomial (the monomial itself, or a collapsed product whose image holds it) contains the pair;
- a collapsed product B x chi_R is a *candidate* where the MDI holds every non-constant term of B's image (times
  chi_R): its pairs open too, as *not identifiable* (the data fit it, and fit the image's terms taken one by one);
- a product the seen region turns into a constant (a variable it fixes) leaves no trace: named, nothing opened.

Only the seen condition's variables can be part of a collapsed product, so a degree-1 term of another variable
opens nothing. The MDI is computed from the declared seen region; where the training points are a sample of it
(``max_train_points``), the lowest-degree polynomial that fits them is used, once they are shown to determine it.

Two estimators read a model trained on the training split instead, so they work for any datamodule. Each trains a
fresh, structure-free copy of the run's model (the same backbone; Adam at the estimator's ``lr``, not the run's
optimizer) for ``steps`` steps, once per seed of ``seeds``, in a forked random state (the run's own initialisation
and data order are untouched). Each seed's model must fit: its training loss (on ``probe_size`` training examples)
must end at most ``max_loss_ratio`` x its loss at initialisation, or the estimator raises :class:`NotFitted`.

``attention``: the model trained with the default init; on ``probe_size`` training examples, each layer's and
head's attention probabilities are averaged, and pair (i, j) scores ``sqrt(P_ij P_ji)`` in units of the uniform
attention (high only where each token attends to the other). ``learned``: the model trained with a learnable prior
``M = 0`` in every layer and head and a sparsity penalty ``sparsity x sum sigmoid(M)``; pair (i, j) scores
``(M_ij + M_ji) / 2``. Both then apply one rule: a token is relevant in a layer and head where its mean score with
the other tokens stands above the median token's by at least ``min_effect`` (in the score's units) and by a robust
z-score ``(s - median) / (1.4826 MAD)`` above ``z_threshold``; every pair of tokens relevant in some layer and head
opens, if every seed found it. A trained model shows which tokens matter more reliably than which of them pair up.

Every estimator also gives its *interactions*: the sets of tokens it takes for one term (fourier: each candidate
product; the model-based ones: each pair of relevant tokens). Over a model's heads they are laid out by one rule
(:meth:`Discovery.heads`): with at least two interactions and no more than heads, each gets a head of its own and the
heads left over carry them all; otherwise every head carries every pair.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt

from lightning_maskprior import contracts
from lightning_maskprior.attention import attention_layers, attention_probabilities
from lightning_maskprior.fourier import collapses, noise_spread, relevant_bits, sample_mdi, subset_parity
from lightning_maskprior.plugins import (
    POSITIONAL,
    PluginError,
    calling,
    parameters_of,
    registrar,
    resolve,
    shown,
    without_default,
)
from lightning_maskprior.priors import StructureSpec


class Estimator(Protocol):
    """Where a structure comes from: ``fn(datamodule, **options) -> Discovery`` reads a
    :class:`~lightning_maskprior.contracts.TaskDataModule`'s training split (after ``setup("fit")``).

    Its first parameter is named ``datamodule``; one that trains a model also takes ``make_module``
    (``make_module(init)``: a fresh, structure-free ``MaskPriorModule`` of the run). Every other parameter is an
    option with a type and a default, documented in the docstring's ``Args:`` (``maskprior discover --help`` shows
    them). Register one with ``register_estimator(name)``, or name it by import path
    (``--model.structure discover:my_pkg.estimators:my_estimator``, ``maskprior discover --method ...``).
    """

    def __call__(self, datamodule: contracts.TaskDataModule, **options: Any) -> Discovery: ...


def check_estimator(name: str, fn: Any) -> None:
    """A PluginError naming estimator ``name`` where ``fn`` is not an :class:`Estimator`."""
    expected = "fn(datamodule, **options) -> Discovery (see lightning_maskprior.discover.Estimator)"
    params = parameters_of("estimator", name, fn, expected)
    if not params or params[0].name != "datamodule" or params[0].kind not in POSITIONAL:
        raise PluginError(f"estimator {name!r} takes ({shown(params)}); expected {expected}: its first parameter, "
                          "named datamodule, receives the task's datamodule")
    required = without_default([p for p in params[1:] if p.name != "make_module"])
    if required:
        raise PluginError(f"estimator {name!r}: option(s) {', '.join(required)} have no default; expected a default "
                          "for every option")


ESTIMATORS: dict[str, Estimator] = {}
_register = registrar("estimator", ESTIMATORS, "estimator", check_estimator)
# what an estimator receives besides its options
_GIVEN = ("datamodule", "make_module")


class NotFitted(ValueError):
    """A model-based estimator's model did not fit its training data: what it would read from it means nothing."""


@dataclass
class DiscoverySpec:
    """``model.structure`` as a structure discovered from the run's training data, with the estimator's options
    (the string ``discover:NAME`` is the same with its defaults).

    Args:
        discover: The estimator: fourier, attention, learned, one registered with ``register_estimator``, or
            ``module.path:function`` of your own (:class:`Estimator`).
        options: Its options (``maskprior discover --help`` lists each estimator's), e.g. ``{steps: 500}``.
    """

    discover: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Discovery:
    """A discovered structure: open pairs of a ``seq_len``-token sequence, the evidence for each, how it was found."""

    method: str
    seq_len: int
    pairs: list[tuple[int, int]]
    reasons: dict[tuple[int, int], str] = field(default_factory=dict)  # each pair's evidence, with its numbers
    summary: list[str] = field(default_factory=list)  # one line per fact (threshold, relevant variables, ...)
    # The candidate interactions: each a set of tokens the estimator takes for one term (a product, a pair of
    # relevant tokens). ``pairs`` is the union of their pairs; :meth:`heads` lays them out over heads.
    interactions: list[tuple[int, ...]] = field(default_factory=list)
    # Per pair: True where the training data identify it, False where they do not (a product the seen region
    # collapsed), None where it is not known (a task that is not Boolean).
    identifiable: dict[tuple[int, int], bool | None] = field(default_factory=dict)

    def heads(self, num_heads: int) -> list[list[tuple[int, int]]] | None:
        """The open pairs of each of ``num_heads`` heads, or None where every head shares ``pairs``.

        The one layout rule: where there are at least two interactions and no more than heads, each interaction
        gets a head of its own (the heads left over carry every pair); otherwise every head carries every pair.
        One head's softmax mixes whatever its row opens, so two products opened in one head reach the model as
        one average; a head each keeps them apart, as the multi-head layout of the paper's structures does
        (ThreeSym: one pair per head)."""
        interactions = [sorted(t) for t in self.interactions if len(t) >= 2]
        if not 1 < len(interactions) <= num_heads:
            return None
        own = [list(itertools.combinations(t, 2)) for t in interactions]
        return [own[h] if h < len(own) else list(self.pairs) for h in range(num_heads)]

    def spec(self, num_heads: int | None = None) -> StructureSpec:
        """The structure as ``--model.structure`` takes it, laid out over ``num_heads`` heads (:meth:`heads`)."""
        heads = self.heads(num_heads) if num_heads else None
        if heads is None:
            return StructureSpec(pairs=[list(p) for p in self.pairs])
        return StructureSpec(heads=[[list(p) for p in head] for head in heads])

    def confidence(self) -> list[str]:
        """The confidence report, one line per open pair: the estimator, whether the training data identify the
        pair, and the evidence (a coefficient, an attention score, a learned M) with its numbers."""
        said = {True: "identifiable", False: "NOT identifiable", None: "identifiability unknown"}
        return [f"{i} <-> {j}  {self.method}  {said[self.identifiable.get((i, j))]}: {self.reasons.get((i, j), '')}"
                for i, j in self.pairs]

    def to_yaml(self, num_heads: int | None = None) -> str:
        """The YAML ``--model.structure`` reads, with the summary and the confidence report as comments: the
        identifiable pairs, then those the data do not identify, then those whose identifiability is unknown."""
        heads = self.heads(num_heads) if num_heads else None
        layout = ("one pattern shared by every head" if heads is None else
                  f"laid out over {num_heads} heads: one interaction per head, the heads left over carry them all")
        lines = [f"# Structure discovered by `maskprior discover --method {self.method}` from the training data.",
                 *(f"# {line}" for line in self.summary),
                 f"# {len(self.pairs)} open pair(s) of {self.seq_len} tokens, symmetric, every token's own entry open; "
                 f"{layout}."]
        report = dict(zip(self.pairs, self.confidence(), strict=True))
        for value, title in ((True, "identifiable from the training data"),
                             (False, "not identifiable from the training data (opened: the data fit them)"),
                             (None, "identifiability unknown")):
            chosen = [p for p in self.pairs if self.identifiable.get(p) is value]
            if chosen:
                lines += [f"# {title}: {len(chosen)} pair(s)", *(f"#   {report[p]}" for p in chosen)]

        def pair_list(pairs) -> str:
            return "[" + ", ".join(f"[{i}, {j}]" for i, j in pairs) + "]"

        if heads is None:
            lines.append(f"pairs: {pair_list(self.pairs)}")
        else:
            lines += ["heads:", *(f"  - {pair_list(head)}  # head {h}" for h, head in enumerate(heads))]
        lines += ["symmetric: true", "diagonal: true", ""]
        return "\n".join(lines)


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: register ``fn(datamodule, **options) -> Discovery`` as estimator ``name`` (the contract:
    :class:`Estimator`, checked now). Its options are the
    parameters after ``datamodule`` (and ``make_module``, for one that trains a model), each declared once with a
    type (jsonargparse's constrained types give ranges: ``PositiveInt``, ...), a default, and an ``Args:`` line in
    the docstring: what ``maskprior discover --help``, the YAML and the docs show."""
    return _register(name)


def _estimator(method: str) -> Estimator:
    """Estimator ``method``: a registered one, or ``module.path:function`` of your own (``plugins.resolve``)."""
    return resolve("estimator", method)


def estimator_options(method: str) -> list[str]:
    """The names of estimator ``method``'s options, in its signature's order."""
    return [n for n in inspect.signature(_estimator(method)).parameters if n not in _GIVEN]


def options_parser(method: str, prog: str | None = None) -> ArgumentParser:
    """A jsonargparse parser of estimator ``method``'s options, from its signature and docstring."""
    parser = ArgumentParser(prog=prog, exit_on_error=False, description=None)
    parser.add_function_arguments(_estimator(method), skip=set(_GIVEN), as_group=False)
    return parser


def check_estimator_options(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """Estimator ``method``'s options as given (a mapping, as YAML gives them) with its defaults for the others,
    each of its type and range; a ValueError naming the option, its value and what it expects otherwise."""
    known = estimator_options(method)
    if not isinstance(options, dict):
        raise ValueError(f"the options of estimator {method!r} must be a mapping of option: value, got {options!r}")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"estimator {method!r} has no option {', '.join(unknown)}; its options: {', '.join(known)}")
    try:
        parsed = options_parser(method).parse_object(options)
    except argparse.ArgumentError as err:
        raise ValueError(f"estimator {method!r}: {_one_line(str(err))}") from None
    return {name: parsed[name] for name in known}


def _one_line(message: str) -> str:
    """jsonargparse's 'Parser key "steps":\\n  Not of type PositiveInt: -5 does not conform to restriction v>0' as
    'option steps: not of type PositiveInt: -5 does not conform to restriction v>0'."""
    match = re.match(r'\s*Parser key "([^"]+)":\s*(.*)', message, re.S)
    if match:
        key, rest = match.groups()
        first = rest.strip().splitlines()[0].strip()
        return f"option {key}: {first[:1].lower()}{first[1:]}"
    return " ".join(message.split())


def agreement(pairs: list[tuple[int, int]], structure: Any) -> dict[str, float]:
    """How a discovered structure matches another (the oracle's), over the off-diagonal pairs that either opens in
    any layer or head: ``precision`` (of the discovered pairs, the share the other opens) and ``recall`` (of the
    other's pairs, the share discovered); each only where it is defined (a side with no pair gives none)."""
    open_ = structure.open.flatten(0, 1).any(0)
    n = open_.shape[-1]
    theirs = {(i, j) for i, j in itertools.combinations(range(n), 2) if open_[i, j] or open_[j, i]}
    ours, values = set(pairs), {}
    if ours:
        values["precision"] = len(ours & theirs) / len(ours)
    if theirs:
        values["recall"] = len(ours & theirs) / len(theirs)
    return values


ModuleFactory = Callable[[str], Any]  # init method -> a fresh MaskPriorModule for the task, with no structure


def discover(method: str, datamodule: Any, make_module: ModuleFactory | None = None, **options) -> Discovery:
    """Run estimator ``method`` on ``datamodule`` (its training split) with its options. ``make_module(init)`` builds
    a fresh model to train (the model-based estimators need it; the ``maskprior discover`` command and
    ``--model.structure discover:<method>`` give the run's own). On a Boolean task, the pairs of an estimator that
    does not read the seen region itself are marked identifiable or not by the ``fourier`` analysis."""
    estimator = _estimator(method)
    options = check_estimator_options(method, options)
    contracts.check_task_datamodule(datamodule, f"estimator {method!r}")
    datamodule.setup("fit")
    if "make_module" in inspect.signature(estimator).parameters:
        if make_module is None:
            raise ValueError(f"estimator {method!r} trains a model: give make_module (the command and "
                             "--model.structure discover:<method> build the run's own)")
        options = {**options, "make_module": make_module}
    with calling("estimator", method):
        found = estimator(datamodule, **options)
    check_discovery(found, method, datamodule.task_spec().seq_len)
    if method != "fourier" and contracts.is_boolean_task(datamodule):
        _mark_identifiable(found, datamodule)
    return found


def check_discovery(found: Any, method: str, seq_len: int) -> None:
    """Refuse, naming the estimator, a result that is not a Discovery of ``seq_len`` tokens whose pairs are pairs of
    token indices in [0, seq_len): a structure built from it would fail later, or open pairs of another task."""
    where = f"estimator {method!r} returned"
    if not isinstance(found, Discovery):
        raise PluginError(f"{where} a {type(found).__name__}; expected a Discovery (see "
                          "lightning_maskprior.discover.Estimator)")
    if found.seq_len != seq_len:
        raise PluginError(f"{where} a Discovery of {found.seq_len!r} tokens; expected the task's {seq_len}")
    for pair in found.pairs:
        indices = isinstance(pair, tuple | list) and len(pair) == 2 and all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < seq_len for i in pair)
        if not indices:
            raise PluginError(f"{where} the pair {pair!r}; expected two token indices in [0, {seq_len})")


def _mark_identifiable(found: Discovery, datamodule: Any) -> None:
    """Each pair of ``found`` marked as the fourier analysis of the same training data marks it; a pair that analysis
    does not open is one the data give no evidence for (marked not identifiable, and said)."""
    try:
        data = fourier_estimator(datamodule)
    except ValueError as err:
        found.summary.append(f"identifiability unknown: {err}")
        return
    for pair in found.pairs:
        found.identifiable[pair] = data.identifiable.get(pair, False)
        if pair not in data.pairs:
            found.reasons[pair] = found.reasons.get(pair, "") + "; the MDI of the training data holds no term with both"


# ------------------------------------------------------------------------------------------------ fourier
def _name(mask: int) -> str:
    return "*".join(f"x{i}" for i in range(mask.bit_length()) if mask >> i & 1) or "1"


def _expression(terms: dict[int, float]) -> str:
    """``{0b11: 1.0, 0b1: -0.5, 0: 2.0}`` as ``x0*x1 - 0.5 x0 + 2``: highest degree first."""
    parts = []
    for mask, value in sorted(terms.items(), key=lambda t: (-bin(t[0]).count("1"), t[0])):
        size = f"{abs(value):.4g}"
        parts.append(f"{'-' if value < 0 else '+'} " + (_name(mask) if mask and size == "1" else
                                                         f"{size} {_name(mask)}" if mask else size))
    return " ".join(parts).removeprefix("+ ") or "0"


def _variables(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


@register_estimator("fourier")
def fourier_estimator(datamodule: Any, tolerance: PositiveFloat = 1e-6, noise_multiple: PositiveFloat = 6.0
                      ) -> Discovery:
    """Interacting variables of a Boolean task from the MDI of its training data and what its seen region can hide
    (see the module docstring).

    Args:
        tolerance: A coefficient of the MDI counts where its magnitude exceeds this fraction of the largest one.
        noise_multiple: A coefficient of the MDI also counts only above the noise floor: this many times the spread
            it would have if the labels were pure noise, ``sigma x g / sqrt(N)`` with N training points, sigma the
            spread of the labels that the coefficients above the floor leave unexplained (found by repeating until
            it stops falling; all of it at first) and g the seen region's factor for that product (1 where it fixes
            a variable; :func:`~lightning_maskprior.fourier.noise_spread`). Labels that are pure
            noise have each coefficient spread by 1 such unit, so at 6 they open no pair even over the 2^20
            coefficients of the largest cube; noiseless labels leave nothing unexplained, and keep every term.
    """
    if not contracts.is_boolean_task(datamodule) or not hasattr(datamodule.train_set, "tensors"):
        raise ValueError(f"the fourier estimator needs a Boolean task (BooleanGOTUDataModule); got "
                         f"{type(datamodule).__name__}, expected a datamodule with a training set of bits and n "
                         "(lightning_maskprior.contracts.BooleanDataModule)")
    train, n = datamodule.train_set, datamodule.n
    seen = datamodule.seen_region()
    bits = (1 - train.tensors["inputs"].long()).clamp(0, 1)  # bit i of a point's index is set where x_i = -1
    index = (bits << torch.arange(n)).sum(dim=1)
    coefficients, fitted_degree = sample_mdi(index, train.tensors["target"].double(), seen, n)
    hidden = collapses(seen, n)
    t_mask = sum(1 << i for i in relevant_bits(seen, n))  # the variables the seen condition depends on
    largest = float(coefficients.abs().max())
    labels = train.tensors["target"].double()
    spread = noise_spread(seen, n)
    floor, sigma = noise_floor(coefficients, index, labels, spread, noise_multiple)
    above = (coefficients.abs() > tolerance * largest) & (coefficients.abs() > floor)
    below = int(((coefficients.abs() > tolerance * largest) & ~above)[1:].sum())
    terms = {int(s): float(coefficients[s]) for s in torch.nonzero(above).flatten()}
    # the collapses, each with the non-constant terms of its image other than itself: what it leaves in the data
    traces = {b: {c for c, v in image.items() if c and c != b} for b, image in hidden.items()}

    pairs: dict[tuple[int, int], bool] = {}  # pair -> identifiable
    reasons: dict[tuple[int, int], str] = {}
    interactions: list[tuple[int, ...]] = []
    explained: set[int] = set()
    # candidate collapsed products: B x chi_R where the MDI holds every term of B's trace (times chi_R)
    groups = sorted({m & ~t_mask for m in terms})
    for b, trace in sorted(traces.items(), key=lambda t: (bin(t[0]).count("1"), t[0])):
        if not trace:
            continue
        for rest in groups:
            if all((c | rest) in terms for c in trace):
                product = b | rest
                image = _expression({c | rest: v for c, v in hidden[b].items()})
                seen_as = ", ".join(f"{_name(c | rest)} ({terms[c | rest]:+.4g})" for c in sorted(trace))
                interactions.append(tuple(_variables(product)))
                explained |= {c | rest for c in trace}
                for pair in itertools.combinations(_variables(product), 2):
                    reasons.setdefault(pair, f"{_name(product)} would be {image} on the seen "
                                             f"region, and the MDI holds {seen_as}")
                    pairs.setdefault(pair, False)
    # monomials of the MDI of degree >= 2: a pair is identifiable where every product that could give the monomial
    # contains it (the monomial itself; a collapsed product B x chi_R whose trace holds the monomial's part on T)
    for monomial, value in sorted(terms.items(), key=lambda t: (-bin(t[0]).count("1"), t[0])):
        variables = _variables(monomial)
        if len(variables) < 2:
            continue
        on_t = monomial & t_mask
        sources = [b for b, trace in traces.items() if on_t in trace]
        if monomial not in explained:
            interactions.append(tuple(variables))
        for i, j in itertools.combinations(variables, 2):
            both = ((1 << i) | (1 << j)) & t_mask
            others = [b for b in sources if both & ~b]
            if not others:
                pairs[(i, j)] = True
                reasons[(i, j)] = f"share the MDI monomial {_name(monomial)} ({value:+.4g})"
            elif (i, j) not in pairs:
                pairs[(i, j)] = False
                reasons[(i, j)] = (f"share the MDI monomial {_name(monomial)} ({value:+.4g}), which the seen region "
                                   f"also makes of {', '.join(_name(b | (monomial & ~t_mask)) for b in others)}")
    blind = [b for b, trace in traces.items() if not trace and b]
    factors = sorted({round(float(g), 3) for g in spread[spread > 0].unique()})
    summary = [f"MDI of the {len(labels)} training points on the seen region the task declares "
               f"(degree {fitted_degree}): {sum(1 for m in terms if m)} non-constant monomial(s) above {tolerance:g} x "
               f"the largest coefficient ({largest:.4g}) and above the noise floor",
               f"noise floor: {noise_multiple:g} x the spread a coefficient has where the labels are pure noise, "
               f"sigma x g / sqrt(N) = {noise_multiple:g} x {sigma:.4g} x g / sqrt({len(labels)}) = "
               f"{noise_multiple * sigma / math.sqrt(len(labels)):.4g} x g (sigma: the labels' spread the monomials "
               f"above it leave unexplained; g, the seen region's factor: "
               f"{', '.join(f'{g:g}' for g in factors) or '1'}); {below} monomial(s) below it, not counted",
               f"the seen condition depends on {', '.join(_name(1 << i) for i in _variables(t_mask)) or 'nothing'}; "
               f"products it changes: " + ("; ".join(f"{_name(b)} -> {_expression(hidden[b])}" for b in
                                                      sorted(hidden, key=lambda b: (bin(b).count('1'), b))) or "none")]
    if blind:
        summary.append("a product the seen region makes a constant leaves no trace in the data, so whether a term "
                       f"also had the factor {', '.join(_name(b) for b in blind)} cannot be told (nothing opened)")
    ordered = sorted(pairs)
    summary.append(f"{sum(pairs.values())} identifiable pair(s), {len(pairs) - sum(pairs.values())} not identifiable")
    return Discovery("fourier", n, ordered, {p: reasons[p] for p in ordered}, summary, _unique(interactions),
                     {p: pairs[p] for p in ordered})


def noise_floor(coefficients: torch.Tensor, index: torch.Tensor, labels: torch.Tensor, spread: torch.Tensor,
                multiple: float) -> tuple[torch.Tensor, float]:
    """The noise floor of each MDI coefficient, ``multiple x sigma x spread / sqrt(N)`` (N: the training points), and
    sigma: the root mean square of what the coefficients above the floor leave of the labels (``index``: each
    point's cube index). Sigma starts at the labels' spread about their mean (the constant always counts) and is
    recomputed from the coefficients above the floor until no other one rises above it: pure noise keeps its own
    spread, a target without noise ends with nothing unexplained."""
    count = len(labels)
    sigma = float(labels.std(correction=0)) if count else 0.0
    counted = torch.zeros_like(coefficients, dtype=torch.bool)
    for _ in range(len(coefficients)):
        floor = multiple * sigma * spread / math.sqrt(max(count, 1))
        now = coefficients.abs() > floor
        now[0] = True
        if torch.equal(now, counted):
            break
        counted = now
        masks = torch.nonzero(counted).flatten()
        fitted = fourier_values(index, masks, coefficients[masks])
        sigma = min(sigma, float((labels - fitted).pow(2).mean().sqrt()))
    return multiple * sigma * spread / math.sqrt(max(count, 1)), sigma


def fourier_values(index: torch.Tensor, masks: torch.Tensor, values: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``sum_S values[S] chi_S(u)`` at the cube points ``index``, the subsets ``masks`` a chunk at a time."""
    total = torch.zeros(len(index), dtype=torch.float64)
    for start in range(0, len(masks), chunk):
        total += subset_parity(index, masks[start:start + chunk]) @ values[start:start + chunk].double()
    return total


def _unique(items: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Without repeats, and without a set contained in another one (its pairs are opened with the larger)."""
    unique = list(dict.fromkeys(items))
    return [t for t in unique if not any(set(t) < set(u) for u in unique)]


# ------------------------------------------------------------------------------------- from a trained model
def _batches(datamodule: Any):
    """The training loader's batches, over and over."""
    while True:
        empty = True
        for batch in datamodule.train_dataloader():
            empty = False
            yield batch
        if empty:
            raise ValueError(f"{type(datamodule).__name__}'s training loader is empty")


def _probe(datamodule: Any, size: int) -> dict[str, torch.Tensor]:
    """The first ``size`` training examples (in the loader's order), as one batch."""
    batches, count = [], 0
    for batch in datamodule.train_dataloader():
        batches.append(batch)
        count += len(batch["inputs"])
        if count >= size:
            break
    return {k: torch.cat([b[k] for b in batches])[:size] for k, v in batches[0].items() if torch.is_tensor(v)}


@torch.no_grad()
def _probe_loss(module: Any, probe: dict[str, torch.Tensor]) -> float:
    was_training = module.training
    module.eval()
    try:
        return float(module.objective.loss(module(probe["inputs"]), probe))
    finally:
        module.train(was_training)


def _train(module: Any, datamodule: Any, steps: int, lr: float, penalty: Callable[[], torch.Tensor] | None = None,
           ) -> None:
    """``steps`` Adam steps (at ``lr``) of the module's own loss (+ ``penalty()``) on training batches."""
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=lr)  # M included
    module.train()
    batches = _batches(datamodule)
    for _ in range(steps):
        batch = next(batches)
        loss = module.objective.loss(module(batch["inputs"]), batch)
        if penalty is not None:
            loss = loss + penalty()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    module.eval()


def _check_fit(method: str, seed: int, steps: int, before: float, after: float, max_loss_ratio: float) -> str:
    """One line on how the discovery model fitted; a :class:`NotFitted` where its loss did not fall to
    ``max_loss_ratio`` x its loss at initialisation."""
    ratio = after / before if before > 0 else (0.0 if after <= 0 else math.inf)
    line = (f"seed {seed}: training loss {after:.4g} after {steps} steps, {100 * ratio:.3g}% of its {before:.4g} at "
            f"initialisation")
    if not ratio <= max_loss_ratio:
        raise NotFitted(f"the {method} estimator's model did not fit its training data ({line}; fitted means at most "
                        f"{100 * max_loss_ratio:g}%, max_loss_ratio {max_loss_ratio:g}), so what it would read from "
                        f"it means nothing: give it more steps or another lr")
    return line


def _data_block(module: Any, n: int, size: int) -> int:
    """Where the task's ``n`` tokens start in the ``size`` tokens the attention sees: after the backbone's prefix
    tokens (a CLS token, registers: ``num_prefix_tokens``)."""
    start = contracts.prefix_tokens(module.backbone)
    if start + n != size:
        raise PluginError(f"the attention of {type(module.backbone).__name__} sees {size} tokens, not the task's {n} "
                          f"after its {start} prefix token(s) (num_prefix_tokens); expected {start + n}")
    return start


@dataclass
class Relevance:
    """Where a token stands out most among the tokens of one layer and head: its robust z-score, its effect (its
    mean score minus the median token's, in the score's units), and that layer and head."""

    z: float
    effect: float
    layer: int
    head: int


def relevant_tokens(scores: torch.Tensor, z_threshold: float, min_effect: float) -> dict[int, Relevance]:
    """The tokens that stand out, each where it stands out most. ``scores`` (layers, heads, n, n) holds a symmetric
    score of each pair; a token's relevance in a layer and head is its mean score with the others. A token is
    relevant in a layer and head where that relevance exceeds the median token's by at least ``min_effect`` and by
    a robust z-score ``(s - median) / (1.4826 MAD)`` above ``z_threshold``; relevant where it is so in some layer
    and head. Neither alone suffices: a z-score is large for any spread, however small, and an effect says nothing
    of how far apart the other tokens are."""
    n = scores.shape[-1]
    off = ~torch.eye(n, dtype=torch.bool)
    relevance = ((scores * off).sum(-1) / (n - 1)).double().flatten(0, 1)  # (layers x heads, n)
    median = relevance.median(dim=-1, keepdim=True).values
    effect = relevance - median
    spread = 1.4826 * effect.abs().median(dim=-1, keepdim=True).values
    z = effect / spread.clamp_min(1e-9 + 1e-6 * float(relevance.abs().max()))
    passes = (z > z_threshold) & (effect >= min_effect)
    found = {}
    for i in range(n):
        where = torch.nonzero(passes[:, i]).flatten()
        if len(where):
            k = int(where[z[where, i].argmax()])
            found[i] = Relevance(float(z[k, i]), float(effect[k, i]), *divmod(k, scores.shape[1]))
    return found


def _agreed(method: str, per_seed: dict[int, dict[int, Relevance]], what: str, unit: str, lines: list[str],
            n: int) -> Discovery:
    """The pairs of tokens every seed found relevant, each with its evidence in every seed."""
    sets = [set(found) for found in per_seed.values()]
    common = sorted(set.intersection(*sets)) if sets else []
    pairs = list(itertools.combinations(common, 2))
    reasons = {}
    for i, j in pairs:
        evidence = "; ".join(f"seed {seed}: " + ", ".join(
            f"{k} {found[k].effect:+.3g} {unit} above the median token, z {found[k].z:.1f} (layer {found[k].layer}, "
            f"head {found[k].head})" for k in (i, j)) for seed, found in per_seed.items())
        reasons[(i, j)] = f"both relevant in every seed, by {what}: {evidence}"
    agreement_line = ("relevant tokens by seed: " + "; ".join(
        f"seed {seed}: {', '.join(map(str, sorted(found))) or 'none'}" for seed, found in per_seed.items())
        + f"; found by every seed: {', '.join(map(str, common)) or 'none'} (every pair of them opens)")
    return Discovery(method, n, pairs, reasons, [*lines, agreement_line], list(pairs), dict.fromkeys(pairs))


def _task_length(datamodule: Any) -> int:
    return int(datamodule.task_spec().seq_len)


def _seeds(seeds: Sequence[int], steps: int) -> list[int]:
    seeds = list(dict.fromkeys(int(s) for s in seeds))
    if not seeds:
        raise ValueError("seeds must name at least one seed, got []")
    return seeds if steps else seeds[:1]  # a model read as it is (steps 0) is the same for every seed


def _reference_loss(module: Any, probe: dict[str, torch.Tensor], steps: int) -> float:
    """The loss at initialisation that a fit is measured against: the model's own before training, or (a model read
    as it is, steps 0) that of a fresh copy of it."""
    if steps or not callable(getattr(module, "fresh", None)):
        return _probe_loss(module, probe)
    return _probe_loss(module.fresh("default"), probe)


@register_estimator("attention")
def attention_estimator(datamodule: Any, make_module: ModuleFactory, steps: NonNegativeInt = 300,
                        lr: PositiveFloat = 1e-3, z_threshold: PositiveFloat = 4.0, min_effect: PositiveFloat = 0.25,
                        probe_size: PositiveInt = 256, seeds: list[int] = (0, 1, 2),
                        max_loss_ratio: PositiveFloat = 0.1) -> Discovery:
    """Open the pairs a briefly trained default model attends between both ways (see the module docstring).

    Args:
        steps: Adam steps of the default-init model on the training split, per seed; 0 reads the model as it is (a
            trained run's: ``maskprior discover --run DIR``).
        lr: Their learning rate (the discovery model's own, not the run's optimizer).
        z_threshold: A token is relevant where the robust z-score of its mean attention score among the tokens of a
            layer and head exceeds this (the score: ``sqrt(P_ij P_ji)``, high only where both attend to each other).
        min_effect: A token must also exceed the median token's mean score by at least this, in units of the uniform
            attention 1/N (the minimum effect size: a large z-score of a tiny spread opens nothing).
        probe_size: Training examples the attention (and the loss of the fit check) is averaged over.
        seeds: Seeds of the discovery models' initialisation and batches (forked random states); a pair opens only
            if every seed finds it.
        max_loss_ratio: Each seed's model must fit: its training loss must end at most this fraction of its loss at
            initialisation, or the estimator stops, saying so.
    """
    n = _task_length(datamodule)
    probe, per_seed, lines = _probe(datamodule, probe_size), {}, []
    for seed in _seeds(seeds, steps):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            module = make_module("default")
            before = _reference_loss(module, probe, steps)
            _train(module, datamodule, steps, lr)
            lines.append(_check_fit("attention", seed, steps, before, _probe_loss(module, probe), max_loss_ratio))
            probs = attention_probabilities(module, probe["inputs"])
        start = _data_block(module, n, probs[0].shape[-1])
        mean = torch.stack([p.float().mean(0)[:, start:, start:] for p in probs])  # (layers, heads, n, n)
        scores = (mean * mean.transpose(-2, -1)).sqrt() * probs[0].shape[-1]
        per_seed[seed] = relevant_tokens(scores, z_threshold, min_effect)
    trained = f"{steps} Adam steps of the default init at lr {lr:g}" if steps else "the model as given"
    head = (f"{trained}; attention averaged over {len(probe['inputs'])} training examples; a token is relevant where "
            f"its mean score sqrt(P_ij P_ji) (in units of the uniform attention) is at least {min_effect:g} above the "
            f"median token's and its robust z-score above {z_threshold:g}, in some layer and head")
    return _agreed("attention", per_seed, "mean attention both ways", "x uniform", [head, *lines], n)


@register_estimator("learned")
def learned_estimator(datamodule: Any, make_module: ModuleFactory, steps: PositiveInt = 300, lr: PositiveFloat = 1e-3,
                      sparsity: PositiveFloat = 1e-3, z_threshold: PositiveFloat = 4.0,
                      min_effect: PositiveFloat = 0.1, probe_size: PositiveInt = 256, seeds: list[int] = (0, 1, 2),
                      max_loss_ratio: PositiveFloat = 0.1) -> Discovery:
    """Open the pairs a learnable prior started at 0 holds up against a sparsity penalty (module docstring).

    Args:
        steps: Adam steps with the prior M (and every other weight) trainable, per seed.
        lr: Their learning rate (the discovery model's own, not the run's optimizer).
        sparsity: Weight of the penalty ``sum sigmoid(M)`` over every entry of every layer and head (a per-entry
            pull that does not grow or shrink with the model's size).
        z_threshold: A token is relevant where the robust z-score of its mean ``(M_ij + M_ji) / 2`` among the
            tokens of a layer and head exceeds this.
        min_effect: A token must also exceed the median token's mean M by at least this (the minimum effect size:
            a large z-score of a tiny spread opens nothing; Adam moves M by about lr per step, 0.3 in 300 steps at
            1e-3).
        probe_size: Training examples the loss of the fit check is averaged over.
        seeds: Seeds of the discovery models' initialisation and batches (forked random states); a pair opens only
            if every seed finds it.
        max_loss_ratio: Each seed's model must fit: its training loss must end at most this fraction of its loss at
            initialisation, or the estimator stops, saying so.
    """
    n = _task_length(datamodule)
    probe, per_seed, lines = _probe(datamodule, probe_size), {}, []
    for seed in _seeds(seeds, steps):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            module = make_module("default")
            layers = attention_layers(module)
            size = attention_probabilities(module, probe["inputs"][:1])[0].shape[-1]
            for layer in layers:
                layer.set_prior(torch.zeros(layer.num_heads, size, size), trainable=True)

            def penalty() -> torch.Tensor:
                return sparsity * sum(torch.sigmoid(layer.prior_logits).sum() for layer in layers)  # noqa: B023

            before = _probe_loss(module, probe)
            _train(module, datamodule, steps, lr, penalty)
            lines.append(_check_fit("learned", seed, steps, before, _probe_loss(module, probe), max_loss_ratio))
        start = _data_block(module, n, size)
        logits = torch.stack([layer.prior_logits.detach().float()[:, start:, start:] for layer in layers])
        lines[-1] += f"; M in [{float(logits.min()):.3g}, {float(logits.max()):.3g}]"
        per_seed[seed] = relevant_tokens((logits + logits.transpose(-2, -1)) / 2, z_threshold, min_effect)
    head = (f"{steps} Adam steps at lr {lr:g} with a learnable prior M = 0 and the penalty {sparsity:g} x sum "
            f"sigmoid(M); a token is relevant where its mean (M_ij + M_ji) / 2 is at least {min_effect:g} above the "
            f"median token's and its robust z-score above {z_threshold:g}, in some layer and head")
    return _agreed("learned", per_seed, "mean learned M", "in M", [head, *lines], n)

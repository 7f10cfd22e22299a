"""Where a structure comes from when there is no oracle: estimators that read the training data, in one registry.

    maskprior discover -c boolean/2parity.yaml --method fourier --out structure.yaml
    maskprior fit -c boolean/2parity.yaml -c init/mask.yaml --model.structure structure.yaml

An estimator takes a datamodule (set up for ``fit``) and its own options and returns a :class:`Discovery`: the
open pairs and, for each, why it was opened. It reads the training split only, never the evaluation split or the
task's built-in structure. The result is written as the YAML that ``--model.structure`` reads
(:class:`~lightning_maskprior.priors.StructureSpec`: ``pairs``, symmetric, diagonal open).

``fourier`` (Boolean tasks): the min-degree interpolator (MDI) of the training data, the function a transformer
learns from it (Abbe et al., 2023). On a GOTU seen region some products are not identifiable: wherever x0 = 1 or
x1 = 1, ``x0 x1 = x0 + x1 - 1``, so a pair can collapse into two degree-1 terms. The rule, the same for every task:

- a variable is *relevant* if a monomial of the MDI with a non-zero coefficient contains it;
- two variables that appear together in such a monomial (of degree >= 2) interact;
- the relevant variables that appear in no monomial of degree >= 2 (*isolated*: what a collapsed product leaves)
  interact with each other, since the data cannot tell which of them were one product.

Two estimators read a model trained on the training split instead, so they work for any datamodule. Each trains
a fresh, structure-free copy of the run's model (the same backbone and optimizer) for ``steps`` optimizer steps, in
a forked random state seeded with ``seed`` (the run's own initialisation and data order are untouched):

``attention``: the model trained with the default init; on ``probe_size`` training examples, each layer's and
head's attention probabilities are averaged, and pair (i, j) scores ``sqrt(P_ij P_ji)`` (high only where each
token attends to the other: a token that every other one reads is a hub, not a pair). ``learned``: the model
trained with a learnable prior ``M = 0`` in every layer and head and a sparsity penalty ``sparsity x sum
sigmoid(M)`` added to the loss; the penalty pulls every entry down, the task's gradient holds up the entries it
uses, and pair (i, j) scores ``(M_ij + M_ji) / 2``. Both then apply one rule, the same for every task: a token is
relevant where its mean score with the other tokens stands out among the tokens of some layer and head (a robust
z-score ``(s - median) / (1.4826 MAD)`` above ``Z_THRESHOLD``, 4), and every pair of relevant tokens opens. A
trained model shows which tokens matter more reliably than which of them pair up (a relevant token draws
attention from every other one), as the MDI does on a seen region.

Every estimator also gives its *interactions*: the sets of tokens it takes for one term (fourier: each MDI monomial
of degree >= 2 and each pair of isolated variables; the model-based ones: each pair of relevant tokens). Over a
model's heads they are laid out by one rule (:meth:`Discovery.heads`): with at least two interactions and no more
than heads, each gets a head of its own and the heads left over carry them all; otherwise every head carries every
pair. Which pairs open is the estimator's; the layout decides, for instance, whether a model can keep ThreeSym's
three products apart (on its seen region ``x0 x1 = x2``, so the data alone cannot tell a product from a variable).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_maskprior.attention import attention_layers, attention_probabilities
from lightning_maskprior.fourier import min_degree_interpolator, walsh_hadamard
from lightning_maskprior.priors import StructureSpec

Estimator = Callable[..., "Discovery"]
ESTIMATORS: dict[str, Estimator] = {}


@dataclass
class Discovery:
    """A discovered structure: open pairs of a ``seq_len``-token sequence, why each was opened, how it was found."""

    method: str
    seq_len: int
    pairs: list[tuple[int, int]]
    reasons: dict[tuple[int, int], str] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)  # one line per fact (threshold, relevant variables, ...)
    # The candidate interactions: each a set of tokens the estimator takes for one term (an MDI monomial, a pair of
    # relevant tokens). ``pairs`` is the union of their pairs; :meth:`heads` lays them out over heads.
    interactions: list[tuple[int, ...]] = field(default_factory=list)

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

    def to_yaml(self, num_heads: int | None = None) -> str:
        """The YAML ``--model.structure`` reads, with the summary and each pair's reason as comments."""
        heads = self.heads(num_heads) if num_heads else None
        layout = ("one pattern shared by every head" if heads is None else
                  f"laid out over {num_heads} heads: one interaction per head, the heads left over carry them all")
        lines = [f"# Structure discovered by `maskprior discover --method {self.method}` from the training data.",
                 *(f"# {line}" for line in self.summary),
                 f"# {len(self.pairs)} open pair(s) of {self.seq_len} tokens, symmetric, every token's own entry open; "
                 f"{layout}."]
        lines += [f"#   {i} <-> {j}: {self.reasons.get((i, j), '')}" for i, j in self.pairs]

        def pair_list(pairs) -> str:
            return "[" + ", ".join(f"[{i}, {j}]" for i, j in pairs) + "]"

        if heads is None:
            lines.append(f"pairs: {pair_list(self.pairs)}")
        else:
            lines += ["heads:", *(f"  - {pair_list(head)}  # head {h}" for h, head in enumerate(heads))]
        lines += ["symmetric: true", "diagonal: true", ""]
        return "\n".join(lines)


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: register ``fn(datamodule, **options) -> Discovery`` as estimator ``name``."""

    def decorator(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        return fn

    return decorator


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
    ``--model.structure discover:<method>`` give the run's own)."""
    if method not in ESTIMATORS:
        raise ValueError(f"unknown discovery method {method!r}; expected one of {sorted(ESTIMATORS)}")
    estimator = ESTIMATORS[method]
    parameters = inspect.signature(estimator).parameters
    known = [n for n in parameters if n not in ("datamodule", "make_module")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"estimator {method!r} has no option {', '.join(unknown)}; its options: {', '.join(known)}")
    datamodule.setup("fit")
    if "make_module" in parameters:
        if make_module is None:
            raise ValueError(f"estimator {method!r} trains a model: give make_module (the command and "
                             "--model.structure discover:<method> build the run's own)")
        return estimator(datamodule, make_module=make_module, **options)
    return estimator(datamodule, **options)


# ------------------------------------------------------------------------------------------------ fourier
def training_mdi(inputs: torch.Tensor, targets: torch.Tensor, n: int) -> torch.Tensor:
    """Fourier coefficients (2^n,) of the MDI of the training data: ``inputs`` (P, n) bits as GOTU's tokens
    (0: x = -1, 1: x = +1), ``targets`` (P,). The seen region is the set of training points; values elsewhere
    are never read (set to 0: the MDI depends on the seen values alone)."""
    bits = (1 - inputs.long()).clamp(0, 1)  # bit i of a point's index is set where x_i = -1
    index = (bits << torch.arange(n)).sum(dim=1)
    seen = torch.zeros(2**n, dtype=torch.bool)
    seen[index] = True
    values = torch.zeros(2**n, dtype=torch.float64)
    values[index] = targets.double()
    return min_degree_interpolator(walsh_hadamard(values) / 2**n, seen, n)


@register_estimator("fourier")
def fourier_estimator(datamodule: Any, tolerance: float = 1e-6) -> Discovery:
    """Interacting variables of a Boolean task from the MDI of its training data (see the module docstring).

    Args:
        tolerance: A coefficient counts when its magnitude exceeds ``tolerance`` x the largest one.
    """
    train = getattr(datamodule, "train_set", None)
    n = getattr(datamodule, "n", None)
    if train is None or n is None or not hasattr(train, "tensors"):
        raise ValueError(f"the fourier estimator needs a Boolean task (BooleanGOTUDataModule); got "
                         f"{type(datamodule).__name__}, expected a datamodule with a training set of bits and n")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance!r}")
    coefficients = training_mdi(train.tensors["inputs"], train.tensors["target"], n)
    largest = float(coefficients.abs().max())
    significant = [int(s) for s in torch.nonzero(coefficients.abs() > tolerance * largest).flatten() if s]
    monomials = [[i for i in range(n) if s >> i & 1] for s in significant]
    relevant = sorted({i for m in monomials for i in m})
    reasons: dict[tuple[int, int], str] = {}
    interactions = [tuple(m) for m in monomials if len(m) >= 2]
    for s, variables in zip(significant, monomials, strict=True):
        if len(variables) >= 2:
            name = "*".join(f"x{i}" for i in variables)
            for pair in itertools.combinations(variables, 2):
                reasons.setdefault(pair, f"share the MDI monomial {name} ({float(coefficients[s]):+.4g})")
    in_products = {i for m in monomials if len(m) >= 2 for i in m}
    isolated = [i for i in relevant if i not in in_products]
    for pair in itertools.combinations(isolated, 2):
        interactions.append(pair)  # each pair of isolated variables is one candidate collapsed product
        reasons.setdefault(pair, "relevant, in degree-1 terms only (a product the seen region collapsed)")
    summary = [f"MDI of {len(train.tensors['target'])} training points: {len(significant)} non-constant monomial(s) "
               f"above {tolerance:g} x the largest coefficient ({largest:.4g})",
               f"relevant variables: {', '.join(f'x{i}' for i in relevant) or 'none'}; isolated: "
               f"{', '.join(f'x{i}' for i in isolated) or 'none'}"]
    return Discovery("fourier", n, sorted(reasons), reasons, summary, interactions)


# ------------------------------------------------------------------------------------- from a trained model
def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def _batches(datamodule: Any):
    """The training loader's batches, over and over."""
    while True:
        empty = True
        for batch in datamodule.train_dataloader():
            empty = False
            yield batch
        if empty:
            raise ValueError(f"{type(datamodule).__name__}'s training loader is empty")


def _probe(datamodule: Any, size: int) -> torch.Tensor:
    """The first ``size`` training inputs (in the loader's order)."""
    inputs, count = [], 0
    for batch in datamodule.train_dataloader():
        inputs.append(batch["inputs"])
        count += len(batch["inputs"])
        if count >= size:
            break
    return torch.cat(inputs)[:size]


def _train(module: Any, datamodule: Any, steps: int, lr: float, penalty: Callable[[], torch.Tensor] | None = None,
           ) -> float:
    """``steps`` Adam steps of the module's own loss (+ ``penalty()``) on training batches; the last loss."""
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=lr)  # M included
    module.train()
    batches = _batches(datamodule)
    last = float("nan")
    for _ in range(steps):
        batch = next(batches)
        loss = module.objective.loss(module(batch["inputs"]), batch)
        if penalty is not None:
            loss = loss + penalty()
        last = float(loss.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    module.eval()
    return last


def _data_block(module: Any, n: int) -> int:
    """Where the task's ``n`` tokens start in the sequence the attention sees (after prefix tokens like a CLS)."""
    seq = getattr(module.backbone, "seq_len", n) + getattr(module.backbone, "num_extra_tokens", 0)
    return seq - n


def _robust_z(values: torch.Tensor) -> torch.Tensor:
    """``(v - median) / (1.4826 MAD)`` along the last axis (a spread of 0 counts as a tiny one)."""
    values = values.double()
    median = values.median(dim=-1, keepdim=True).values
    spread = 1.4826 * (values - median).abs().median(dim=-1, keepdim=True).values
    return (values - median) / spread.clamp_min(1e-9 + 1e-6 * float(values.abs().max()))


def _open_pairs(scores: torch.Tensor, z_threshold: float, what: str) -> tuple[list, dict, list[int]]:
    """The pairs among the variables that stand out. ``scores`` (layers, heads, n, n) holds a symmetric score of
    each pair; a variable's relevance in a layer and head is its mean score with the others, and a variable is
    relevant where that relevance's robust z-score among the n variables exceeds ``z_threshold`` in some layer and
    head. Every pair of relevant variables opens: a trained model (like the MDI, see above) shows which variables
    matter more reliably than which of them pair up (a relevant token draws attention from every other)."""
    n = scores.shape[-1]
    off = ~torch.eye(n, dtype=torch.bool)
    relevance = (scores * off).sum(-1) / (n - 1)  # (layers, heads, n)
    z = _robust_z(relevance).flatten(0, 1)  # (layers x heads, n)
    best = z.max(dim=0)
    relevant = [i for i in range(n) if float(best.values[i]) > z_threshold]
    reasons = {}
    for i, j in itertools.combinations(relevant, 2):
        where = [divmod(int(best.indices[k]), scores.shape[1]) for k in (i, j)]
        reasons[(i, j)] = (f"both relevant: {what} z = {float(best.values[i]):.1f} (layer {where[0][0]}, head "
                           f"{where[0][1]}) and {float(best.values[j]):.1f} (layer {where[1][0]}, head {where[1][1]})")
    return sorted(reasons), reasons, relevant


def _relevant_line(relevant: list[int], z_threshold: float) -> str:
    return (f"relevant tokens (robust z-score of their mean score above {z_threshold:g} in some layer and head): "
            f"{', '.join(map(str, relevant)) or 'none'}; every pair of them opens")


def _task_length(datamodule: Any) -> int:
    return int(datamodule.task_spec().seq_len)


Z_THRESHOLD = 4.0  # the one rule of both model-based estimators: a pair opens at a robust z-score above this


@register_estimator("attention")
def attention_estimator(datamodule: Any, make_module: ModuleFactory, steps: int = 300, lr: float = 1e-3,
                        z_threshold: float = Z_THRESHOLD, probe_size: int = 256, seed: int = 0) -> Discovery:
    """Open the pairs a briefly trained default model attends between both ways (see the module docstring).

    Args:
        steps: Adam steps of the default-init model on the training split; 0 reads the model as it is (a trained
            run's: ``maskprior discover --run DIR``).
        lr: Its learning rate.
        z_threshold: A token is relevant where the robust z-score of its mean attention score (``sqrt(P_ij P_ji)``,
            high only where both tokens attend to each other) among the tokens of a layer and head exceeds this.
        probe_size: Training examples the attention is averaged over.
        seed: Seed of the discovery model's initialisation and batches (a forked random state).
    """
    _check_positive(lr=lr, z_threshold=z_threshold, probe_size=probe_size)
    if steps < 0:
        raise ValueError(f"steps must be >= 0 (0: read the model as make_module gives it), got {steps!r}")
    n = _task_length(datamodule)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = make_module("default")
        loss = _train(module, datamodule, steps, lr) if steps else float("nan")
        probs = attention_probabilities(module, _probe(datamodule, probe_size))
    start = _data_block(module, n)
    mean = torch.stack([p.float().mean(0)[:, start:, start:] for p in probs])  # (layers, heads, n, n)
    scores = (mean * mean.transpose(-2, -1)).sqrt() * probs[0].shape[-1]
    pairs, reasons, relevant = _open_pairs(scores, z_threshold, "mean attention both ways,")
    trained = f"{steps} steps of the default init (final training loss {loss:.4g})" if steps else "the model as given"
    summary = [f"{trained}; attention averaged over "
               f"{probe_size} training examples; score sqrt(P_ij P_ji) in units of the uniform 1/{probs[0].shape[-1]}",
               _relevant_line(relevant, z_threshold)]
    return Discovery("attention", n, pairs, reasons, summary, pairs)


@register_estimator("learned")
def learned_estimator(datamodule: Any, make_module: ModuleFactory, steps: int = 300, lr: float = 1e-3,
                      sparsity: float = 1e-3, z_threshold: float = Z_THRESHOLD, seed: int = 0) -> Discovery:
    """Open the pairs a learnable prior started at 0 holds up against a sparsity penalty (module docstring).

    Args:
        steps: Adam steps with the prior M (and every other weight) trainable.
        lr: Their learning rate.
        sparsity: Weight of the penalty ``sum sigmoid(M)`` over every entry of every layer and head (a per-entry
            pull that does not grow or shrink with the model's size).
        z_threshold: A token is relevant where the robust z-score of its mean ``(M_ij + M_ji) / 2`` among the
            tokens of a layer and head exceeds this.
        seed: Seed of the discovery model's initialisation and batches (a forked random state).
    """
    _check_positive(steps=steps, lr=lr, sparsity=sparsity, z_threshold=z_threshold)
    n = _task_length(datamodule)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = make_module("default")
        layers = attention_layers(module)
        size = attention_probabilities(module, _probe(datamodule, 1))[0].shape[-1]
        for layer in layers:
            layer.set_prior(torch.zeros(layer.num_heads, size, size), trainable=True)

        def penalty() -> torch.Tensor:
            return sparsity * sum(torch.sigmoid(layer.prior_logits).sum() for layer in layers)

        loss = _train(module, datamodule, steps, lr, penalty)
    start = _data_block(module, n)
    logits = torch.stack([layer.prior_logits.detach().float()[:, start:, start:] for layer in layers])
    pairs, reasons, relevant = _open_pairs((logits + logits.transpose(-2, -1)) / 2, z_threshold, "mean M,")
    summary = [f"{steps} steps with a learnable prior M = 0 and the penalty {sparsity:g} x sum sigmoid(M) (final "
               f"loss {loss:.4g}); M ranges over [{float(logits.min()):.3g}, {float(logits.max()):.3g}]",
               _relevant_line(relevant, z_threshold)]
    return Discovery("learned", n, pairs, reasons, summary, pairs)

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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_maskprior.fourier import min_degree_interpolator, walsh_hadamard

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

    def to_yaml(self) -> str:
        """The YAML ``--model.structure`` reads, with the summary and each pair's reason as comments."""
        lines = [f"# Structure discovered by `maskprior discover --method {self.method}` from the training data.",
                 *(f"# {line}" for line in self.summary),
                 f"# {len(self.pairs)} open pair(s) of {self.seq_len} tokens, symmetric, every token's own entry open."]
        lines += [f"#   {i} <-> {j}: {self.reasons.get((i, j), '')}" for i, j in self.pairs]
        pairs = ", ".join(f"[{i}, {j}]" for i, j in self.pairs)
        lines += [f"pairs: [{pairs}]", "symmetric: true", "diagonal: true", ""]
        return "\n".join(lines)


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: register ``fn(datamodule, **options) -> Discovery`` as estimator ``name``."""

    def decorator(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        return fn

    return decorator


def discover(method: str, datamodule: Any, **options) -> Discovery:
    """Run estimator ``method`` on ``datamodule`` (its training split) with its options."""
    if method not in ESTIMATORS:
        raise ValueError(f"unknown discovery method {method!r}; expected one of {sorted(ESTIMATORS)}")
    datamodule.setup("fit")
    return ESTIMATORS[method](datamodule, **options)


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
    for s, variables in zip(significant, monomials, strict=True):
        if len(variables) >= 2:
            name = "*".join(f"x{i}" for i in variables)
            for pair in itertools.combinations(variables, 2):
                reasons.setdefault(pair, f"share the MDI monomial {name} ({float(coefficients[s]):+.4g})")
    in_products = {i for m in monomials if len(m) >= 2 for i in m}
    isolated = [i for i in relevant if i not in in_products]
    for pair in itertools.combinations(isolated, 2):
        reasons.setdefault(pair, "relevant, in degree-1 terms only (a product the seen region collapsed)")
    summary = [f"MDI of {len(train.tensors['target'])} training points: {len(significant)} non-constant monomial(s) "
               f"above {tolerance:g} x the largest coefficient ({largest:.4g})",
               f"relevant variables: {', '.join(f'x{i}' for i in relevant) or 'none'}; isolated: "
               f"{', '.join(f'x{i}' for i in isolated) or 'none'}"]
    return Discovery("fourier", n, sorted(reasons), reasons, summary)

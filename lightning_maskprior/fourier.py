"""Boolean functions on {-1, +1}^n: Fourier expansions and the min-degree interpolator (MDI).

Points of the cube are indexed by integers u in [0, 2^n): bit i of u set means x_i = -1. A subset S
of variables is an integer too, and the monomial chi_S(x) = prod_{i in S} x_i = (-1)^popcount(u & S).
So evaluation and the Fourier transform are both the Walsh-Hadamard transform.
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

MAX_CUBE_BITS = 20  # 2^20 points: about a million, held in memory as float64


def cube_points(n: int) -> Tensor:
    """All 2^n points as a (2^n, n) float tensor of +-1 (row u is point u)."""
    check_cube_bits(n)
    u = torch.arange(2**n)
    bits = (u.unsqueeze(1) >> torch.arange(n)) & 1
    return (1 - 2 * bits).to(torch.float32)


def check_cube_bits(n: int) -> None:
    if not 1 <= n <= MAX_CUBE_BITS:
        raise ValueError(f"n={n} bits is outside 1..{MAX_CUBE_BITS} (the full cube must fit in memory)")


def walsh_hadamard(values: Tensor) -> Tensor:
    """Unnormalised Walsh-Hadamard transform along the last axis (length 2^n).

    Coefficients -> values: ``f = walsh_hadamard(c)``. Values -> coefficients:
    ``c = walsh_hadamard(f) / 2^n``.
    """
    size = values.shape[-1]
    if size & (size - 1):
        raise ValueError(f"length {size} is not a power of two")
    lead = values.shape[:-1]
    x = values.reshape(-1, size)
    h = 1
    while h < size:
        x = x.view(x.shape[0], size // (2 * h), 2, h)
        x = torch.stack((x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]), dim=2)
        h *= 2
    return x.reshape(*lead, size)


_MONOMIAL = re.compile(r"^\s*x(\d+)\s*$")


def parse_monomial(text: str, n: int | None = None) -> int:
    """``"x0*x1"`` -> subset mask 0b11; ``"1"`` or ``""`` -> 0 (the constant). With ``n``, every variable
    must be one of x0 .. x{n-1} (checked before the mask is built, so x99999999999 costs nothing)."""
    text = text.strip()
    if text in ("", "1"):
        return 0
    mask = 0
    for factor in text.split("*"):
        match = _MONOMIAL.match(factor)
        if not match:
            raise ValueError(f"cannot read monomial {text!r}: expected factors like x0*x3, or '1'")
        index = int(match.group(1))
        if n is not None and index >= n:
            raise ValueError(f"monomial {text!r} uses x{index}; expected variables x0 .. x{n - 1} (n={n})")
        bit = 1 << index
        if mask & bit:
            raise ValueError(f"monomial {text!r} repeats a variable (x_i^2 = 1 on the cube)")
        mask |= bit
    return mask


def coefficients_from_expansion(expansion: dict[str, float], n: int) -> Tensor:
    """Dense Fourier coefficients (2^n,) from ``{"x0*x1": 1.0, "x2": -0.5, "1": 0.25}``."""
    check_cube_bits(n)
    coefficients = torch.zeros(2**n, dtype=torch.float64)
    for monomial, value in expansion.items():
        mask = parse_monomial(str(monomial), n)
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if number is None or not math.isfinite(number):
            raise ValueError(f"the coefficient of {monomial!r} is {value!r}; expected a finite number")
        coefficients[mask] += float(number)
    return coefficients


def degree(masks: Tensor) -> Tensor:
    """Number of variables in each subset mask."""
    count = torch.zeros_like(masks)
    m = masks.clone()
    while bool((m > 0).any()):
        count += m & 1
        m = m >> 1
    return count


def relevant_bits(mask_values: Tensor, n: int) -> list[int]:
    """Coordinates that ``mask_values`` (a function on the cube) depends on."""
    u = torch.arange(2**n)
    return [i for i in range(n) if bool((mask_values != mask_values[u ^ (1 << i)]).any())]


def _null_space(matrix: Tensor, rtol: float = 1e-10) -> Tensor:
    """Orthonormal basis (columns) of the null space of ``matrix``."""
    if matrix.shape[0] == 0:
        return torch.eye(matrix.shape[1], dtype=matrix.dtype)
    _, s, vh = torch.linalg.svd(matrix, full_matrices=True)
    rank = int((s > rtol * max(1.0, float(s.max()) if s.numel() else 1.0)).sum())
    return vh[rank:].T


def mdi_operator(seen: Tensor) -> Tensor:
    """The linear map from Fourier coefficients to those of the min-degree interpolator.

    ``seen`` is a Boolean (2^k,) mask over a small cube. The MDI of g on the seen points is the
    function that equals g there and has the lexicographically smallest degree profile (Fourier
    mass of degree k first, then k-1, ...; Abbe et al. 2023). Each degree step is a least-norm
    problem on an affine set, so the whole map is linear: returns L with ``c_mdi = L @ c``.
    """
    size = seen.numel()
    k = size.bit_length() - 1
    hadamard = walsh_hadamard(torch.eye(size, dtype=torch.float64))  # H[u, S] (symmetric)
    vanish = _null_space(hadamard[seen.bool()])  # coefficient vectors that are 0 on every seen point
    degrees = degree(torch.arange(size))
    eye = torch.eye(size, dtype=torch.float64)
    z = torch.zeros(vanish.shape[1], size, dtype=torch.float64)  # c = g + vanish @ z
    free = torch.eye(vanish.shape[1], dtype=torch.float64)  # z may still move along these columns
    for d in range(k, -1, -1):
        if free.shape[1] == 0:
            break
        rows = degrees == d
        a = vanish[rows] @ free
        residual = (eye + vanish @ z)[rows]
        z = z - free @ (torch.linalg.pinv(a) @ residual)
        free = free @ _null_space(a)
    return eye + vanish @ z


def min_degree_interpolator(coefficients: Tensor, seen: Tensor, n: int) -> Tensor:
    """Fourier coefficients of the MDI of f (given by ``coefficients``) on the seen region.

    ``seen`` is a Boolean mask over the 2^n points. The seen condition usually depends on a few
    coordinates T; then chi_S = chi_{S & T} chi_{S \\ T}, the factor on T is replaced by its MDI on
    the seen part of the small cube over T, and the rest is untouched. This is exact, and cheap
    while |T| is small.
    """
    bits = relevant_bits(seen, n)
    k = len(bits)
    if k > 12:
        raise ValueError(
            f"the seen condition depends on {k} coordinates; the exact MDI is computed only up to 12"
        )
    if k == 0:
        return coefficients.clone()
    t_mask = sum(1 << b for b in bits)
    u = torch.arange(2**n)
    # Seen pattern over the small cube on T (seen depends only on those bits).
    small = torch.zeros(2**k, dtype=torch.long)
    for j, b in enumerate(bits):
        small |= ((torch.arange(2**k) >> j) & 1) << b
    seen_small = seen[small]
    operator = mdi_operator(seen_small)
    # Split every subset S into its part on T (compressed to k bits) and the rest.
    on_t = torch.zeros_like(u)
    for j, b in enumerate(bits):
        on_t |= ((u >> b) & 1) << j
    rest = u & ~t_mask
    rest_ids, rest_index = torch.unique(rest, return_inverse=True)
    grouped = torch.zeros(2**k, rest_ids.numel(), dtype=torch.float64)
    grouped[on_t, rest_index] = coefficients.to(torch.float64)
    mapped = operator @ grouped
    return mapped[on_t, rest_index]


# ------------------------------------------------------------------------------ what a seen region hides
def subset_parity(points: Tensor, subsets: Tensor) -> Tensor:
    """chi_S(u) = (-1)^popcount(u & S) for point indices ``points`` (P,) and subset masks ``subsets`` (K,): (P, K)."""
    v = points.long().unsqueeze(1) & subsets.long().unsqueeze(0)
    for shift in (32, 16, 8, 4, 2, 1):
        v = v ^ (v >> shift)
    return (1 - 2 * (v & 1)).to(torch.float64)


def subsets_up_to(n: int, max_degree: int) -> Tensor:
    """Every subset mask of n variables with at most ``max_degree`` of them, by degree then value."""
    masks = torch.arange(2**n)
    degrees = degree(masks)
    order = torch.argsort(degrees * 2**n + masks)
    return masks[order][degrees[order] <= max_degree]


def collapses(seen: Tensor, n: int) -> dict[int, dict[int, float]]:
    """The products that the seen region hides, each with what it becomes there.

    The seen condition depends on a few coordinates T (``seen`` is a Boolean mask over the 2^n points). A monomial
    chi_A factors as chi_{A & T} chi_{A \\ T}; on the seen region only the factor on T can change: it equals its
    min-degree interpolator on the seen part of the small cube over T. Returns ``{B: image}`` for every subset B of T
    whose image is not chi_B itself (``image``: subset mask -> coefficient, masks over the n variables). Any product
    of the target whose part on T is such a B reaches the training data as ``image x chi_{A \\ T}``: a pair into its
    two variables (2Parity), a triple into pairs (Cyclic3), a product into a variable (ThreeSym), into a constant (a
    variable that the seen region fixes). A product whose part on T is not one of them reaches the data unchanged.
    """
    bits = relevant_bits(seen, n)
    if len(bits) > 12:
        raise ValueError(f"the seen condition depends on {len(bits)} coordinates; the exact MDI is computed only up "
                         "to 12")
    k = len(bits)
    small = torch.zeros(2**k, dtype=torch.long)  # small-cube index -> cube index (the other coordinates at +1)
    for j, b in enumerate(bits):
        small |= ((torch.arange(2**k) >> j) & 1) << b
    operator = mdi_operator(seen[small]) if k else torch.ones(1, 1, dtype=torch.float64)
    found: dict[int, dict[int, float]] = {}
    for column in range(2**k):
        image = operator[:, column]
        own = torch.zeros_like(image)
        own[column] = 1.0
        if float((image - own).abs().max()) > 1e-9:
            found[int(small[column])] = {int(small[row]): float(image[row])
                                         for row in torch.nonzero(image.abs() > 1e-9).flatten()}
    return found


def noise_spread(seen: Tensor, n: int) -> Tensor:
    """How far each Fourier coefficient of the MDI moves under pure noise, per unit of noise: (2^n,) factors g such that
    where every seen point's label is independent noise of spread sigma, the MDI's coefficient of S (from all
    ``N`` seen points) spreads by ``sigma g[S] / sqrt(N)``.

    g depends only on the product's part on the seen condition's variables. It is 1 on a seen region that fixes
    variables (x0 = 1: each coefficient is a plain average over the N points) and 0 for a product of them (the MDI
    is 0 there whatever the labels); above 1 where the MDI rebuilds a coefficient from part of the small cube over
    those variables (where x3 = 1 or x7 = 1, sqrt(3/2) for every product: each is a difference of two of the three
    seen quarters). Exact for the whole seen region; for a sample of it, the same within the sampling's own spread.
    """
    bits = relevant_bits(seen, n)
    k = len(bits)
    if k > 12:
        raise ValueError(f"the seen condition depends on {k} coordinates; the exact MDI is computed only up to 12")
    small = torch.zeros(2**k, dtype=torch.long)  # small-cube index -> cube index (the other coordinates at +1)
    for j, b in enumerate(bits):
        small |= ((torch.arange(2**k) >> j) & 1) << b
    seen_small = seen[small]
    # the MDI's coefficients on the small cube from the values at its seen points: the Walsh transform of the values
    # (0 at the unseen points), then the MDI's operator; each seen point's value is an average over 2^(n-k) points
    hadamard = walsh_hadamard(torch.eye(2**k, dtype=torch.float64))
    operator = mdi_operator(seen_small) if k else torch.ones(1, 1, dtype=torch.float64)
    weights = operator @ hadamard[:, seen_small] / 2**k
    factor = (int(seen_small.sum()) * (weights**2).sum(dim=1)).sqrt()
    u = torch.arange(2**n)
    on_t = torch.zeros_like(u)
    for j, b in enumerate(bits):
        on_t |= ((u >> b) & 1) << j
    return factor[on_t]


def sample_mdi(index: Tensor, values: Tensor, seen: Tensor, n: int) -> tuple[Tensor, int]:
    """Fourier coefficients (2^n,) of the MDI on the seen region of a function known only at some seen points.

    ``index`` (P,): cube indices of the known points (all seen), ``values`` (P,) the function there, ``seen`` the
    seen region (a Boolean mask over the 2^n points). Where the points are the whole seen region this is
    :func:`min_degree_interpolator` of their values. Otherwise the lowest degree d at which a polynomial fits the
    points exactly is found, and the points must determine a polynomial of degree d on the whole seen region (the
    sample's rank equals the seen region's at that degree); that polynomial's MDI is returned with d.
    A ValueError says where the sample does not determine it.
    """
    index, values = index.long(), values.to(torch.float64)
    if not bool(seen[index].all()):
        raise ValueError("a training point lies outside the seen condition the task declares")
    if int(torch.unique(index).numel()) == int(seen.sum()):
        dense = torch.zeros(2**n, dtype=torch.float64)
        dense[index] = values
        coefficients = min_degree_interpolator(walsh_hadamard(dense) / 2**n, seen, n)
        support = torch.nonzero(coefficients.abs() > 1e-9).flatten()
        return coefficients, int(degree(support).max()) if len(support) else 0
    bits = relevant_bits(seen, n)
    small = torch.zeros(2 ** len(bits), dtype=torch.long)
    for j, b in enumerate(bits):
        small |= ((torch.arange(2 ** len(bits)) >> j) & 1) << b
    seen_small = small[seen[small]]  # the seen part of the small cube over T, as cube indices
    on_t = small[torch.argsort(degree(torch.arange(len(small))), stable=True)]  # subsets of T, by degree
    scale = max(1.0, float(values.abs().max()))
    for d in range(n + 1):
        subsets = subsets_up_to(n, d)
        if len(subsets) > 2 * len(index) + 64:  # far more monomials than points: they cannot determine them
            break
        design = subset_parity(index, subsets)
        solution = torch.linalg.lstsq(design, values.unsqueeze(1), driver="gelsd")
        fitted = design @ solution.solution
        if float((fitted.squeeze(1) - values).abs().max()) > 1e-6 * scale:
            continue
        # the seen region's rank at degree d: functions there are (functions on the seen part of T's small cube) x
        # chi_R for R outside T, so it is a sum over |R| = r of C(n - k, r) x the small cube's rank at degree d - r
        rank_seen = sum(math.comb(n - len(bits), r) * _rank_on(seen_small, on_t, d - r) for r in range(d + 1))
        rank_sample = int(torch.linalg.matrix_rank(design))
        if rank_sample < rank_seen:
            raise ValueError(
                f"the {len(index)} training points do not determine the target on the seen region: the lowest "
                f"degree that fits them is {d}, where the seen region has {rank_seen} independent monomials and the "
                f"points {rank_sample}; train on more points (max_train_points)")
        coefficients = torch.zeros(2**n, dtype=torch.float64)
        coefficients[subsets] = solution.solution.squeeze(1)
        return min_degree_interpolator(coefficients, seen, n), d
    raise ValueError(f"no polynomial fits the {len(index)} training points at a degree they can determine; train on "
                     "more points (max_train_points)")


def _rank_on(points: Tensor, subsets: Tensor, max_degree: int) -> int:
    """Rank of the monomials ``subsets`` of degree <= ``max_degree`` on the cube points ``points``."""
    chosen = subsets[degree(subsets) <= max_degree]
    return int(torch.linalg.matrix_rank(subset_parity(points, chosen))) if len(chosen) else 0

"""PriorAttention: multi-head self-attention whose logits get a learnable prior ``log sigmoid(M)``.

This is the only attention class the project's backbones use. ``M`` is a (heads, N, N) matrix (or (1, N, N), shared
by every head) that the init methods in ``inits.py`` fill in; without a prior the layer is plain attention. How
``M`` is held is the layer's ``parameterisation`` (:data:`PARAMETERISATIONS`):

- ``full``: ``M`` itself, the parameter ``prior_logits`` (the paper's; heads x N^2 numbers);
- ``relative``: one value per head and offset between query and key, ``prior_offsets`` (heads, 2R - 1, 2C - 1) over
  an R x C grid of tokens (R = 1 for a sequence: the offset i - j), so ``M`` is Toeplitz (block-Toeplitz on a patch
  grid); prefix tokens (a CLS token, registers) keep their rows and columns as ``prior_prefix_rows`` and
  ``prior_prefix_columns``. O(N) numbers per head;
- ``low_rank``: ``M = U V^T + diag(d)``, ``prior_left`` U and ``prior_right`` V (heads, N, r), ``prior_diagonal`` d.

Every parameterisation is installed from a full ``M`` (:meth:`PriorCarrier.set_prior`, which projects it and keeps
the projection's error in ``projection_error``) and read back as one (:meth:`PriorCarrier.prior_matrix`): the init
methods, the callbacks and ``export_prior`` see an (heads, N, N) ``M`` whatever holds it.

Two kernels compute the same function (the tests check they agree in value and gradient):

- ``sdpa``: ``F.scaled_dot_product_attention`` on the fused query/key/value projection. On a GPU it runs
  fused flash / memory-efficient kernels, with the prior as an additive mask.
- ``explicit``: the fused projection viewed as q, k and v, ``softmax(q k^T / sqrt(d) + prior) v`` as matmuls,
  with the softmax of short rows in float32 (:func:`softmax_rows`). On a CPU it is the faster one in both
  dtypes. For the 2parity CPU model (2 threads, batch 256, 15 tokens, head
  width 64), one training step of the default / the mask takes (measured with ``benchmarks/step_speed.py``):
  - fp32: explicit 106 / 111 ms against SDPA 126 / 126 ms;
  - bf16 autocast: 58 / 53 ms against 175 / 91 ms. SDPA's CPU bf16 kernel is slower than its fp32 one at
    this shape, and a grad-requiring prior sends SDPA to its unfused math kernel.

``kernel="auto"`` (the default) picks per device and dtype with :func:`kernel_for`.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KERNELS = ("auto", "sdpa", "explicit", "flex")

Parameterisation = Literal["full", "relative", "low_rank"]
# How a layer holds its prior M (the module doc); ``full`` is the paper's and the default.
PARAMETERISATIONS: tuple[str, ...] = typing.get_args(Parameterisation)
# The parameters that hold M, by parameterisation: the optimizer's prior group and the checkpoint check read them.
PRIOR_PARAMETERS: dict[str, tuple[str, ...]] = {
    "full": ("prior_logits",),
    "relative": ("prior_offsets", "prior_prefix_rows", "prior_prefix_columns"),
    "low_rank": ("prior_left", "prior_right", "prior_diagonal"),
}
PRIOR_PARAMETER_NAMES: tuple[str, ...] = tuple(name for names in PRIOR_PARAMETERS.values() for name in names)
DEFAULT_RANK = 8  # the rank r of a ``low_rank`` prior when none is given
LOW_RANK_FIT_STEPS = 100  # at most this many rounds of the low_rank projection (project_prior)

# The lowest prior term the attention adds: log sigmoid(s M) below it counts as PRIOR_FLOOR. A weight of e^-30
# (1e-13) against an open entry's is already below float32's resolution in the softmax and in its output, so the
# attention is unchanged; what the floor prevents is the language prior's -10 per token of distance (-630 at
# 63 tokens) pushing exp() into denormal floats, which a CPU computes several times slower: measured on GPT-2 at
# width 128 (12 blocks, 64 tokens, fp32, 2 threads), a training step with the language prior took 1.23x the
# untouched model's without the floor and 1.04x with it (benchmarks/inject_overhead.py --family hf). M's gradient
# below the floor, at most about e^-30 of an open entry's, becomes 0.
PRIOR_FLOOR = -30.0


def kernel_for(device_type: str) -> str:
    """The attention kernel ``auto`` uses on this device type (see the module doc).

    On a CPU: ``explicit``, in float32 and bfloat16 alike (measured, benchmarks/step_speed.py). Elsewhere:
    ``sdpa``, whose fused GPU kernels take the prior as a mask.
    """
    return "explicit" if device_type == "cpu" else "sdpa"


def set_attention_kernel(module: nn.Module, kernel: str) -> None:
    """Make every PriorAttention inside ``module`` use ``kernel`` (``auto``, ``sdpa`` or ``explicit``)."""
    for layer in attention_layers(module):
        layer.kernel = kernel


# ----------------------------------------------------------------------------- parameterisations of M
def check_parameterisation(parameterisation: str, rank: int | None = None, grid: tuple[int, int] | None = None,
                           prefix: int = 0) -> None:
    """A ValueError naming the value when ``parameterisation`` and its options are not ones a layer can hold."""
    if parameterisation not in PARAMETERISATIONS:
        raise ValueError(f"parameterisation must be one of {', '.join(PARAMETERISATIONS)}; got {parameterisation!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"the rank of a low_rank prior must be a whole number >= 1, got {rank!r}")
    if grid is not None and (len(grid) != 2 or any(int(g) < 1 for g in grid)):
        raise ValueError(f"a relative prior's grid must be (rows, columns), each >= 1, got {grid!r}")
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"a relative prior's prefix must be a whole number of tokens >= 0, got {prefix!r}")


def offset_index(rows: int, cols: int, device: torch.device | str | None = None) -> Tensor:
    """(rows * cols, rows * cols): for each pair of row-major grid tokens (i, j), the flat index of their offset
    ``(r_i - r_j, c_i - c_j)`` in a (2 rows - 1, 2 cols - 1) table. For one row: ``i - j + cols - 1``."""
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    return (r[:, None] - r[None, :] + rows - 1) * (2 * cols - 1) + (c[:, None] - c[None, :] + cols - 1)


# offset_index by (rows, columns, device), built once and shared by every layer with that layout
_OFFSET_INDEX: dict[tuple, Tensor] = {}


def project_prior(logits: Tensor, parameterisation: str, rank: int = DEFAULT_RANK,
                  grid: tuple[int, int] | None = None, prefix: int = 0) -> tuple[dict[str, Tensor], float]:
    """The parameters that hold ``logits`` (heads, N, N) as ``parameterisation``, and the relative error of that
    projection, ``|M - projected M|_F / |M|_F`` (0 where it is exact). Computed in float64.

    - ``relative``: each offset's value is the mean of M over the pairs at that offset (exact where M depends on
      the offset alone, a shift-invariant structure); the ``prefix`` tokens' rows and columns are kept as they are.
    - ``low_rank``: ``U V^T + diag(d)`` fitted to M by alternating a rank-r SVD of ``M - diag(d)`` with the diagonal
      of ``M - U V^T`` (at most :data:`LOW_RANK_FIT_STEPS` rounds), U V^T split ``U sqrt(S)``, ``V sqrt(S)``; the
      diagonal then exact. Where a singular value is 0 (M = 0, the zero init), U's column is 0 and V's a unit
      vector: M is unchanged and U still gets a gradient (both 0 would stay 0).
    """
    check_parameterisation(parameterisation, rank, grid, prefix)
    m = logits.double()
    heads, n = m.shape[0], m.shape[-1]
    if parameterisation == "full":
        return {"prior_logits": logits.clone()}, 0.0
    if parameterisation == "relative":
        rows, cols = grid if grid is not None else (1, n - prefix)
        if prefix + rows * cols != n or cols < 1:
            layout = f"a {rows}x{cols} grid after " if grid is not None else ""
            raise ValueError(f"a relative prior over {layout}{prefix} prefix tokens does not fit a {n}x{n} prior")
        index = offset_index(rows, cols, m.device).flatten()
        size = (2 * rows - 1) * (2 * cols - 1)
        sums = m.new_zeros(heads, size).index_add_(1, index, m[:, prefix:, prefix:].flatten(1))
        held = {"prior_offsets": (sums / torch.bincount(index, minlength=size)).view(heads, 2 * rows - 1, 2 * cols - 1)}
        if prefix:
            held["prior_prefix_rows"] = m[:, :prefix].clone()
            held["prior_prefix_columns"] = m[:, prefix:, :prefix].clone()
    else:
        # Alternate the two exact steps: U V^T the rank-r SVD of M - diag(d), d the diagonal of M - U V^T. Each step
        # lowers |M - U V^T - diag(d)|_F, so it settles (near, not always at, a rank-r M plus a diagonal).
        r = min(int(rank), n)
        diagonal, before = m.diagonal(dim1=-2, dim2=-1), math.inf
        for _ in range(LOW_RANK_FIT_STEPS):
            u, s, vh = torch.linalg.svd(m - torch.diag_embed(diagonal))
            fit = (u[:, :, :r] * s[:, None, :r]) @ vh[:, :r, :]
            diagonal = (m - fit).diagonal(dim1=-2, dim2=-1)
            residual = float((m - fit - torch.diag_embed(diagonal)).norm())
            if residual >= before * (1 - 1e-9) or residual <= 1e-12 * float(m.norm()):
                break
            before = residual
        root = s[:, :r].sqrt()
        alive = s[:, :r] > s[:, :1] * 1e-12
        left = u[:, :, :r] * root[:, None, :]
        right = vh[:, :r, :].transpose(-2, -1) * torch.where(alive, root, torch.ones_like(root))[:, None, :]
        held = {"prior_left": left, "prior_right": right,
                "prior_diagonal": m.diagonal(dim1=-2, dim2=-1) - (left * right).sum(-1)}
    carrier = PriorCarrier(heads)
    for name, value in held.items():
        setattr(carrier, name, nn.Parameter(value, requires_grad=False))
    error = (carrier.prior_matrix() - m).norm() / m.norm().clamp_min(1e-300)
    return {name: value.to(logits.dtype) for name, value in held.items()}, float(error) if m.norm() > 0 else 0.0


class PriorCarrier(nn.Module):
    """What carries a prior ``M``: the part of an attention layer the init methods and the callbacks use.

    :class:`PriorAttention` is one; a layer of a model that computes its attention itself (a Hugging Face model
    with an injected prior, ``inject.py``) holds one beside its own weights. ``attention_layers`` lists them.

    ``M`` is held as the layer's ``parameterisation`` says (the module doc, :meth:`set_parameterisation`); whatever
    holds it, :meth:`prior_matrix` gives it as an (heads or 1, N, N) tensor, and that is what everything outside
    the layer reads.
    """

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        # The prior: None (plain attention) or, for the ``full`` parameterisation, a (heads or 1, N, N) tensor of
        # logits M. The other parameterisations' parameters (PRIOR_PARAMETERS) are None until a prior is set.
        self.prior_logits: nn.Parameter | None = None
        for name in PRIOR_PARAMETER_NAMES[1:]:
            setattr(self, name, None)
        # log sigmoid(prior_scale * M); the language prior uses a scale of 10.
        self.prior_scale = 1.0
        # How set_prior holds M: the parameterisation, the rank of ``low_rank``, and the token layout of
        # ``relative`` (prefix tokens, then a grid of rows x columns; no grid: one row of the remaining tokens).
        self.parameterisation: str = "full"
        self.prior_rank = DEFAULT_RANK
        self.prior_grid: tuple[int, int] | None = None
        self.prior_prefix = 0
        # |M - projected M|_F / |M|_F of the last set_prior: 0 where the parameterisation holds M exactly.
        self.projection_error = 0.0
        # When True, forward() also stores the attention probabilities in `last_attention`.
        self.record_attention = False
        self.last_attention: Tensor | None = None

    def _reference(self) -> Tensor:
        """A weight of the layer: the prior goes to its device and dtype."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- the prior
    def set_parameterisation(self, parameterisation: str, rank: int | None = None,
                             grid: tuple[int, int] | None = None, prefix: int = 0) -> None:
        """Hold ``M`` as ``parameterisation`` from now on (``full``, ``relative`` or ``low_rank``).

        Args:
            parameterisation: One of :data:`PARAMETERISATIONS`.
            rank: The rank r of ``low_rank`` (default :data:`DEFAULT_RANK`).
            grid: For ``relative``: (rows, columns) of the tokens after the prefix, row-major (a ViT's patch grid),
                so that offsets are 2-D; None: the tokens after the prefix are one sequence (offsets i - j).
            prefix: For ``relative``: the tokens before the grid (CLS, registers), whose rows and columns of M are
                held as they are.

        A prior already installed is carried over: its ``M`` is projected onto the new parameterisation.
        """
        check_parameterisation(parameterisation, rank, grid, prefix)
        matrix = self.prior_matrix()
        trainable = any(p.requires_grad for p in self.prior_parameters().values())
        self.parameterisation = parameterisation
        self.prior_rank = DEFAULT_RANK if rank is None else int(rank)
        self.prior_grid = None if grid is None else (int(grid[0]), int(grid[1]))
        self.prior_prefix = int(prefix)
        if matrix is not None:
            self.set_prior(matrix.detach(), trainable, self.prior_scale)

    def adopt_held_parameterisation(self) -> None:
        """Set ``parameterisation`` (and its rank, grid and prefix) to what the parameters holding M are: after a
        state dict created them in a fresh layer (a saved injected model), the layer then holds M as it was saved."""
        held = self.prior_parameters()
        kind = next((k for k, names in PRIOR_PARAMETERS.items() if set(held) & set(names)), None)
        if kind is None:
            return
        self.parameterisation = kind
        if kind == "low_rank":
            self.prior_rank = int(held["prior_left"].shape[-1])
        if kind == "relative":
            rows, cols = ((size + 1) // 2 for size in held["prior_offsets"].shape[1:])
            self.prior_grid = None if rows == 1 else (rows, cols)
            self.prior_prefix = int(held["prior_prefix_rows"].shape[1]) if "prior_prefix_rows" in held else 0

    def set_prior(self, logits: Tensor, trainable: bool = True, scale: float = 1.0) -> None:
        """Install ``M`` (shape (N, N), (1, N, N) or (heads, N, N)) as this layer's prior, held as the layer's
        ``parameterisation`` says; ``projection_error`` says how far that is from ``logits``."""
        if logits.dim() == 2:
            logits = logits.unsqueeze(0)
        if logits.dim() != 3 or logits.shape[-1] != logits.shape[-2]:
            raise ValueError(f"prior logits must have shape (heads, N, N), got {tuple(logits.shape)}")
        if logits.shape[0] not in (1, self.num_heads):
            raise ValueError(
                f"prior has {logits.shape[0]} heads but the layer has {self.num_heads} "
                "(use 1 to share one N x N prior across heads)"
            )
        param = self._reference()
        data = logits.detach().to(device=param.device, dtype=param.dtype).clone()
        self.clear_prior()
        if self.parameterisation == "full":
            held, error = {"prior_logits": data}, 0.0
        else:
            held, error = project_prior(data, self.parameterisation, self.prior_rank, self.prior_grid,
                                        self.prior_prefix)
        for name, value in held.items():
            setattr(self, name, nn.Parameter(value.to(param.dtype), requires_grad=trainable))
        self.prior_scale = float(scale)
        self.projection_error = error

    def clear_prior(self) -> None:
        """Remove the prior: the layer becomes plain attention."""
        for name in PRIOR_PARAMETER_NAMES:
            setattr(self, name, None)
        self.prior_scale = 1.0
        self.projection_error = 0.0

    def prior_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters that hold ``M`` now, by name (empty without a prior)."""
        return {name: p for name in PRIOR_PARAMETER_NAMES if (p := getattr(self, name)) is not None}

    @property
    def has_prior(self) -> bool:
        """Whether the layer carries a prior (in any parameterisation)."""
        return bool(self.prior_parameters())

    def prior_matrix(self) -> Tensor | None:
        """``M`` as an (heads or 1, N, N) tensor, whatever holds it (differentiable; for ``full`` the parameter
        ``prior_logits`` itself), or None without a prior. The one reading of the prior outside the layer."""
        return self._assemble(lambda values: values)

    def prior_bias(self) -> Tensor | None:
        """The additive term ``log sigmoid(scale * M)`` (heads or 1, N, N), or None."""
        # Elementwise, so a relative prior takes it of its O(N) values before they are spread over N x N.
        return self._assemble(lambda values: F.logsigmoid(self.prior_scale * values))

    def attention_bias(self) -> Tensor | None:
        """The prior as the attention adds it to its logits: :meth:`prior_bias` floored at :data:`PRIOR_FLOOR`."""
        bias = self.prior_bias()
        return None if bias is None else bias.clamp(min=PRIOR_FLOOR)

    def prior_gradient_norms(self) -> Tensor | None:
        """Per head (heads or 1,): the Frobenius norm of the training gradient of the prior's parameters (for
        ``full``, of M itself), or None where there is no prior or no gradient yet."""
        grads = [p.grad for p in self.prior_parameters().values() if p.grad is not None]
        if not grads:
            return None
        return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads]).sum(0).sqrt()

    def _assemble(self, elementwise: Callable[[Tensor], Tensor]) -> Tensor | None:
        """``elementwise(M)`` as (heads or 1, N, N), ``elementwise`` applied where it costs least."""
        if self.prior_logits is not None:
            return elementwise(self.prior_logits)
        if self.prior_offsets is not None:
            offsets = self.prior_offsets
            rows, cols = (offsets.shape[1] + 1) // 2, (offsets.shape[2] + 1) // 2
            key = (rows, cols, offsets.device)
            if key not in _OFFSET_INDEX:  # int32: half the memory of int64 (16 MiB at N = 2048), indexes the same
                _OFFSET_INDEX[key] = offset_index(rows, cols, offsets.device).to(torch.int32)
            grid = elementwise(offsets).flatten(1)[:, _OFFSET_INDEX[key]]
            if self.prior_prefix_rows is None:
                return grid
            columns = torch.cat([elementwise(self.prior_prefix_columns), grid], dim=-1)
            return torch.cat([elementwise(self.prior_prefix_rows), columns], dim=-2)
        if self.prior_left is not None:
            low_rank = self.prior_left @ self.prior_right.transpose(-2, -1)
            return elementwise(low_rank + torch.diag_embed(self.prior_diagonal))
        return None

    # The weights the structure-free and query/key inits write and the callbacks measure, as views into the
    # layer's own parameters (writing into a view writes the layer). ``dim``, ``head_dim`` and ``inner_dim``
    # (``num_heads * head_dim``) size them.
    def attention_module(self) -> nn.Module:
        """The module whose forward receives the attention's input (first argument or ``hidden_states``)."""
        return self

    @property
    def has_query_key_weights(self) -> bool:
        """Whether :meth:`query_key_weights` can give a Wq and a Wk per head (the callbacks measure them if so)."""
        return False

    def query_key_weights(self, grad: bool = False) -> tuple[Tensor, Tensor]:
        """Wq and Wk as (heads, head_dim, dim) views, in (out, in) layout; with ``grad`` their gradients' views
        (None where no gradient has been computed)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose separate query/key weights")

    def value_output_weights(self) -> tuple[Tensor, Tensor]:
        """Wv (inner_dim, dim) and Wproj (dim, inner_dim) as views, in (out, in) layout."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its value/output weights")

    def query_key_biases(self) -> tuple[Tensor, ...]:
        """Views of the query and key biases (none where the projections have no bias)."""
        return ()


class PriorAttention(PriorCarrier):
    """Self-attention ``softmax(q k^T / sqrt(d) + log sigmoid(scale * M)) v``.

    The parameter names (``qkv``, ``proj``) follow timm's ``Attention`` so its weights load as is.

    Args:
        dim: Model width (input and output of the layer).
        num_heads: Number of attention heads.
        head_dim: Width of each head; default ``dim // num_heads``. GOTU's token transformer uses
            64 whatever the model width, so queries/keys/values have ``num_heads * head_dim`` features.
        qkv_bias: Whether the fused query/key/value projection has a bias.
        attn_drop: Dropout on the attention probabilities (training only).
        proj_drop: Dropout after the output projection.
        causal: Add a causal mask (token i sees tokens j <= i), combined with any prior.
        kernel: ``auto`` (per device and dtype, :func:`kernel_for`), ``sdpa``, ``explicit`` or ``flex``
            (:func:`flex_prior_attention`: FlexAttention, for a relative prior on CUDA; chosen only when asked for).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        head_dim: int | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        kernel: str = "auto",
    ) -> None:
        super().__init__(num_heads)
        if head_dim is None and dim % num_heads != 0:
            raise ValueError(
                f"dim={dim} is not divisible by num_heads={num_heads}; give head_dim explicitly"
            )
        self.dim = dim
        self.head_dim = head_dim or dim // num_heads
        self.inner_dim = self.num_heads * self.head_dim
        self.causal = causal
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * self.inner_dim, bias=qkv_bias)
        self.proj = nn.Linear(self.inner_dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.kernel = kernel

    @property
    def kernel(self) -> str:
        """Which kernel computes the attention: ``auto``, ``sdpa``, ``explicit`` or ``flex``."""
        return self._kernel

    @kernel.setter
    def kernel(self, value: str) -> None:
        if value not in KERNELS:
            raise ValueError(f"attention kernel must be one of {', '.join(KERNELS)}; got {value!r}")
        self._kernel = value

    def _reference(self) -> Tensor:
        return self.qkv.weight

    # ----------------------------------------------------------------------------- weights
    has_query_key_weights = True

    def query_key_weights(self, grad: bool = False) -> tuple[Tensor, Tensor]:
        """Wq and Wk as (heads, head_dim, dim) views of the fused projection (or of its gradient)."""
        w, inner = (self.qkv.weight.grad if grad else self.qkv.weight), self.inner_dim
        if w is None:
            return None, None
        wq = w[:inner].view(self.num_heads, self.head_dim, self.dim)
        wk = w[inner : 2 * inner].view(self.num_heads, self.head_dim, self.dim)
        return wq, wk

    def value_output_weights(self) -> tuple[Tensor, Tensor]:
        """Wv: the value rows of the fused projection; Wproj: the output projection."""
        return self.qkv.weight[2 * self.inner_dim :], self.proj.weight

    def query_key_biases(self) -> tuple[Tensor, ...]:
        return () if self.qkv.bias is None else (self.qkv.bias[: 2 * self.inner_dim],)

    # ----------------------------------------------------------------------------- forward
    def _attn_bias(self, seq_len: int, dtype: torch.dtype) -> Tensor | None:
        bias = self.attention_bias()
        if bias is not None and bias.shape[-1] != seq_len:
            n = bias.shape[-1]
            raise ValueError(f"prior is {n}x{n} but the sequence has {seq_len} tokens")
        if bias is not None:
            bias = bias.to(dtype)
        if self.causal and bias is not None:
            future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=bias.device).triu(1)
            bias = bias.masked_fill(future, float("-inf"))
        return bias

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, _ = x.shape
        kernel, device = self.kernel, x.device.type
        autocast_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        if kernel == "auto":
            kernel = kernel_for(device)
        dropout_p = self.attn_drop if self.training else 0.0
        if autocast_dtype is not None and x.is_floating_point():
            x = x.to(autocast_dtype)  # what autocast would do inside the projection; done once, in the open
        # One fused projection; q, k and v are strided (B, H, N, D) views of it, with no permute copy (the matmuls
        # copy what they need). For the explicit kernel, one large matmul instead of three (and three in the
        # backward) saved 6% of a training step at 2 threads, and was within the noise at 1 (benchmarks/step_speed.py).
        qkv = self.qkv(x).view(batch, seq_len, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        # SDPA takes its mask in the query's dtype; the explicit kernel adds the prior to float32 logits, so
        # that under bf16 autocast neither the sum nor the gradient of M is rounded to 8 bits of mantissa.
        bias = None if kernel == "flex" and not self.record_attention else self._attn_bias(
            seq_len, q.dtype if kernel == "sdpa" else torch.promote_types(q.dtype, torch.float32))
        is_causal = self.causal and bias is None
        if kernel == "flex":
            if dropout_p:
                raise ValueError(f"the flex attention kernel has no attention dropout; got attn_drop={dropout_p}: "
                                 "use kernel sdpa or explicit, or no attention dropout")
            if self.record_attention:
                self.last_attention = self.reference_probs(q, k, bias, is_causal).detach()
            out = flex_prior_attention(self, q, k, v)
        elif kernel == "explicit":
            probs = self.reference_probs(q, k, bias, is_causal)
            if self.record_attention:
                self.last_attention = probs.detach()
            out = F.dropout(probs, dropout_p) @ v
        else:
            if self.record_attention:
                self.last_attention = self.reference_probs(q, k, bias, is_causal).detach()
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal
            )
        out = out.transpose(1, 2).reshape(batch, seq_len, self.inner_dim)
        return self.proj_drop(self.proj(out))

    @staticmethod
    def reference_probs(q: Tensor, k: Tensor, bias: Tensor | None, is_causal: bool,
                        scale: float | None = None) -> Tensor:
        """Attention probabilities computed explicitly (the reference path the tests compare with), with the logits
        scaled by ``scale`` (default ``1 / sqrt(head width)``).

        The result has the dtype of ``q`` (bfloat16 under autocast). A ``bias`` in a wider dtype than ``q``
        (the float32 prior under autocast) is added to the logits in its own dtype, and the softmax then runs
        in it; on a CPU the softmax of short rows runs in float32 anyway (:func:`softmax_rows`).
        """
        logits = q @ k.transpose(-2, -1)
        logits = logits / q.shape[-1] ** 0.5 if scale is None else logits * scale
        if bias is not None:
            logits = logits.to(torch.promote_types(logits.dtype, bias.dtype)) + bias
        if is_causal:
            n = logits.shape[-1]
            future = torch.ones(n, n, dtype=torch.bool, device=logits.device).triu(1)
            logits = logits.masked_fill(future, float("-inf"))
        return softmax_rows(logits).to(q.dtype)


# ----------------------------------------------------------------------------- FlexAttention
_FLEX: dict[str, Callable] = {}  # the compiled flex_attention, and causal block masks by (N, device)


def flex_prior_attention(layer: PriorCarrier, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention with ``layer``'s prior through FlexAttention's ``score_mod``: (B, H, N, D) in, (B, H, N, D) out.

    A ``relative`` prior over one sequence (no grid, no prefix) is never spread over N x N: ``score_mod`` reads its
    table of ``log sigmoid(s M)`` per offset (heads, 2N - 1) at ``q_idx - kv_idx``, and the gradient flows into the
    table through the captured tensor. Any other prior is read from its (heads, N, N) :meth:`attention_bias`. A
    causal layer passes its mask as a block mask, so fully masked blocks are skipped.

    On CUDA this runs ``torch.compile(flex_attention)``. Elsewhere FlexAttention runs unfused and has no backward (a
    CPU raises when a gradient is needed); the explicit kernel is the CPU's. ``benchmarks/gpu_check.py`` checks
    this kernel against the explicit one, in value and in the gradient of the prior.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, heads, n, _ = q.shape
    score_mod = None
    if layer.has_prior:
        offsets = layer.prior_offsets
        if offsets is not None and layer.prior_prefix_rows is None and offsets.shape[1] == 1:
            # (heads or 1, 2N - 1): log sigmoid(s M) at each offset i - j + N - 1, floored as the other kernels do
            table = F.logsigmoid(layer.prior_scale * offsets[:, 0].float()).clamp(min=PRIOR_FLOOR)
            if table.shape[-1] != 2 * n - 1:
                raise ValueError(f"prior is {(table.shape[-1] + 1) // 2} tokens long but the sequence has {n} tokens")
            table = table.expand(heads, -1).contiguous()  # one row per head, as score_mod indexes it

            def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return score + table[h, q_idx - kv_idx + n - 1]
        else:
            bias = layer.attention_bias().float()
            if bias.shape[-1] != n:
                raise ValueError(f"prior is {bias.shape[-1]}x{bias.shape[-1]} but the sequence has {n} tokens")
            bias = bias.expand(heads, -1, -1)

            def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return score + bias[h, q_idx, kv_idx]
    block_mask = None
    if getattr(layer, "causal", False):
        key = f"causal {n} {q.device}"
        if key not in _FLEX:
            _FLEX[key] = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n,
                                           device=q.device)
        block_mask = _FLEX[key]
    run = flex_attention
    if q.device.type == "cuda":
        if "compiled" not in _FLEX:
            _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
        run = _FLEX["compiled"]
    return run(q, k, v, score_mod=score_mod, block_mask=block_mask)


# One 512-bit vector of float32 (16) and of bfloat16 (32) elements.
_F32_LANES, _BF16_LANES = 16, 32
_SHORT_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 keeps torch's softmax


def softmax_rows(logits: Tensor) -> Tensor:
    """``logits.softmax(-1)``, fast for the short rows of small token counts on a CPU.

    torch's CPU softmax is fast when a row fills at least one SIMD vector and several times slower when it
    does not: for the 2parity model's (256, 3, 15, 15) logits, forward and backward take 2.3 ms in float32
    and 1.5 ms in bfloat16, against 0.2 ms for rows of 16 floats (measured, 2 threads). So on a CPU, rows
    shorter than 32 run in float32 (as CUDA autocast does for softmax anyway), and rows shorter than 16 are
    padded to 16 with ``-inf``, which adds zero probability: 0.33 ms and 0.44 ms for the same logits. The
    result is float32 for those rows; longer rows, float64 and other devices use torch's softmax as is.
    """
    n, dtype = logits.shape[-1], logits.dtype
    short = n < _F32_LANES or (n < _BF16_LANES and dtype != torch.float32)
    if logits.device.type != "cpu" or dtype not in _SHORT_ROW_DTYPES or not short:
        return logits.softmax(dim=-1)
    logits = logits.float()
    if n >= _F32_LANES:
        return logits.softmax(dim=-1)
    padded = F.pad(logits, (0, _F32_LANES - n), value=float("-inf"))
    return padded.softmax(dim=-1)[..., :n]


def active_copy(module: nn.Module) -> nn.Module | None:
    """The copy a wrapper that keeps several copies of a module runs (PEFT's ``modules_to_save`` wrapper: the
    active adapter's copy, or the original where adapters are disabled); None for any other module."""
    copies, original = getattr(module, "modules_to_save", None), getattr(module, "original_module", None)
    if not isinstance(copies, nn.ModuleDict) or not isinstance(original, nn.Module):
        return None
    active = [] if getattr(module, "disable_adapters", False) else [
        name for name in getattr(module, "active_adapters", []) if name in copies]
    return copies[active[0]] if active else original


def attention_layers(module: nn.Module) -> list[PriorCarrier]:
    """Every layer that can carry a prior inside ``module`` (PriorAttention, and the priors injected into other
    models' attention), in forward order (module registration order); of a wrapper's copies (PEFT's
    ``modules_to_save``), the one it runs."""
    if isinstance(module, PriorCarrier):
        return [module]
    active = active_copy(module)
    children = [active] if active is not None else module.children()
    return [layer for child in children for layer in attention_layers(child)]


@contextmanager
def recording_attention(module: nn.Module) -> Iterator[list[PriorAttention]]:
    """Within the block, each PriorAttention stores its probabilities in ``last_attention``."""
    layers = attention_layers(module)
    for layer in layers:
        layer.record_attention = True
        layer.last_attention = None
    try:
        yield layers
    finally:
        for layer in layers:
            layer.record_attention = False


@torch.no_grad()
def attention_probabilities(module: nn.Module, *args, **kwargs) -> list[Tensor]:
    """Run ``module(*args)`` once and return each layer's attention probabilities (B, H, N, N)."""
    was_training = module.training
    module.eval()
    try:
        with recording_attention(module) as layers:
            module(*args, **kwargs)
            probs = [layer.last_attention for layer in layers]
            for layer in layers:
                layer.last_attention = None
    finally:
        module.train(was_training)
    return probs

"""PriorPersistence: how much of the injected structure is still in the attention, every N training steps.

The paper's thesis in one number per layer and head, measured the same way for every init method:
the attention mass a fixed probe batch puts on the structure's open entries, relative to step 0.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_maskprior.attention import PriorCarrier, attention_layers, attention_probabilities
from lightning_maskprior.callbacks.probe import (
    batch_inputs,
    log_scalars,
    precision_context,
    probe_batch,
    reference_structure,
    to_device,
)
from lightning_maskprior.metrics import HALF_LIFE, OPEN_MASS, PERSISTENCE, PERSISTENCE_HEADS, SCORE

# Per-head metrics whose value at the first measurement (step 0) is the reference for `<name>_rel`.
RELATIVE = ("open_mass", "attn_corr", "prior_corr")
# The persistence score falls below this fraction of its initial value at the half-life.
HALF = 0.5


def pearson(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise Pearson correlation of (H, K) tensors; 0 where either row is constant."""
    a = a.double() - a.double().mean(-1, keepdim=True)
    b = b.double() - b.double().mean(-1, keepdim=True)
    denom = (a.pow(2).sum(-1) * b.pow(2).sum(-1)).sqrt()
    return torch.where(denom > 0, (a * b).sum(-1) / denom.clamp_min(1e-300), torch.zeros_like(denom))


def bilinear_drift(wq: Tensor, wk: Tensor, wq0: Tensor, wk0: Tensor) -> Tensor:
    """``||Wq^T Wk - Wq0^T Wk0||_F / ||Wq0^T Wk0||_F`` per head, without forming the dim x dim products.

    Inputs are (H, head_dim, dim). With U = [Wq; -Wq0] and V = [Wk; Wk0], U^T V is the difference and
    ``||U^T V||_F^2 = sum((U U^T) * (V V^T))`` (float64: the cancellation is exact enough at step 0).
    """
    u = torch.cat([wq, -wq0], dim=1).double()
    v = torch.cat([wk, wk0], dim=1).double()
    diff = ((u @ u.mT) * (v @ v.mT)).sum((-2, -1)).clamp_min(0).sqrt()
    q0, k0 = wq0.double(), wk0.double()
    base = ((q0 @ q0.mT) * (k0 @ k0.mT)).sum((-2, -1)).clamp_min(0).sqrt()
    return diff / base.clamp_min(1e-12)


class PriorPersistence(Callback):
    """Measure every ``every_n_steps`` optimizer steps (and at step 0) whether the structure survives.

    On a fixed probe batch (the same examples on every rank and after a resume) and for every
    PriorAttention layer ``l`` and head ``h``, it logs under ``persistence_heads/<metric>/layer<l>/head<h>``
    (a TensorBoard group of its own, apart from the summaries below):

    - ``open_mass``: attention probability on the structure's open entries, averaged over queries
      and probe examples (1 = all attention where the structure allows it).
    - ``attn_corr``: Pearson correlation of the probe-averaged attention map with the structure.
    - ``prior_corr``: correlation of ``log sigmoid(M)`` with the structure (layers with a prior M).
    - ``open_mass_rel``, ``attn_corr_rel``, ``prior_corr_rel``: each divided by its value at step 0
      (NaN where that value is 0).
    - ``prior_drift``: RMS of ``M - M0`` over the N x N entries, in logit units.
    - ``qk_drift``: ``||Wq^T Wk - Wq0^T Wk0||_F / ||Wq0^T Wk0||_F`` (the bilinear form of the logits).
    - ``grad_prior``, ``grad_q``, ``grad_k``: Frobenius norms of the training gradients of M and of
      the head's Wq and Wk (arXiv 2608.00418, Corollary 1, measured), taken just before the optimizer step
      that produced the logged step; not at step 0. For a ``relative`` or ``low_rank`` prior, ``grad_prior`` is
      the norm of the gradient of the parameters that hold M.

    M is read as each layer's :meth:`~lightning_maskprior.attention.PriorCarrier.prior_matrix`, whatever its
    parameterisation.

    A prior shared by all heads (shape (1, N, N)) is logged as head 0. The summaries go to ``persistence/``:
    the means over layers and heads as ``persistence/<metric>``, and:

    - ``persistence/score``: mean open mass now / mean open mass at step 0: the persistence score.
    - ``persistence/half_life``: logged once, at the first step where the score is below 0.5; its
      value is that step.

    The structure is the module's ``structure`` (for MaskPriorModule: the task's structure, also
    for inits that do not use it), so ``default``, ``mask`` and the query/key inits are comparable.
    Under DDP every rank measures (the values agree; they are averaged once to be sure) and rank
    zero logs. The state (step-0 references, initial M/Wq/Wk, history, half-life) is saved in
    checkpoints, so a resumed run continues the same curves.

    Args:
        every_n_steps: Measure when the global step is a multiple of this.
        probe_size: Number of probe examples.
        probe_split: Dataset the probe comes from: ``train`` or ``val``.
        probe_seed: Seed that picks the probe examples.
        per_head: Log the per layer/head series under ``persistence_heads/`` (else only the summaries).
    """

    def __init__(self, every_n_steps: int = 25, probe_size: int = 256, probe_split: str = "train",
                 probe_seed: int = 0, per_head: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if probe_split not in ("train", "val"):
            raise ValueError(f"probe_split must be 'train' or 'val', got {probe_split!r}")
        self.every_n_steps, self.probe_size = every_n_steps, probe_size
        self.probe_split, self.probe_seed, self.per_head = probe_split, probe_seed, per_head
        # State kept in checkpoints.
        self.reference: dict[str, float] | None = None
        self.initial_prior: list[Tensor | None] | None = None
        self.initial_qk: list[tuple[Tensor, Tensor] | None] | None = None
        self.history: list[tuple[int, float]] = []
        self.half_life: int | None = None
        self.last_step = -1
        # Per run.
        self._probe: Any = None
        self._grads: dict[str, Tensor] | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, probe_size=self.probe_size,
                                        probe_split=self.probe_split, probe_seed=self.probe_seed)

    # ---------------------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = attention_layers(pl_module)
        if not layers:
            raise ValueError(f"{type(pl_module).__name__} has no attention layer that carries a prior to measure")
        self._probe = to_device(probe_batch(trainer, self.probe_size, self.probe_split, self.probe_seed),
                                pl_module.device)
        if self.initial_qk is None:
            self.initial_prior = [None if (m := a.prior_matrix()) is None else m.detach().clone() for a in layers]
            self.initial_qk = [tuple(w.detach().clone() for w in a.query_key_weights())
                               if a.has_query_key_weights else None for a in layers]
        device = pl_module.device
        self.initial_prior = [None if m is None else m.to(device) for m in self.initial_prior]
        self.initial_qk = [None if qk is None else (qk[0].to(device), qk[1].to(device)) for qk in self.initial_qk]
        if self.last_step < 0 and trainer.global_step == 0:
            self._measure(trainer, pl_module, 0)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        # This update produces step global_step + 1; keep its gradients if that step is measured.
        if (trainer.global_step + 1) % self.every_n_steps == 0:
            self._grads = self._gradient_norms(attention_layers(pl_module))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        step = trainer.global_step
        # `> last_step`: with gradient accumulation several batches end at the same step.
        if step % self.every_n_steps == 0 and step > self.last_step:
            self._measure(trainer, pl_module, step)

    # ---------------------------------------------------------------------------- measuring
    @torch.no_grad()
    def measure(self, pl_module: L.LightningModule) -> dict[str, Tensor]:
        """Raw per layer/head values on the probe batch (no references, no gradients)."""
        layers = attention_layers(pl_module)
        structure = reference_structure(pl_module)
        with precision_context(pl_module):
            probs = attention_probabilities(pl_module, batch_inputs(self._probe))
        open_all = structure.expanded(len(layers), layers[0].num_heads) if structure is not None else None
        values: dict[str, Tensor] = {}
        for l, (layer, p) in enumerate(zip(layers, probs, strict=True)):
            p = p.float()  # (B, H, N, N)
            n = p.shape[-1]
            if open_all is not None:
                open = open_all[l].to(p.device)
                if open.shape[-1] != n:
                    raise ValueError(f"structure is {open.shape[-1]}x{open.shape[-1]} but layer {l} attends "
                                     f"over {n} tokens")
                _put(values, "open_mass", l, (p * open).sum(-1).mean(dim=(0, 2)))
                _put(values, "attn_corr", l, pearson(p.mean(0).flatten(1), open.flatten(1).float()))
            bias = layer.prior_bias()
            if bias is not None:
                if open_all is not None:
                    target = open if bias.shape[0] == open.shape[0] else open[:1]
                    _put(values, "prior_corr", l, pearson(bias.flatten(1), target.flatten(1).float()))
                initial, matrix = self.initial_prior[l], layer.prior_matrix()
                if initial is not None and initial.shape == matrix.shape:
                    drift = (matrix - initial).double().pow(2).mean(dim=(-2, -1)).sqrt()
                    _put(values, "prior_drift", l, drift)
            if self.initial_qk[l] is not None:  # a layer with grouped-query attention has no Wk per head
                wq, wk = layer.query_key_weights()
                _put(values, "qk_drift", l, bilinear_drift(wq, wk, *self.initial_qk[l]))
        return values

    @staticmethod
    def _gradient_norms(layers: list[PriorCarrier]) -> dict[str, Tensor]:
        values: dict[str, Tensor] = {}
        for l, layer in enumerate(layers):
            grad_q, grad_k = layer.query_key_weights(grad=True) if layer.has_query_key_weights else (None, None)
            if grad_q is not None and grad_k is not None:
                _put(values, "grad_q", l, grad_q.flatten(1).norm(dim=1))
                _put(values, "grad_k", l, grad_k.flatten(1).norm(dim=1))
            grad_prior = layer.prior_gradient_norms()
            if grad_prior is not None:
                _put(values, "grad_prior", l, grad_prior)
        return values

    def _measure(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        raw = self.measure(pl_module)
        raw.update(self._grads or {})
        self._grads = None
        if trainer.world_size > 1:
            # Equal on every rank already (same probe, same weights, all-reduced gradients); the mean
            # makes that exact. Every rank measures at the same steps, so the collective matches.
            packed = torch.stack([v.to(pl_module.device, torch.float64) for v in raw.values()])
            packed = trainer.strategy.reduce(packed, reduce_op="mean")
            raw = dict(zip(raw, packed.unbind(), strict=True))
        values = {k: float(v) for k, v in raw.items()}
        if self.reference is None:
            self.reference = {k: v for k, v in values.items() if k.split("/")[0] in RELATIVE}
        for key, ref in self.reference.items():
            if key in values:
                kind, rest = key.split("/", 1)
                values[f"{kind}_rel/{rest}"] = values[key] / ref if abs(ref) > 1e-12 else math.nan
        logged = {f"{PERSISTENCE}/{k}": v for k, v in _means(values).items()}
        ref_open = [v for k, v in self.reference.items() if k.startswith("open_mass/")]
        if ref_open:
            score = logged[OPEN_MASS] / (sum(ref_open) / len(ref_open))
            logged[SCORE] = score
            self.history.append((step, score))
            if self.half_life is None and score < HALF:
                self.half_life = step
                logged[HALF_LIFE] = float(step)
        if self.per_head:
            logged.update({f"{PERSISTENCE_HEADS}/{k}": v for k, v in values.items()})
        log_scalars(trainer, logged, step)
        self.last_step = step

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        cpu = [None if m is None else m.detach().cpu() for m in (self.initial_prior or [])]
        return {
            "reference": self.reference,
            "initial_prior": cpu if self.initial_prior is not None else None,
            "initial_qk": None if self.initial_qk is None else
            [None if qk is None else (qk[0].detach().cpu(), qk[1].detach().cpu()) for qk in self.initial_qk],
            "history": list(self.history),
            "half_life": self.half_life,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reference = state_dict["reference"]
        self.initial_prior = state_dict["initial_prior"]
        self.initial_qk = state_dict["initial_qk"]
        self.history = [tuple(p) for p in state_dict["history"]]
        self.half_life = state_dict["half_life"]
        self.last_step = state_dict["last_step"]


def _put(values: dict[str, Tensor], name: str, layer: int, per_head: Tensor) -> None:
    for h, v in enumerate(per_head.unbind()):
        values[f"{name}/layer{layer}/head{h}"] = v


def _means(values: dict[str, float]) -> dict[str, float]:
    """Mean of each per layer/head metric over layers and heads, NaNs left out."""
    groups: dict[str, list[float]] = {}
    for key, v in values.items():
        groups.setdefault(key.split("/")[0], []).append(v)
    out = {}
    for name, vs in groups.items():
        finite = [v for v in vs if not math.isnan(v)]
        out[name] = sum(finite) / len(finite) if finite else math.nan
    return out

"""ExtrapolationMonitor: how the model does on the unseen slice, and whether it sits on the MDI there."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_maskprior.callbacks.probe import batch_inputs
from lightning_maskprior.objectives import nearest_label

# Running sums over one validation pass: unseen points, correct, squared error, closer to the MDI.
_FIELDS = ("count", "correct", "squared_error", "closer_to_mdi")


class ExtrapolationMonitor(Callback):
    """After each validation pass, log the model's behaviour on the unseen slice (GOTU batches).

    Reads batches that carry ``target``, ``unseen`` (Boolean) and ``mdi`` (the min-degree
    interpolator's value), as BooleanGOTUDataModule's validation batches do, and logs:

    - ``extrapolation/closer_to_mdi``: fraction of unseen points where the prediction is strictly
      closer to the MDI than to the truth (1 = the model learned the MDI, 0 = it extrapolates).
    - ``extrapolation/unseen_acc``: accuracy of the nearest admissible label on unseen points
      (the module objective's ``label_values``; nearest integer if it has none).
    - ``extrapolation/unseen_mse``: mean squared error on unseen points.

    The last two only for a module that does not log them itself: MaskPriorModule on a Boolean task logs the
    same numbers as ``val/unseen_acc`` and ``val/unseen_mse`` (its ``metric_tags()`` lists them), and a
    second copy of each curve would only clutter TensorBoard. ``history`` keeps all three.

    The sums are added over ranks (every point of the cube is evaluated exactly once under DDP),
    then logged at the current step. Batches without those keys are ignored. It uses the
    predictions ``validation_step`` returns, or runs the model on the batch if it returns none.

    Args:
        prefix: Namespace of the logged metrics.
    """

    def __init__(self, prefix: str = "extrapolation") -> None:
        self.prefix = prefix
        self.history: list[tuple[int, dict[str, float]]] = []
        self._sums: Tensor | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sums = torch.zeros(len(_FIELDS), dtype=torch.float64, device=pl_module.device)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not (isinstance(batch, dict) and {"target", "unseen", "mdi"} <= batch.keys()):
            return
        if not isinstance(outputs, Tensor):
            with torch.no_grad():
                outputs = pl_module(batch_inputs(batch))
        unseen = batch["unseen"].bool()
        pred = outputs.detach().reshape(len(unseen), -1)[:, 0].float()[unseen]
        target, mdi = batch["target"].float()[unseen], batch["mdi"].float()[unseen]
        labels = getattr(getattr(pl_module, "objective", None), "label_values", None)
        correct = nearest_label(pred, labels) == nearest_label(target, labels)
        closer = (pred - mdi).abs() < (pred - target).abs()
        self._sums += torch.stack([
            torch.tensor(float(len(pred)), device=self._sums.device),
            correct.sum().double(), (pred - target).double().pow(2).sum(), closer.sum().double(),
        ])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._sums is None:
            return
        # A collective: every rank runs this hook once per validation pass.
        sums = trainer.strategy.reduce(self._sums, reduce_op="sum") if trainer.world_size > 1 else self._sums
        count, correct, squared_error, closer = sums.tolist()
        if count == 0:
            return
        values = {"unseen_acc": correct / count, "unseen_mse": squared_error / count,
                  "closer_to_mdi": closer / count}
        self.history.append((trainer.global_step, values))
        logged_by_module = _metric_tags(pl_module)
        for name, value in values.items():
            if f"val/{name}" in logged_by_module:
                continue
            # Already the same on every rank; sync_dist only averages equal numbers.
            pl_module.log(f"{self.prefix}/{name}", value, sync_dist=True)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(p) for p in state_dict["history"]]


def _metric_tags(pl_module: L.LightningModule) -> set[str]:
    """The evaluation tags the module logs itself (MaskPriorModule.metric_tags), or none."""
    tags = getattr(pl_module, "metric_tags", None)
    return set(tags()) if callable(tags) else set()

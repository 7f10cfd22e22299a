"""What a datamodule tells the model: sequence shape, objective (loss + metrics) and Structure.

A datamodule returns a TaskSpec from ``task_spec()``; the CLI hands it to MaskPriorModule, which
builds its backbone for that task and trains with the task's Objective. The module never needs to
know which benchmark it is running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torchmetrics import MetricCollection

from lightning_maskprior.priors import Structure


class Objective(nn.Module):
    """A task's loss and metrics. Subclasses implement the three methods below.

    Batches are dicts; ``batch["inputs"]`` goes to the backbone, the rest is for the objective.
    """

    def loss(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def make_metrics(self) -> MetricCollection:
        """A fresh collection of evaluation metrics, logged as ``<stage>/<name>``."""
        raise NotImplementedError

    def update_metrics(self, metrics: MetricCollection, output: Tensor, batch: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def predict(self, output: Tensor, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-example predictions (``maskprior predict``): the output itself for one value, else its argmax."""
        if output.dim() >= 2 and output.shape[-1] == 1:
            return {"prediction": output.squeeze(-1)}
        return {"prediction": output.argmax(dim=-1)}

    # The metric that names the best checkpoint and the one printed first after fit.
    monitor: str = "loss"
    monitor_mode: str = "min"
    # The metrics the progress bar shows (None: every one); the others are logged only.
    progress_metrics: tuple[str, ...] | None = None


@dataclass
class TaskSpec:
    """The facts about a task that the backbone and the module need.

    Args:
        name: Task name, for logs.
        seq_len: Number of input tokens the attention sees (before any CLS token).
        vocab_size: Number of distinct input token ids.
        num_outputs: Width of the backbone's output per example (or per read-out token).
        objective: Loss and metrics.
        structure: The task's oracle interaction structure, or None.
        init_defaults: Default options per init method for this task, e.g. the paper's mask values
            ``{"mask": {"open_value": 5.0, "closed_value": -5.0}}``; ``model.init_options`` in YAML
            overrides them key by key.
        extras: Anything else a specific backbone needs (e.g. image size for a ViT).
    """

    name: str
    seq_len: int
    vocab_size: int
    num_outputs: int
    objective: Objective
    structure: Structure | None = None
    init_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

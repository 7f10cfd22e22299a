"""Objectives: a task's loss and its torchmetrics, shared by the datamodules.

A datamodule's ``task_spec()`` gives its task's objective; ``--model.objective NAME`` replaces it with one of the
registry below or one of your own (``my_pkg.objectives:huber``, :class:`ObjectiveFactory`): a function, or an
Objective subclass, called with the task's TaskSpec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, MeanSquaredError, Metric, MetricCollection

from lightning_maskprior.plugins import PluginError, leading, parameters_of, registrar, resolve, shown, without_default
from lightning_maskprior.task import Objective, TaskSpec


class ObjectiveFactory(Protocol):
    """A task's objective replaced: ``fn(task) -> Objective`` (an ``Objective`` subclass whose constructor takes the
    ``TaskSpec``, or a function), named by ``--model.objective`` (a name registered with ``register_objective``, or
    ``my_pkg.objectives:huber``). The :class:`~lightning_maskprior.task.Objective` it returns implements ``loss``,
    ``make_metrics`` and ``update_metrics``."""

    def __call__(self, task: TaskSpec, /) -> Objective: ...


def check_objective_factory(name: str, fn: Any) -> None:
    """A PluginError naming objective ``name`` where ``fn`` cannot be called with the task alone
    (:class:`ObjectiveFactory`)."""
    expected = "fn(task) -> Objective (see lightning_maskprior.objectives.ObjectiveFactory)"
    params = parameters_of("objective", name, fn, expected)
    given, others = leading(params, 1)
    if not given or without_default(others):
        raise PluginError(f"objective {name!r} takes ({shown(params)}); expected {expected}: called with the task's "
                          "TaskSpec alone")


OBJECTIVES: dict[str, ObjectiveFactory] = {}
_register = registrar("objective", OBJECTIVES, "objective", check_objective_factory)


def register_objective(name: str) -> Callable[[ObjectiveFactory], ObjectiveFactory]:
    """Decorator: register ``fn(task) -> Objective`` as objective ``name``, which ``--model.objective NAME`` names
    (the contract: :class:`ObjectiveFactory`, checked now)."""
    return _register(name)


def build_objective(name: str, task: TaskSpec) -> Objective:
    """Objective ``name`` (registered, or ``module.path:attribute``) for ``task``; a PluginError naming it where
    what it gives is not an Objective with its three methods."""
    objective = resolve("objective", name)(task)
    check_objective(name, objective)
    return objective


def nearest_label(pred: Tensor, label_values: Tensor | None) -> Tensor:
    """Round predictions to the nearest admissible label (nearest integer when ``label_values`` is None)."""
    if label_values is None:
        return pred.round()
    labels = label_values.to(pred)
    return labels[(pred.unsqueeze(-1) - labels).abs().argmin(dim=-1)]


class RegressionObjective(Objective):
    """MSE on a scalar target, with accuracy of the nearest admissible label.

    Reported on every evaluated point (``acc``, ``mse``), on the unseen slice alone
    (``unseen_acc``, ``unseen_mse``), and for the min-degree interpolator (``mdi_acc``, ``mdi_mse``)
    when batches carry ``unseen`` and ``mdi`` entries.

    Args:
        label_values: The admissible labels (e.g. [-1, 1]: accuracy of the sign), or None to round
            to the nearest integer.
    """

    monitor = "mse"
    monitor_mode = "min"

    def __init__(self, label_values: list[float] | None = None) -> None:
        super().__init__()
        values = None if label_values is None else torch.tensor(sorted(label_values), dtype=torch.float32)
        self.register_buffer("label_values", values, persistent=False)

    def loss(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        # fp32 whatever the autocast dtype of the output (bf16-mixed): the loss, like the metrics, is fp32.
        return F.mse_loss(output.squeeze(-1).float(), batch["target"].float())

    def make_metrics(self) -> MetricCollection:
        metrics = {}
        for prefix in ("", "unseen_", "mdi_"):
            metrics[f"{prefix}acc"] = MeanMetric()
            metrics[f"{prefix}mse"] = MeanSquaredError()
        return MetricCollection(metrics, compute_groups=False)

    def update_metrics(self, metrics: MetricCollection, output: Tensor, batch: dict[str, Tensor]) -> None:
        target = batch["target"]
        pred = output.squeeze(-1).float()
        self._update(metrics, "", pred, target)
        if "unseen" in batch:
            unseen = batch["unseen"]
            if unseen.any():
                self._update(metrics, "unseen_", pred[unseen], target[unseen])
        if "mdi" in batch:
            self._update(metrics, "mdi_", batch["mdi"].float(), target)

    def predict(self, output: Tensor, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        pred = output.squeeze(-1).float()
        return {"prediction": pred, "label": nearest_label(pred, self.label_values)}

    def _update(self, metrics: MetricCollection, prefix: str, pred: Tensor, target: Tensor) -> None:
        correct = nearest_label(pred, self.label_values) == nearest_label(target, self.label_values)
        correct &= torch.isfinite(pred)  # a NaN prediction is wrong, whatever argmin makes of it
        metrics[f"{prefix}acc"].update(correct.float())
        metrics[f"{prefix}mse"].update(pred, target)


class DigitsObjective(Objective):
    """Cross-entropy per answer digit, with sequence accuracy (every digit right), digit accuracy, and the accuracy
    of each answer digit (``digit_acc_<k>``, k = 0 the first in the labels: the most significant as written, the
    least with ``answer_order: lsd_first``), which says where a model fails.

    The backbone predicts every digit in one pass: output (B, num_digits, base) per read-out token,
    or (B, num_digits * base) from a pooled head (digit-major). ``batch["digits"]`` is (B, num_digits).

    Args:
        num_digits: Answer digits per example.
        base: Classes per digit (10).
    """

    monitor = "seq_acc"
    monitor_mode = "max"
    progress_metrics = ("seq_acc", "digit_acc")

    def __init__(self, num_digits: int, base: int = 10) -> None:
        super().__init__()
        self.num_digits, self.base = num_digits, base

    def digit_logits(self, output: Tensor) -> Tensor:
        """The output as (B, num_digits, base) logits."""
        expected = (self.num_digits, self.base)
        if output.dim() == 2 and output.shape[1] == self.num_digits * self.base:
            return output.view(-1, *expected)
        if output.dim() == 3 and tuple(output.shape[1:]) == expected:
            return output
        raise ValueError(
            f"expected backbone output (B, {self.num_digits}, {self.base}) or (B, {self.num_digits * self.base}), "
            f"got {tuple(output.shape)}"
        )

    def loss(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        logits = self.digit_logits(output)
        return F.cross_entropy(logits.reshape(-1, self.base).float(), batch["digits"].reshape(-1))

    def make_metrics(self) -> MetricCollection:
        per_digit = {f"digit_acc_{k}": MeanMetric() for k in range(self.num_digits)}
        return MetricCollection({"seq_acc": MeanMetric(), "digit_acc": MeanMetric(), **per_digit},
                                compute_groups=False)

    def predict(self, output: Tensor, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"prediction": self.digit_logits(output).argmax(dim=-1)}

    def update_metrics(self, metrics: MetricCollection, output: Tensor, batch: dict[str, Tensor]) -> None:
        logits = self.digit_logits(output)
        correct = (logits.argmax(dim=-1) == batch["digits"]) & torch.isfinite(logits).all(dim=-1)  # NaN: wrong
        metrics["seq_acc"].update(correct.all(dim=1).float())
        metrics["digit_acc"].update(correct.float())
        for k in range(self.num_digits):
            metrics[f"digit_acc_{k}"].update(correct[:, k].float())


class TokenPerplexity(Metric):
    """Corpus perplexity exp(total next-token NLL / number of tokens), from logits (log-softmax, float64 sums).

    torchmetrics' ``Perplexity`` takes log(softmax(...)), which underflows for confident wrong predictions;
    this one sums the cross-entropy of every counted token and synchronises the two sums across DDP ranks.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, ignore_index: int = -100, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("total_nll", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: Tensor, target: Tensor) -> None:
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                              ignore_index=self.ignore_index, reduction="sum")
        self.total_nll += nll.double()
        self.count += (target != self.ignore_index).sum()

    def compute(self) -> Tensor:
        return torch.exp(self.total_nll / self.count).float()


class LanguageModelObjective(Objective):
    """Next-token cross-entropy over every position; perplexity ``ppl`` on validation and test.

    The backbone returns logits (B, N, vocab); ``batch["target"]`` holds the next token of each input
    position, ``ignore_index`` where there is none (the padded tail of the last block).
    """

    monitor = "ppl"
    monitor_mode = "min"

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def loss(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), batch["target"].reshape(-1),
                               ignore_index=self.ignore_index)

    def make_metrics(self) -> MetricCollection:
        return MetricCollection({"ppl": TokenPerplexity(self.ignore_index)}, compute_groups=False)

    def update_metrics(self, metrics: MetricCollection, output: Tensor, batch: dict[str, Tensor]) -> None:
        metrics["ppl"].update(output, batch["target"])


class ClassificationObjective(Objective):
    """Cross-entropy over classes, with top-1 (and top-5) accuracy via torchmetrics.

    ``batch["target"]`` holds class indices (B,), or soft targets (B, classes) when the batch was
    mixed (Mixup/CutMix, smoothing already inside). Hard targets get ``label_smoothing`` in
    training only: validation and test report the plain cross-entropy.

    Args:
        num_classes: Number of classes.
        label_smoothing: Label smoothing of hard targets in training.
    """

    monitor = "top1"
    monitor_mode = "max"

    def __init__(self, num_classes: int, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.num_classes, self.label_smoothing = num_classes, label_smoothing

    def loss(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        target, output = batch["target"], output.float()
        if target.is_floating_point():
            return torch.sum(-target * F.log_softmax(output, dim=-1), dim=-1).mean()
        return F.cross_entropy(output, target, label_smoothing=self.label_smoothing if self.training else 0.0)

    def make_metrics(self) -> MetricCollection:
        from torchmetrics.classification import MulticlassAccuracy

        metrics = {"top1": MulticlassAccuracy(self.num_classes, top_k=1, average="micro")}
        if self.num_classes > 5:
            metrics["top5"] = MulticlassAccuracy(self.num_classes, top_k=5, average="micro")
        return MetricCollection(metrics, compute_groups=False)

    def update_metrics(self, metrics: MetricCollection, output: Tensor, batch: dict[str, Tensor]) -> None:
        output, target = output.float(), batch["target"]
        broken = ~torch.isfinite(output).all(dim=-1)
        if broken.any() and target.dim() == 1:
            # A NaN row must count as wrong, but argmax/topk would pick some class: give it logits that
            # rank the target last.
            output = output.clone()
            output[broken] = 0.0
            output[broken, target[broken]] = -1e9
        metrics.update(output, target)


# ---------------------------------------------------------------------------------- the registered objectives
@register_objective("regression")
def regression(task: TaskSpec) -> Objective:
    """MSE on a scalar target, with the accuracy of the nearest integer (:class:`RegressionObjective`)."""
    return RegressionObjective()


@register_objective("classification")
def classification(task: TaskSpec) -> Objective:
    """Cross-entropy over the task's ``num_outputs`` classes (:class:`ClassificationObjective`)."""
    return ClassificationObjective(task.num_outputs)


@register_objective("language_model")
def language_model(task: TaskSpec) -> Objective:
    """Next-token cross-entropy and perplexity (:class:`LanguageModelObjective`)."""
    return LanguageModelObjective()


def check_objective(name: str, objective: Any) -> None:
    """A PluginError naming objective ``name`` where what it made is not an Objective that implements its three
    methods."""
    if not isinstance(objective, nn.Module):
        raise PluginError(f"objective {name!r} gave a {type(objective).__name__}; expected an Objective (a subclass of "
                          "lightning_maskprior.task.Objective)")
    missing = [m for m in ("loss", "make_metrics", "update_metrics")
               if getattr(type(objective), m, None) in (None, getattr(Objective, m))]
    if missing:
        raise PluginError(f"objective {name!r} ({type(objective).__name__}) does not implement "
                          f"{', '.join(missing)}; expected an Objective with loss, make_metrics and update_metrics")

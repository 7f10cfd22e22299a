"""MaskPriorModule: the one generic LightningModule.

It builds a backbone for the datamodule's task, puts the task's structure where the init method
says (the additive prior, the query/key weights, or nowhere), and trains with the task's objective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable, instantiate_class
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_maskprior.attention import (
    DEFAULT_RANK,
    PRIOR_PARAMETER_NAMES,
    Parameterisation,
    attention_layers,
    check_parameterisation,
)
from lightning_maskprior.checkpoints import (
    STRUCTURE_KEY,
    check_checkpoint_fits,
    same_structure,
    structure_from_state,
    structure_state,
)
from lightning_maskprior.contracts import check_backbone, prefix_tokens
from lightning_maskprior.discover import DiscoverySpec, check_estimator_options
from lightning_maskprior.inits import apply_init, check_init_options, get_init, restoring_weights, uses_structure
from lightning_maskprior.models import Backbone, TokenTransformer
from lightning_maskprior.objectives import build_objective
from lightning_maskprior.plugins import calling, resolve
from lightning_maskprior.priors import Structure, StructureSpec
from lightning_maskprior.task import TaskSpec


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def build_datamodule(spec: dict[str, Any]) -> L.LightningDataModule:
    """The datamodule ``{class_path, init_args}`` describes (as the CLI's config and the checkpoints hold it)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise ValueError(f"datamodule must be a mapping with a class_path and init_args, got {spec!r}")
    return _instantiate_from_spec(spec)


def _instantiate_from_spec(spec: dict[str, Any], *args: Any) -> Any:
    """``class_path(*args, **init_args)`` of a ``{class_path, init_args}`` spec."""
    return instantiate_class(args, {"class_path": spec["class_path"], "init_args": dict(spec.get("init_args") or {})})


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _keep_plain_hparams(hparams: dict[str, Any]) -> None:
    """Replace what is not a plain value (a class, a partial, a function given in Python) by its spec, or drop it.

    Under the CLI the hyperparameters are the config (``{class_path, init_args}``), already plain.
    """
    for key in ("backbone", "optimizer", "structure"):
        value = hparams.get(key)
        if _is_plain(value):
            continue
        target, kwargs = value, {}
        if isinstance(value, functools.partial) and not value.args:
            target, kwargs = value.func, dict(value.keywords)
        spec = None
        if isinstance(target, type) and _is_plain(kwargs):
            spec = {"class_path": f"{target.__module__}.{target.__qualname__}", "init_args": kwargs}
        if spec is None:
            hparams.pop(key)  # load_from_checkpoint then uses the default, or what the caller passes
        else:
            hparams[key] = spec


def check_module_options(init: str, init_options: dict | None, lr_schedule: str, warmup_steps: int,
                         prior_weight_decay: float | None, parameterisation: str = "full",
                         prior_rank: int = DEFAULT_RANK, objective: str | None = None) -> None:
    """The module's own options, checked as ``MaskPriorModule`` does before it builds anything (also what a
    study's ``--dry_run`` checks for every run); a ValueError naming the option, its value and what it expects."""
    check_parameterisation(parameterisation, prior_rank)
    if parameterisation != "low_rank" and prior_rank != DEFAULT_RANK:
        raise ValueError(f"prior_rank {prior_rank!r} is an option of the low_rank parameterisation, but "
                         f"parameterisation is {parameterisation!r}; expected --model.parameterisation low_rank, or "
                         "no prior_rank")
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a whole number of steps >= 0, got {warmup_steps!r}")
    if prior_weight_decay is not None and not (
        isinstance(prior_weight_decay, int | float) and not isinstance(prior_weight_decay, bool)
        and 0 <= prior_weight_decay < math.inf
    ):
        raise ValueError(f"prior_weight_decay must be a finite number >= 0 (0: no decay of M) or null (the "
                         f"optimizer's own), got {prior_weight_decay!r}")
    if init_options is not None and not isinstance(init_options, dict):
        raise ValueError(f"init_options must be a mapping of option: value, got {init_options!r}")
    check_init_options(init, init_options or {})  # an unknown init, option, type or range
    if objective is not None:
        resolve("objective", objective)  # an unknown objective, or one that does not satisfy its contract


def check_prior_rank(parameterisation: str, prior_rank: int, tokens: int) -> None:
    """A ValueError where a ``low_rank`` prior's rank is above the ``tokens`` of the prior (the task's and the
    backbone's prefix tokens): it would be no lower than full."""
    if parameterisation == "low_rank" and prior_rank > tokens:
        raise ValueError(f"prior_rank {prior_rank} is above the {tokens} tokens of the prior: a low_rank M of rank "
                         f"{prior_rank} would be no lower than full; expected a rank from 1 to {tokens}")


def structure_spec(spec: Any) -> StructureSpec | DiscoverySpec | str | None:
    """``model.structure`` as the module reads it: a StructureSpec, a DiscoverySpec, ``discover:<method>``, or None
    (the task's own). A mapping with ``discover`` (as a checkpoint's hyperparameters keep it) is a DiscoverySpec,
    one of a StructureSpec's fields a StructureSpec, another string a structure builder's name or import path."""
    if isinstance(spec, dict) and "discover" in spec:
        return DiscoverySpec(**spec)
    if isinstance(spec, dict) and spec.keys() & {f.name for f in dataclasses.fields(StructureSpec)}:
        return StructureSpec(**spec)
    if isinstance(spec, str) and not spec.startswith("discover:"):
        return StructureSpec(builder=spec)
    return spec


def check_run(model: dict[str, Any], data: dict[str, Any], task: TaskSpec | None = None) -> None:
    """What a fit checks as it builds its module, made without training, applying an init or running an estimator
    (a study's ``--dry_run`` makes it for every run): the backbone builds for the task, the structure (a file, the
    pairs, a builder of yours) builds at the task's token count and fits the backbone's sequence, an estimator and
    its options resolve, and a ``low_rank`` prior_rank is within the prior's tokens. ``model`` and ``data`` are a
    fit config's entries (as ``--print_config`` writes them); ``task``: the datamodule's, if built already. A
    ValueError (a PluginError for a plug-in) naming what fails."""
    task = task if task is not None else build_datamodule(data).task_spec()
    backbone_spec = model.get("backbone")
    backbone = (_instantiate_from_spec(backbone_spec, task) if isinstance(backbone_spec, dict)
                else TokenTransformer(task))
    check_backbone(backbone)
    spec = structure_spec(model.get("structure"))
    if isinstance(spec, str):
        spec = DiscoverySpec(spec.removeprefix("discover:"))
    if isinstance(spec, DiscoverySpec):
        check_estimator_options(spec.discover, spec.options or {})  # an unknown estimator or option
    else:
        with calling("structure", getattr(spec, "builder", None)):
            structure = spec.build(task.seq_len) if spec is not None else task.structure
        to_sequence = getattr(backbone, "structure_for_sequence", None)
        if structure is not None and to_sequence is not None:
            to_sequence(structure)
    check_prior_rank(model.get("parameterisation") or "full", model.get("prior_rank") or DEFAULT_RANK,
                     task.seq_len + prefix_tokens(backbone))


def set_parameterisation(backbone: nn.Module, parameterisation: str, rank: int = DEFAULT_RANK) -> None:
    """Make every prior-carrying layer of ``backbone`` hold its prior as ``parameterisation``, with the backbone's
    token layout for ``relative``: its prefix tokens (``num_prefix_tokens``: a CLS token, registers) and its
    ``patch_grid()`` if it has one."""
    prefix = prefix_tokens(backbone)
    patch_grid = getattr(backbone, "patch_grid", None)
    grid = tuple(patch_grid()) if callable(patch_grid) else None
    for layer in attention_layers(backbone):
        layer.set_parameterisation(parameterisation, rank, grid, prefix)


def _report_projection(backbone: nn.Module, parameterisation: str) -> float:
    """The largest relative error of projecting the init's M onto ``parameterisation`` over the layers (0: exact),
    printed when it is not 0."""
    errors = [layer.projection_error for layer in attention_layers(backbone) if layer.has_prior]
    worst = max(errors, default=0.0)
    if worst > 1e-6:
        shown = ", ".join(f"{e:.3g}" for e in errors)
        rank_zero_info(f"prior: the init's M held as {parameterisation} with relative error |M - projected|/|M| "
                       f"{worst:.3g} (per layer: {shown}); the structure is not exactly {parameterisation}")
    return worst


class MaskPriorModule(L.LightningModule):
    """A transformer with a structural prior, trained on any task a datamodule describes.

    Args:
        backbone: The network, built for the task: a class whose first argument is the TaskSpec
            (e.g. ``lightning_maskprior.models.TokenTransformer``) with its other arguments in
            ``init_args``.
        init: Where the structure goes: ``default`` (nowhere), ``mask`` (learnable prior M),
            ``zero`` (learnable M = 0), ``fixed`` (frozen M), a query/key baseline, or ``module.path:function``: an
            init method of your own (:class:`~lightning_maskprior.inits.InitMethod`).
        init_options: Options of the init method, e.g. ``{open_value: 10, closed_value: -10}``
            for ``mask``. They override, key by key, the task's defaults for that method
            (``TaskSpec.init_defaults``: the paper's values for each benchmark).
        structure: Replace the task's own structure with one given here (pairs, per-head pairs,
            per-layer lists, a .pt/.npy file, or a structure builder: ``full``, ``my_pkg.structures:ring``,
            ``{builder: NAME, options: {...}}``), or ``discover:<method>`` (e.g. ``discover:fourier``, or
            ``discover:my_pkg.estimators:mine``): the one that estimator finds in the training data
            (``maskprior discover``), recorded in the hparams; ``{discover: <method>, options: {...}}`` gives the
            estimator's options.
        objective: Replace the task's objective (its loss and metrics): a registered one (``regression``,
            ``classification``, ``language_model``) or ``module.path:function`` of your own, called with the task's
            TaskSpec (:class:`~lightning_maskprior.objectives.ObjectiveFactory`). Default: the task's.
        optimizer: Optimizer class and its arguments (default Adam, lr 1e-3).
        lr_schedule: ``constant`` or ``cosine`` decay to 0 over the whole run, stepped per batch.
        warmup_steps: Linear warm-up steps before the schedule.
        prior_weight_decay: Weight decay applied to the prior logits M; ``null``: the optimizer's own, as for
            every other parameter. 0 by default: decay pulls M towards 0, a pull unrelated to the task's
            gradients (measured in the results: the mask's persistence with and without it). Every other
            parameter keeps the optimizer's weight decay, for every init method.
        parameterisation: How each layer holds the prior M the init writes: ``full`` (the paper's N x N M per
            head), ``relative`` (one value per head and query-key offset: O(N) per head; offsets are 2-D on a
            backbone with a ``patch_grid()``, and prefix tokens keep their rows and columns) or ``low_rank``
            (``M = U V^T + diag``, rank ``prior_rank``). The init's M is projected onto it (``relative``: the mean
            over each offset, exact for a shift-invariant structure); the projection's relative error is printed
            and logged as ``prior/projection_error`` when it is not 0.
        prior_rank: The rank r of a ``low_rank`` prior.
        task: Given by the datamodule (the CLI links it); not set in YAML.
        datamodule: The datamodule the model is trained on, as ``{class_path, init_args}``; the CLI links it
            and checkpoints keep it, so ``MaskPriorModule.load_from_checkpoint(path)`` rebuilds the task (and
            with it the backbone) with no other argument. Used only when ``task`` is not given; not set in YAML.
    """

    def __init__(
        self,
        backbone: Callable[[TaskSpec], Backbone] = TokenTransformer,
        init: str = "default",
        init_options: dict[str, Any] | None = None,
        structure: StructureSpec | DiscoverySpec | str | None = None,
        optimizer: OptimizerCallable = _adam,
        lr_schedule: Literal["constant", "cosine"] = "cosine",
        warmup_steps: int = 0,
        prior_weight_decay: float | None = 0.0,
        parameterisation: Parameterisation = "full",
        prior_rank: int = DEFAULT_RANK,
        objective: str | None = None,
        task: TaskSpec | None = None,
        datamodule: dict[str, Any] | None = None,
        discovered_structure: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if task is None:
            if not datamodule:
                raise ValueError("MaskPriorModule needs the datamodule's TaskSpec (task=dm.task_spec()), or the "
                                 "datamodule as datamodule={'class_path': ..., 'init_args': {...}}")
            task = build_datamodule(datamodule).task_spec()
        check_module_options(init, init_options, lr_schedule, warmup_steps, prior_weight_decay, parameterisation,
                             prior_rank, objective)
        self.save_hyperparameters(ignore=["task"])
        if isinstance(structure, DiscoverySpec):  # recorded as the YAML gives it
            self.hparams["structure"] = {"discover": structure.discover, "options": dict(structure.options)}
        # A checkpoint's hyperparameters hold backbone and optimizer as {class_path, init_args}: accept that too
        # (load_from_checkpoint of a module built in Python, outside the CLI).
        if isinstance(backbone, dict):
            backbone = functools.partial(_instantiate_from_spec, backbone)
        if isinstance(optimizer, dict):
            optimizer = functools.partial(_instantiate_from_spec, optimizer)
        _keep_plain_hparams(self.hparams)  # checkpoints load with weights_only=True: plain values only
        self.task = task
        self.init_method = init
        self.backbone_factory = backbone
        self.optimizer_factory = optimizer
        self.lr_schedule, self.warmup_steps = lr_schedule, warmup_steps
        self.prior_weight_decay = prior_weight_decay
        self.objective_name = objective
        with calling("objective", objective):
            self.objective = build_objective(objective, task) if objective is not None else task.objective

        self.backbone = backbone(task)
        check_backbone(self.backbone)
        self.structure = self._resolve_structure(structure)
        self.init_options = {**task.init_defaults.get(init, {}), **(init_options or {})}
        self.parameterisation = parameterisation
        check_prior_rank(parameterisation, prior_rank, self.task.seq_len + prefix_tokens(self.backbone))
        set_parameterisation(self.backbone, parameterisation, prior_rank)
        with calling("init", init):
            apply_init(init, self.backbone, self.structure, **self.init_options)
        self.projection_error = _report_projection(self.backbone, parameterisation)

        self.metrics = nn.ModuleDict({s: self.objective.make_metrics() for s in ("val", "test")})
        self.mean_loss = nn.ModuleDict({s: MeanMetric() for s in ("val", "test")})

    # ----------------------------------------------------------------------------- structure
    def _resolve_structure(self, spec: StructureSpec | DiscoverySpec | str | None) -> Structure | None:
        spec = structure_spec(spec)
        if isinstance(spec, str | DiscoverySpec):
            spec = self._discovered(spec)
        with calling("structure", getattr(spec, "builder", None)):
            structure = spec.build(self.task.seq_len) if spec is not None else self.task.structure
        if structure is None:
            return None
        to_sequence = getattr(self.backbone, "structure_for_sequence", None)
        structure = to_sequence(structure) if to_sequence is not None else structure
        return self._measured_only(structure)

    def _measured_only(self, structure: Structure) -> Structure:
        """An init that does not place the structure (default, zero, mimetic, ...) only measures against it: where
        its heads do not fit the model's (GOAT needs a head count that divides the width; the task's structure may
        have one pattern per head of another count), it is measured against the union of its heads."""
        if uses_structure(get_init(self.init_method)):
            return structure
        layers = attention_layers(self.backbone)
        if layers and structure.num_heads not in (1, layers[0].num_heads):
            return structure.union_over_heads()
        return structure

    def _discovered(self, spec: str | DiscoverySpec) -> StructureSpec:
        """``discover:<method>`` or ``{discover: <method>, options: {...}}``: the structure estimator ``method`` finds
        in the training split of this run's datamodule (discover.py), instead of the task's own; the pairs go into
        the hyperparameters."""
        from lightning_maskprior.discover import ESTIMATORS, agreement, discover
        from lightning_maskprior.plugins import is_import_path

        method, options = (spec.discover, spec.options or {}) if isinstance(spec, DiscoverySpec) else (
            spec.removeprefix("discover:"), {})
        if method not in ESTIMATORS and not is_import_path(method):
            raise ValueError(f"structure {spec!r}: expected a structure (pairs, heads, layers, file or builder), "
                             f"discover:<method> or {{discover: <method>, options: {{...}}}} with a method in "
                             f"{sorted(ESTIMATORS)} or module.path:function")
        recorded = self.hparams.get("discovered_structure")
        if isinstance(recorded, dict) and recorded.get("method") == method:  # the run's own: not estimated again
            heads = recorded.get("heads")
            return StructureSpec(heads=heads) if heads is not None else StructureSpec(pairs=recorded["pairs"])
        if not self.hparams.get("datamodule"):
            raise ValueError(f"structure {spec!r} needs the run's datamodule (the CLI links it)")
        start = time.perf_counter()
        with restoring_weights(False):  # the estimator's modules train from their init
            found = discover(method, build_datamodule(self.hparams["datamodule"]), make_module=self.fresh, **options)
        spec = found.spec(attention_layers(self.backbone)[0].num_heads)
        self.hparams["discovered_structure"] = {"method": method, "pairs": [list(p) for p in found.pairs]}
        if options:
            self.hparams["discovered_structure"]["options"] = dict(options)
        if spec.heads is not None:
            self.hparams["discovered_structure"]["heads"] = spec.heads
        # Logged at the start of training (discovery/*): the cost, and the match with the task's own structure,
        # which is read only now, after the estimator has run.
        self.discovery_metrics = {"discovery/seconds": time.perf_counter() - start,
                                  "discovery/pairs": float(len(found.pairs))}
        if self.task.structure is not None and self.task.structure.seq_len == found.seq_len:
            self.discovery_metrics.update({f"discovery/{k}": v for k, v in agreement(found.pairs,
                                                                                     self.task.structure).items()})
        return spec

    def fresh(self, init: str = "default") -> MaskPriorModule:
        """A new module for the same task, backbone and optimizer, with ``init`` and no structure (every token
        attends only to itself as far as a structure is concerned): what the discovery estimators train."""
        return type(self)(backbone=self.backbone_factory, init=init, structure=StructureSpec(pairs=[]),
                          optimizer=self.optimizer_factory, lr_schedule=self.lr_schedule,
                          warmup_steps=self.warmup_steps, prior_weight_decay=self.prior_weight_decay,
                          objective=self.objective_name, task=self.task)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, strict: bool | None = None,
                             **kwargs: Any) -> MaskPriorModule:
        """Lightning's ``load_from_checkpoint``, without the init's fitting (QK-Opt's Adam, minutes with
        ``fit_on: inputs``): the checkpoint's weights replace what it would fit (:func:`restoring_weights`). With
        ``strict=False`` the init runs whole, as the checkpoint may hold only some of the weights."""
        restoring = restoring_weights() if strict is not False else contextlib.nullcontext()
        with restoring:
            return super().load_from_checkpoint(checkpoint_path, *args, strict=strict, **kwargs)

    def on_train_start(self) -> None:
        metrics = getattr(self, "discovery_metrics", None)
        if self.projection_error and self.global_step == 0:
            for logger in self.loggers:  # all of them: self.logger is only the first
                logger.log_metrics({"prior/projection_error": self.projection_error}, step=0)
        if metrics and self.logger is not None and self.global_step == 0:
            for logger in self.loggers:
                logger.log_metrics(metrics, step=0)
            # the structure this run trained with, beside its config in hparams.yaml (the logger wrote the
            # hyperparameters as the CLI gave them, "discover:<method>", before the estimator ran)
            log_dir, hparams = getattr(self.logger, "log_dir", None), getattr(self.logger, "hparams", None)
            if log_dir and isinstance(hparams, dict) and self.trainer.is_global_zero:  # the logger writes it once
                hparams["discovered_structure"] = self.hparams["discovered_structure"]
                save_hparams_to_yaml(Path(log_dir) / "hparams.yaml", hparams)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The structure the model trained with, whatever built it (a file, a plug-in, an estimator): what a reload
        # measures against, though the config's structure may since build another.
        if self.structure is not None:
            checkpoint[STRUCTURE_KEY] = structure_state(self.structure)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this before load_state_dict: a checkpoint of another config fails here, in the
        # config's terms ("trained with dim 64, the config asks for 16"), not as a list of size mismatches.
        check_checkpoint_fits(checkpoint, self)
        saved = checkpoint.get(STRUCTURE_KEY)
        if saved is not None:
            self.structure = self._trained_structure(structure_from_state(saved))

    def _trained_structure(self, trained: Structure) -> Structure:
        """The structure a checkpoint trained with, over the one the config built now, naming a difference."""
        built = self.structure
        if built is None or not same_structure(built, trained):
            now = "none" if built is None else f"{built!r}"
            rank_zero_warn(f"the checkpoint was trained with {trained!r}; the config's structure now builds {now} (its "
                           "file, builder or estimator changed?): the run is measured against the one it trained with")
        return trained

    # ------------------------------------------------------------------------------ steps
    def forward(self, inputs: Tensor) -> Tensor:
        return self.backbone(inputs)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.objective.loss(self(batch["inputs"]), batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["inputs"]))
        return loss

    def _eval_step(self, stage: str, batch: dict[str, Tensor]) -> Tensor:
        output = self(batch["inputs"])
        self.mean_loss[stage].update(self.objective.loss(output, batch), weight=len(batch["inputs"]))
        self.objective.update_metrics(self.metrics[stage], output, batch)
        return output

    def _eval_epoch_end(self, stage: str) -> None:
        if self.trainer.sanity_checking:
            values = {}
        else:
            # compute() synchronises the metric states across DDP ranks.
            values = {f"{stage}/{k}": v for k, v in self.metrics[stage].compute().items()}
            values[f"{stage}/loss"] = self.mean_loss[stage].compute()
        self.metrics[stage].reset()
        self.mean_loss[stage].reset()
        if values:
            # Already identical on every rank; sync_dist only averages equal numbers.
            shown = self.objective.progress_metrics
            bar = {k: v for k, v in values.items() if shown is None or k.split("/", 1)[1] in (*shown, "loss")}
            self.log_dict(bar, prog_bar=stage == "val", sync_dist=True)
            self.log_dict({k: v for k, v in values.items() if k not in bar}, sync_dist=True)

    def metric_tags(self) -> list[str]:
        """The tags validation and test log: ``val/<metric>`` and ``test/<metric>`` for each of the objective's
        metrics, and ``val/loss``, ``test/loss``. They are the metrics of the run's TensorBoard HPARAMS session."""
        return [f"{stage}/{name}" for stage in ("val", "test") for name in [*self.metrics[stage].keys(), "loss"]]

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # The predictions go to callbacks' on_validation_batch_end (ExtrapolationMonitor).
        return self._eval_step("val", batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step("test", batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Per example: the prediction, and what the batch carries beside the inputs (target, unseen, mdi...)."""
        output = self(batch["inputs"])
        rows = self.objective.predict(output, batch)
        for key, value in batch.items():
            if key != "inputs" and isinstance(value, Tensor) and value.dim() >= 1 and len(value) == len(output):
                rows.setdefault(key, value)
        return rows

    # ------------------------------------------------------------------------- optimisation
    def configure_optimizers(self):
        prior, other = [], []
        for name, param in self.named_parameters():
            if param.requires_grad:
                (prior if name.rsplit(".", 1)[-1] in PRIOR_PARAMETER_NAMES else other).append(param)
        # Named groups: LearningRateMonitor logs each group's rate as train/lr/<name> (train/lr/network for every
        # init, train/lr/prior beside it when there is a prior).
        groups = [{"params": other, "name": "network"}]
        if prior:
            group = {"params": prior, "name": "prior"}
            if self.prior_weight_decay is not None:  # None: the optimizer's own weight decay
                group["weight_decay"] = self.prior_weight_decay
            groups.append(group)
        optimizer = self.optimizer_factory(groups)
        if self.lr_schedule == "constant" and self.warmup_steps == 0:
            return optimizer
        warmup, cosine = self.warmup_steps, self.lr_schedule == "cosine"
        total: list[int] = []

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if not cosine or step == warmup:
                return 1.0
            # Read on first use, during training: asking for it in configure_optimizers would make Lightning
            # build the training loader before a checkpoint's loader state is restored (inexact resume).
            if not total:
                total.append(max(1, int(self.trainer.estimated_stepping_batches)))
            progress = min(1.0, (step - warmup) / max(1, total[0] - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        schedule = {"scheduler": scheduler, "interval": "step", "name": "train/lr"}  # the LearningRateMonitor's tag
        return {"optimizer": optimizer, "lr_scheduler": schedule}

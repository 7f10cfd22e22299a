"""The run's TensorBoard HPARAMS session: its configuration and the metrics to compare runs by.

``HparamsSession`` (a callback the ``maskprior`` CLI adds) makes runs comparable in TensorBoard's HPARAMS tab;
``lightning_maskprior.run.tensorboard.read_hparams`` reads it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

_NOT_HPARAMS = ("_instantiator", "_class_path", "task", "structure", "init_options")  # internal, or set below


def run_hparams(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str | int | float]:
    """The run's configuration as flat ``name: value`` pairs, the columns of TensorBoard's HPARAMS tab.

    ``task``, ``init``, ``seed``, ``structure`` (the structure's name), the module's other hyperparameters
    (``lr_schedule``, ``warmup_steps``...), ``init_options/<option>`` (with the task's defaults filled in), the
    backbone, optimizer and datamodule as their class name (``backbone``, ``optimizer``, ``data``) with their
    arguments (``backbone/dim``, ``optimizer/lr``, ``data/batch_size``...), and ``trainer/max_epochs``,
    ``trainer/max_steps``, ``trainer/precision``, ``trainer/accumulate_grad_batches``,
    ``trainer/gradient_clip_val``, ``trainer/world_size``. None values are left out; lists become JSON text.
    """
    hparams = dict(pl_module.hparams)
    seed = os.environ.get("PL_GLOBAL_SEED")  # what seed_everything (LightningCLI's seed_everything) set
    structure = getattr(pl_module, "structure", None)
    params: dict[str, Any] = {
        "task": getattr(getattr(pl_module, "task", None), "name", None),
        "init": hparams.get("init"),
        "seed": int(seed) if seed else None,
        "structure": structure.name if structure is not None else "none",
    }
    init_options = getattr(pl_module, "init_options", hparams.get("init_options"))
    _flatten(params, "init_options", init_options if isinstance(init_options, dict) else {})
    for key, value in hparams.items():
        if key in _NOT_HPARAMS:
            continue
        _flatten(params, "data" if key == "datamodule" else key, value)
    params.update({
        "trainer/max_epochs": trainer.max_epochs,
        "trainer/max_steps": trainer.max_steps,
        "trainer/precision": str(trainer.precision),
        "trainer/accumulate_grad_batches": trainer.accumulate_grad_batches,
        "trainer/gradient_clip_val": trainer.gradient_clip_val,
        "trainer/world_size": trainer.world_size,
    })
    return {k: _hparam_value(v) for k, v in params.items() if v is not None}


def _flatten(out: dict[str, Any], key: str, value: Any) -> None:
    """``{class_path, init_args}`` becomes ``key`` = the class's name and ``key/<arg>`` = each argument; other
    mappings become ``key/<name>``."""
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        out[key] = value["class_path"].rsplit(".", 1)[-1]
        value = value.get("init_args") or {}
    if isinstance(value, dict):
        for name, item in value.items():
            _flatten(out, f"{key}/{name}", item)
    else:
        out[key] = value


def _hparam_value(value: Any) -> str | int | float:
    if isinstance(value, bool):
        return str(value).lower()  # TensorBoard would show a bool as the number 1 or 0
    if isinstance(value, int | float | str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


class HparamsSession(Callback):
    """Write the run's TensorBoard HPARAMS session: its configuration and the metrics to compare runs by.

    At the start of fit, validate and test (rank zero, once per run directory), every TensorBoardLogger gets
    ``run_hparams`` as the hyperparameters and the module's ``metric_tags()`` (``val/acc``, ``val/loss``,
    ``test/acc``...) as the session's metrics. TensorBoard's HPARAMS tab shows for each metric the last value of
    the scalar of that tag in the same run directory: the run's final validation (or test) metrics.

    Lightning's ``TensorBoardLogger.log_hyperparams(params, metrics)`` would also log each metric's placeholder
    value as a scalar (a point at step 0 on the ``val/acc`` curve), so the three hparams summaries are written
    here directly. Written in ``setup``, before Lightning's own call: TensorBoard keeps a run's first session.
    A fit resumed into its checkpoint's run directory writes none: the run's session is the one it started with
    (as its config.yaml and hparams.yaml), and the options a resume changed are the run's record's segments
    (changes.yaml). The loggers the CLI creates have ``default_hp_metric=False``, so nothing logs
    ``hp_metric = -1``.
    """

    def __init__(self, resumed_run: str | Path | None = None) -> None:
        """``resumed_run``: the run directory of the checkpoint a fit resumes (its session is written already)."""
        self._written: set[str] = set()
        self.resumed_run = Path(resumed_run).resolve() if resumed_run is not None else None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate", "test") or trainer.global_rank != 0:
            return
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        from torch.utils.tensorboard.summary import hparams

        tags = getattr(pl_module, "metric_tags", None)
        metrics = {tag: 0.0 for tag in (tags() if callable(tags) else [])}  # only the names are written
        summaries = hparams(run_hparams(trainer, pl_module), metrics)
        resumed = self.resumed_run if stage == "fit" else None
        for logger in loggers:
            if logger.log_dir in self._written:  # trainer.validate after fit: the same run, already written
                continue
            if resumed is not None and Path(logger.log_dir).resolve() == resumed:  # its run's session is written
                self._written.add(logger.log_dir)
                continue
            writer = logger.experiment._get_file_writer()  # as Lightning's log_hyperparams writes them
            for summary in summaries:
                writer.add_summary(summary)
            writer.flush()
            self._written.add(logger.log_dir)

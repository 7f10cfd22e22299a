"""Report a validation metric to an Optuna trial and stop the fit cleanly when the study's pruner prunes it.

``maskprior tune`` adds this callback to the first run of each trial. The trial's worker writes ``trial_file``
(the storage URL, the study's name and the trial's id) before the fit starts, so a retried trial that resumes in
the same directory reports to the new trial. When the pruner says stop, the fit ends at the end of that validation
as any fit ends (last.ckpt saved, exit code 0) and ``pruned.json`` beside ``trial_file`` says at which step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_maskprior.run import atomic

PRUNED_FILE = "pruned.json"


class OptunaPruning(Callback):
    """Feed an Optuna pruner from validation: ``trial.report(value, global_step)``, then ``trial.should_prune()``.

    Args:
        trial_file: JSON file holding ``storage`` (an Optuna storage URL or journal file), ``study_name``,
            ``trial_id`` (the trial this fit reports to) and ``pruner`` (the study's pruner as class_path and
            init_args).
        monitor: The logged validation metric reported, e.g. ``val/loss``.
    """

    def __init__(self, trial_file: str, monitor: str) -> None:
        self.trial_file = Path(trial_file)
        self.monitor = monitor
        self._trial: Any = None
        self._warned = False

    def _open(self) -> Any:
        if self._trial is None:
            import optuna

            from lightning_maskprior.tune.storage import instantiate, open_storage

            spec = json.loads(self.trial_file.read_text())
            storage = open_storage(spec["storage"])  # no heartbeat here: the worker beats for its trial
            # A storage keeps no pruner: the tune's is rebuilt here from its class_path and init_args.
            pruner = instantiate(spec["pruner"], optuna.pruners.BasePruner)
            study = optuna.load_study(study_name=spec["study_name"], storage=storage, pruner=pruner)
            self._trial = optuna.trial.Trial(study, spec["trial_id"])
        return self._trial

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if trainer.is_global_zero:
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:
                if not self._warned:
                    rank_zero_warn(f"OptunaPruning: the fit logged no {self.monitor!r} at validation; this trial is "
                                   f"not pruned (logged: {sorted(trainer.callback_metrics)})")
                    self._warned = True
            elif math.isfinite(float(value)):
                trial = self._open()
                trial.report(float(value), step=trainer.global_step)
                prune = trial.should_prune()
        prune = trainer.strategy.broadcast(prune, src=0)
        if prune:
            trainer.should_stop = True
            if trainer.is_global_zero:
                atomic.write_text(self.trial_file.with_name(PRUNED_FILE), json.dumps(
                    {"step": trainer.global_step, "monitor": self.monitor,
                     "value": float(trainer.callback_metrics[self.monitor])}) + "\n")

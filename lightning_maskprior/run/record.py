"""A run's record: the config it started with (``config.yaml``) and one segment per resume that changed an option
(``changes.yaml``: the global step, and per option its old and new value). Replayed, it is what the run trained with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

from lightning_maskprior.run import atomic
from lightning_maskprior.run.rundir import RunDir

# Options that decide what is trained, and so cannot change mid-run (the first prefix that matches gives the reason).
# The task's data options that only say where data is read from or how it is evaluated are the next list's, or
# applied from the resumed step.
FIXED: tuple[tuple[str, str], ...] = (
    ("data.init_args.batch_size", "each step's examples and the data order follow it"),
    ("data", "it defines the task"),
    ("model.init", "it decides where the structure went"),
    ("model.init_options", "they decided the prior the model started from"),
    ("model.structure", "it is the structure the model was trained with"),
    ("model.objective", "it is the loss the model was trained on"),
    ("model.backbone", "it is the architecture of the trained weights"),
    ("model.parameterisation", "it is how the trained prior is held"),
    ("model.prior_rank", "it is the shape of the trained prior"),
    ("model.optimizer.class_path", "the checkpoint's optimizer state is of its class"),
)
# Options that say where a run logs or reads from, or how it reports: not what it trains. (A resumed fit's random
# state is its checkpoint's, whatever seed_everything says; the data order follows the datamodule's own seed.)
NOT_RECORDED = (
    "config", "ckpt_path", "seed_everything", "model.datamodule", "model.discovered_structure", "trainer.logger",
    "trainer.default_root_dir", "trainer.enable_progress_bar", "trainer.enable_model_summary",
    "data.init_args.num_workers", "data.init_args.cache_dir", "data.init_args.data_dir", "data.init_args.root",
    "data.init_args.download",
)
# Data options a resumed fit may change (they steer evaluation): applied from the resumed step and recorded.
EVALUATION_DATA_OPTIONS = ("data.init_args.eval_batch_size", "data.init_args.val_size", "data.init_args.test_size",
                           "data.init_args.num_test_stories")
# Options that decide what an evaluation of a run measures (validate, test, predict): its precision and the
# evaluation splits' sizes. Evaluating a run that a resume changed one of them names it (run/cli.py).
EVALUATION_OPTIONS = ("trainer.precision", "data.init_args.val_size", "data.init_args.test_size",
                      "data.init_args.num_test_stories")


class RecordError(ValueError):
    """A resume that would change an option a run cannot change mid-run."""


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model.optimizer.init_args.lr": 0.001, ...}``: every leaf of a nested mapping (lists are leaves)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _matches(option: str, prefix: str) -> bool:
    return option == prefix or option.startswith(f"{prefix}.")


def segments(run_dir: RunDir) -> list[dict[str, Any]]:
    """The run's segments, ``[{step, changed: {option: {old, new}}}, ...]`` ([] for a run never resumed with a
    change); a file that is not such a list is an error naming it."""
    path = run_dir.changes
    if not path.is_file():
        return []
    try:
        entries = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise RecordError(f"{path} is not YAML ({type(err).__name__}); expected the run's list of segments") from None
    if entries is None:
        return []
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("changed"), dict)
                                                for e in entries):
        raise RecordError(f"{path} is not a list of {{step, changed}} segments; expected the one its fit wrote")
    return entries


def replay(run_dir: RunDir) -> dict[str, Any] | None:
    """The options the run trained with last, flattened: its config.yaml with every segment applied in order; None
    when the run has no config.yaml."""
    if not run_dir.config_path.is_file():
        return None
    flat = flatten(run_dir.config())
    for segment in segments(run_dir):
        for option, change in segment["changed"].items():
            # {old, new}; a segment written before the record had its own file format said {checkpoint, config}
            flat[option] = change.get("new", change.get("config")) if isinstance(change, dict) else change
    return flat


def differences(recorded: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{option: (recorded, config)}`` for every option whose value differs (a missing option counts as null),
    leaving out ``NOT_RECORDED``."""
    changed = {}
    for option in sorted(recorded.keys() | config.keys()):
        if any(_matches(option, prefix) for prefix in NOT_RECORDED):
            continue
        then, now = recorded.get(option), config.get(option)
        if then != now:
            changed[option] = (then, now)
    return changed


def why_fixed(option: str) -> str | None:
    """Why ``option`` cannot change mid-run, or None if a resumed fit may change it."""
    if option in EVALUATION_DATA_OPTIONS:
        return None
    return next((why for prefix, why in FIXED if _matches(option, prefix)), None)


def check_changes(changes: Mapping[str, tuple[Any, Any]], run_dir: RunDir) -> None:
    """Raise a RecordError naming the first option that cannot change mid-run, both values and why."""
    for option, (then, now) in changes.items():
        why = why_fixed(option)
        if why is not None:
            raise RecordError(f"{option} cannot change when resuming run {run_dir.path} ({then!r} there, {now!r} in "
                              f"the config): {why}. Expected the run's own value, or a new fit without --ckpt_path")


def evaluation_changes(run_dir: RunDir, config: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{option: (the run's last value, config's)}`` for each ``EVALUATION_OPTIONS`` entry a resume of the run
    changed (changes.yaml) to a value ``config`` (a flat or nested config of validate, test or predict) does not
    have: evaluated with ``config``, the run is measured otherwise than it ended."""
    here = flatten(config)
    ended = run_dir.changed_options()
    return {option: (value, here.get(option)) for option, value in ended.items()
            if option in EVALUATION_OPTIONS and here.get(option) != value}


def append_segment(run_dir: RunDir, step: int, changes: Mapping[str, tuple[Any, Any]]) -> None:
    """Append ``{step, changed: {option: {old, new}}}`` to the run's ``changes.yaml``, atomically."""
    entries = segments(run_dir)
    entries.append({"step": int(step), "changed": {option: {"old": then, "new": now}
                                                   for option, (then, now) in changes.items()}})
    atomic.write_text(run_dir.changes, yaml.safe_dump(entries, sort_keys=False))


def write_config(path: str | Path, text: str) -> None:
    """Write a run's starting config, atomically: a command that fails while writing leaves the old file."""
    atomic.write_text(path, text)


class RunRecord(SaveConfigCallback):
    """LightningCLI's config writer, keeping the run's record: a run's ``config.yaml`` is written atomically when
    it starts. A resumed fit that logs into its checkpoint's run directory leaves config.yaml as the run started,
    and appends the options it changed (``resumed``) as a segment at the resumed step with its first checkpoint:
    a resumed fit that fails before saving one leaves the record as it was."""

    resumed: Resumed | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # a collective call: every rank makes it
        resumed = self.resumed
        if resumed is None or log_dir is None or Path(log_dir) != resumed.run_dir.path:
            self.resumed = None  # not logging into the checkpoint's run: a record of its own
            if log_dir is not None and trainer.is_global_zero:
                write_config(Path(log_dir) / self.config_filename, self.parser.dump(self.config, skip_none=False))
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
        self.already_saved = trainer.strategy.broadcast(True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resumed = self.resumed
        if resumed is not None and resumed.changes:
            shown = ", ".join(f"{option} {then!r} -> {now!r}" for option, (then, now) in resumed.changes.items())
            rank_zero_info(f"maskprior: resumed at step {resumed.step} with options changed from the run's record: "
                           f"{shown} (recorded in {resumed.run_dir.changes} with the next checkpoint)")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        resumed, self.resumed = self.resumed, None
        if resumed is not None and resumed.changes and trainer.is_global_zero:
            append_segment(resumed.run_dir, resumed.step, resumed.changes)


@dataclass
class Resumed:
    """A resumed fit: the checkpoint's run directory, the step it resumes at and the options it changes."""

    run_dir: RunDir
    step: int
    changes: dict[str, tuple[Any, Any]]


def resumed_changes(run_dir: RunDir, config: Mapping[str, Any]) -> dict[str, tuple[Any, Any]] | None:
    """The options ``config`` (the resumed fit's, as config.yaml writes it) changes from the run's record, after
    refusing, naming it, one that cannot change mid-run; None when the run has no config.yaml to compare with."""
    recorded = replay(run_dir)
    if recorded is None:
        return None
    changes = differences(recorded, flatten(config))
    check_changes(changes, run_dir)
    return changes

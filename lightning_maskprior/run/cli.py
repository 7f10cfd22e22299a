"""``maskprior fit / validate / test / predict``: LightningCLI over MaskPriorModule.

    maskprior fit -c boolean/2parity.yaml -c init/mask.yaml
    maskprior fit --help

The configs compose over ``configs/trainer/default.yaml`` (``config_files.default_files``), read before any ``-c``.
A run's directory is ``<default_root_dir>/<task>-<init>-seed<seed>/version_N`` (e.g.
``runs/2parity-mask-seed0/version_0``; a configured TensorBoardLogger's own directory), whatever loggers it has: its
``ScalarsLogger`` (run/scalars_logger.py), first among them, keeps every scalar in ``scalars.csv`` there. With no
logger configured the others are one TensorBoardLogger in that same directory, with the run's configuration and final
metrics in its HPARAMS tab; with ``--trainer.logger false`` the scalars file is the run's only log.
A fit keeps ``<log_dir>/checkpoints/last.ckpt``; ``--ckpt_path last`` resumes the newest one exactly, in the
same run directory, whose config.yaml stays as the run started: the options a resume changes are appended to the
run's record (run/record.py). Exit codes (run/status.py): 0 done, 3 diverged, 143 / 130 stopped by SIGTERM / SIGINT
after saving last.ckpt.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.plugins import CheckpointIO
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from lightning_maskprior.callbacks import PredictionWriter, PriorPersistence
from lightning_maskprior.callbacks.divergence import Diverged, StopOnDivergence
from lightning_maskprior.callbacks.hparams import HparamsSession
from lightning_maskprior.callbacks.rng import RNGStates
from lightning_maskprior.callbacks.signals import FinalCheckpoint, StopOnSignal
from lightning_maskprior.datamodules.base import MaskPriorDataModule
from lightning_maskprior.inits import restoring_weights
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import allocator, checks, config_files, errors, precision, record
from lightning_maskprior.run import status as run_status
from lightning_maskprior.run.atomic import AtomicCheckpointIO
from lightning_maskprior.run.resume import ResumedOptions
from lightning_maskprior.run.rundir import Checkpoint, RunDir, StudyRunDir
from lightning_maskprior.run.scalars_logger import ScalarsLogger

# test, validate and predict with a checkpoint log into a run directory of their own, so Lightning says on every one
# that the checkpoint's ModelCheckpoint saved to another; nothing of it is used there. A resumed fit saves into its
# checkpoint's own run directory (_continue_run_directory), where the warning never fires.
warnings.filterwarnings("ignore", message=r"The dirpath has changed from")


class OneLineParser(config_files.CheckedConfigFiles, errors.OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser with one-line errors (``error: key: expected TYPE, got VALUE``, exit 2) and config files
    checked as it reads them (one naming the file that is not a YAML mapping)."""


class ReadOnceCheckpointIO(AtomicCheckpointIO):
    """The CLI's checkpoint plugin: saves atomically, and hands Lightning's restore the run's checkpoint as the CLI
    already read it (one ``torch.load`` per run) instead of loading the same file again."""

    def __init__(self, checkpoint: Checkpoint | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> Any:
        held = self.checkpoint
        if held is not None and held.is_read and Path(path).resolve() == held.path.resolve():
            return held.contents
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


class RemoveEmptyRun(Callback):
    """A run that fails before it logs anything leaves no empty run directory (``RunDir.remove_if_empty``)."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # logger.log_dir, not trainer.log_dir: the latter is a collective call, unsafe on a failure path.
        if trainer.is_global_zero and trainer.loggers:
            for logger in trainer.loggers:
                logger.finalize("failed")  # flushed first: a value still queued in the event writer is a result
            _remove_if_empty(getattr(trainer.loggers[0], "log_dir", None))


class MaskPriorCLI(LightningCLI):
    """LightningCLI with the datamodule's TaskSpec linked into the model.

    ``checkpoint``: the config's ``ckpt_path`` as a :class:`Checkpoint`, read once, as soon as the arguments are
    parsed (``parse_arguments``). Every check of it (what it binds, its step, its shapes, its run directory) looks at
    that one object, and Lightning's restore is handed its contents (``ReadOnceCheckpointIO``).
    """

    checkpoint: Checkpoint | None = None
    resumed: record.Resumed | None = None

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data", "model.task", apply_on="instantiate", compute_fn=_task_spec)
        # The datamodule's config goes into the model's hyperparameters (and checkpoints): it rebuilds the task.
        parser.link_arguments("data", "model.datamodule", apply_on="parse", compute_fn=_datamodule_spec)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.epilog = _EPILOG  # the commands that are not LightningCLI's

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand is not None:
            self.checkpoint = _read_checkpoint(self.config[subcommand], subcommand)

    def _parse_ckpt_path(self) -> None:
        # The one private override: Lightning 2.6 merges the checkpoint's hyperparameters into the config here, with
        # no public switch, silently replacing options given on the command line (and loading the file a second
        # time). Instead the config is the truth and the checkpoint must belong to it (_read_checkpoint). Options
        # that only steer training (lr_schedule, the optimizer's...) are the config's: a resumed fit continues with
        # them (run/resume.py).
        pass

    def before_instantiate_classes(self) -> None:
        if self.subcommand == "fit":
            try:
                checks.check_fit_options(self.config.fit.trainer, self.config.fit.model)
            except ValueError as err:
                _bad_input(str(err))
            _continue_run_directory(self.config.fit, self.checkpoint)
        elif self.subcommand is not None:
            _without_purge_step(self.config[self.subcommand].trainer)
        if self.subcommand in ("fit", "validate", "test"):
            try:
                checks.check_logger_stores(self.config[self.subcommand].trainer.get("logger"))
            except ValueError as err:
                _bad_input(str(err))
        if self.subcommand is not None:
            # bf16 on a CPU without native bf16 becomes fp32. Changed in the config, so the run's config.yaml
            # (and its hparams) record the precision the run used.
            trainer = self.config[self.subcommand].trainer
            trainer.precision, line = precision.resolve(trainer.get("accelerator"), trainer.get("precision"))
            if line:
                rank_zero_info(line)
        if self.subcommand in ("validate", "test", "predict"):
            _note_evaluation_changes(self.config[self.subcommand], self.checkpoint, self.subcommand)
        if self.subcommand is not None:
            _use_discovered_structure(self.config[self.subcommand].model, self.checkpoint)
        if self.subcommand == "fit":
            self.resumed = self._resumed()

    def _resumed(self) -> record.Resumed | None:
        """A fit resumed from a checkpoint of a run directory with a record: the options it changes from the record,
        after refusing (one line, exit 2) one that cannot change mid-run, before anything is written."""
        run_dir = self.checkpoint.run_dir if self.checkpoint is not None else None
        if run_dir is None or not self.checkpoint.is_read:  # weights_only false: the file is not read here
            return None
        config = yaml.safe_load(self._parser("fit").dump(self.config.fit, skip_none=False))
        try:
            changes = record.resumed_changes(run_dir, config)
        except record.RecordError as err:
            _bad_input(str(err))
        return None if changes is None else record.Resumed(run_dir, self.checkpoint.global_step, changes)

    def instantiate_classes(self) -> None:
        # A bad value a datamodule, structure, init or module refuses while being built is bad input: one line and
        # exit 2, not a traceback. (Errors once training runs are not caught here.)
        # With a checkpoint, its weights replace the model's next: the init's fitting is skipped (inits.py).
        restoring = restoring_weights() if self.checkpoint is not None else contextlib.nullcontext()
        try:
            with restoring:
                super().instantiate_classes()
        except (ValueError, FileNotFoundError) as err:
            _bad_input(_underlying_message(err))

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The Trainer with the run's own callbacks, logger and checkpoint plugin beside the configured ones."""
        parsed = self.config_init[self.subcommand] if self.subcommand else self.config_init  # run=False: no subcommand
        config = {**parsed.get("trainer", {}), **kwargs}
        configured = _first_persistence(_as_list(config.get("callbacks")))
        # Every fit keeps last.ckpt (saved at the end of training and on SIGTERM/SIGINT), unless checkpointing is off.
        callbacks = [StopOnSignal(), FinalCheckpoint(), RNGStates(), StopOnDivergence(), RemoveEmptyRun()]
        if self.subcommand == "fit":
            callbacks.append(ResumedOptions())  # a resumed fit trains with the config's optimizer options
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in configured):
            run_dir = RunDir.of_checkpoint(self.config.predict.get("ckpt_path"))
            callbacks.append(PredictionWriter(run_dir.path if run_dir is not None else None))
        if self.subcommand in ("fit", "validate", "test"):
            kwargs["logger"] = self._loggers(config.get("logger"), config.get("default_root_dir"))
            callbacks += self._logging_callbacks(configured)
        else:  # predict logs nothing: its predictions go to the checkpoint's run directory
            kwargs["logger"] = self._logger(config.get("logger"), config.get("default_root_dir"))
        checkpointing = [c for c in configured if isinstance(c, ModelCheckpoint)]
        if config.get("enable_checkpointing", True) is not False:
            if not checkpointing:
                # After every training epoch (after its validation, when it has one), whatever the validation
                # cadence: a kill loses at most the epoch in progress.
                callbacks.append(ModelCheckpoint(save_last=True, save_on_train_epoch_end=True))
            for callback in checkpointing:
                callback.save_last = callback.save_last or True
        kwargs["callbacks"] = [*configured, *callbacks]
        # Checkpoints through a temporary file: a full disk or a kill mid-save never truncates a good last.ckpt.
        plugins = _as_list(config.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, ReadOnceCheckpointIO(self.checkpoint)]
        try:  # Lightning refuses a trainer option (devices 0, an accelerator this machine lacks...) here
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            _bad_input(f"trainer: {err}")
        for callback in trainer.callbacks:
            if isinstance(callback, record.RunRecord):
                callback.resumed = self.resumed
        return trainer

    def _logger(self, logger: Any, root: str | None) -> Any:
        """A run that configured no logger logs to ``<root>/<task>-<init>-seed<seed>/version_N``."""
        if logger is None or logger is True:  # Lightning's default: a TensorBoardLogger in default_root_dir
            return _default_logger(root, self.model, self._seed())
        return logger

    def _seed(self) -> Any:
        config = self.config[self.subcommand] if self.subcommand else self.config  # run=False: no subcommand
        return config.get("seed_everything")

    def _loggers(self, logger: Any, root: str | None) -> list[Logger]:
        """The run's loggers: its ScalarsLogger first (Lightning's ``trainer.log_dir`` and checkpoint directory are
        the first logger's: the run directory), then the configured ones, a TensorBoardLogger in the run directory
        when none is configured, none for ``logger: false``."""
        default = logger is None or logger is True
        configured = [] if default or logger is False else _as_list(logger)
        run = self._scalars_logger(configured, root or os.getcwd())
        if default:
            configured = [_default_logger(run.save_dir, self.model, self._seed(), name=run.name, version=run.version)]
        return [run, *configured]

    def _scalars_logger(self, configured: list[Logger], root: str) -> ScalarsLogger:
        """The run directory's logger. A resumed fit's is its checkpoint's run directory, with the points logged after
        the checkpoint purged; a study's run keeps its fits in ``<root>/lightning_logs/``; a configured
        TensorBoardLogger first among the loggers gives its own directory (it can resume into it); any other run's
        is ``<root>/<task>-<init>-seed<seed>/version_N``."""
        checkpoint = self.checkpoint
        run_dir = checkpoint.run_dir if checkpoint is not None and self.subcommand == "fit" else None
        if run_dir is not None and checkpoint.path.is_file():
            path = run_dir.path
            return ScalarsLogger(save_dir=path.parent.parent, name=path.parent.name, version=path.name,
                                 purge_step=checkpoint.global_step + 1)
        study = StudyRunDir(root).run_record.is_file()
        first = configured[0] if configured else None
        if isinstance(first, TensorBoardLogger) and not study:
            return ScalarsLogger(save_dir=first.save_dir, name=first.name, version=first.version)
        name = StudyRunDir.LOGS if study else run_name(self.model, self._seed())
        logger = ScalarsLogger(save_dir=root, name=name, version=_slurm_version(root, name))
        logger.version  # noqa: B018 - the next free version, fixed now: a default TensorBoardLogger shares it
        return logger

    def _logging_callbacks(self, configured: list[Callback]) -> list[Callback]:
        """The run's HPARAMS session (for its TensorBoard loggers) and, in a fit with no LearningRateMonitor of its own,
        the learning rate per parameter group, ``train/lr/<group>``, every ``log_every_n_steps`` steps."""
        run_dir = self.checkpoint.run_dir if self.checkpoint is not None else None
        resumed = run_dir.path if self.subcommand == "fit" and run_dir is not None else None
        callbacks: list[Callback] = [HparamsSession(resumed_run=resumed)]
        if self.subcommand == "fit" and not any(isinstance(c, LearningRateMonitor) for c in configured):
            callbacks.append(LearningRateMonitor(logging_interval="step"))
        return callbacks

    def before_fit(self) -> None:
        config = self.config[self.subcommand]
        if self.subcommand == "fit":
            _check_optimizer(self.model, config.model.get("optimizer"))
        try:  # ckpt_path: fits the model
            checks.check_ckpt_path(self.checkpoint, self.model, config.get("weights_only"))
        except (checks.CheckpointError, FileNotFoundError) as err:
            _bad_input(str(err))

    before_validate = before_test = before_fit

    def after_fit(self) -> None:
        trainer = self.trainer
        every = trainer.check_val_every_n_epoch
        if (every and every > 1 and trainer.current_epoch % every and trainer.limit_val_batches != 0
                and not trainer.interrupted):
            # The last epoch was not validated (max_epochs is not a multiple of check_val_every_n_epoch):
            # validate the final weights, so the printed and last-logged metrics are the final model's.
            trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        _print_metrics(trainer, "val/", "final validation metrics")

    def after_validate(self) -> None:
        _print_metrics(self.trainer, "val/", "validation metrics")

    def after_test(self) -> None:
        _print_metrics(self.trainer, "test/", "test metrics")

    def after_predict(self) -> None:
        # predict logs nothing (its predictions go to the checkpoint's run directory): the version_N directory
        # Lightning's logger made for it would be an empty run in TensorBoard, with a session of its own.
        logger = self.trainer.logger
        if self.trainer.is_global_zero and logger is not None:
            _remove_if_empty(getattr(logger, "log_dir", None))


def _read_checkpoint(config, subcommand: str) -> Checkpoint | None:
    """The config's ``ckpt_path``, read once and checked against the config before anything is built or written:
    readable, of this config's run (datamodule and task, init, init options, structure and objective), and for a fit
    resumable with the same optimizer. ``last`` becomes the newest run of this config. None: no checkpoint."""
    ckpt_path = config.get("ckpt_path")
    checkpoint = None
    if ckpt_path == "last":
        checkpoint = _resolve_last(config, subcommand)
        config.ckpt_path = ckpt_path = str(checkpoint.path)
    if ckpt_path in ("best", "hpc"):
        _bad_input(f"--ckpt_path {ckpt_path} names a checkpoint of a fit in this same process (Lightning's), "
                   f"which a separate `maskprior {subcommand}` has none of; expected last (the newest run of this "
                   "config under trainer.default_root_dir) or a checkpoint file, e.g. RUN/checkpoints/last.ckpt")
    if ckpt_path is None and subcommand in ("test", "predict"):
        _bad_input(f"{subcommand} needs --ckpt_path, got none; expected the checkpoint of a trained run (e.g. "
                   f"RUN/checkpoints/last.ckpt, or last: the newest under trainer.default_root_dir). Without one "
                   f"it would {subcommand} an untrained model")
    try:
        checkpoint = checks.check_ckpt_path(checkpoint or ckpt_path, None, config.get("weights_only"))
        if checkpoint is None:
            return None
        checks.check_checkpoint_binds(checkpoint, config.get("model"), _datamodule_spec(config.get("data")))
        if subcommand == "fit":
            checks.check_same_optimizer(checkpoint, config.get("model"))
            checks.check_resumable(checkpoint, config.get("trainer"))
    except (checks.CheckpointError, FileNotFoundError) as err:
        _bad_input(str(err))
    return checkpoint


def _check_optimizer(model: MaskPriorModule, spec: Any) -> None:
    """The optimizer's own checks of its options (a negative weight decay, betas outside [0, 1)...), made on a
    stand-in parameter before anything is written, instead of by configure_optimizers once the run has started."""
    try:
        model.optimizer_factory([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    except RuntimeError:
        return  # a device requirement (fused on CUDA only, say) the stand-in cannot meet: the real run decides
    except (ValueError, TypeError) as err:
        name = getattr(spec, "class_path", None) or "the optimizer"
        _bad_input(f"model.optimizer: {name} refuses its options: {err}")


def _first_persistence(callbacks: list[Callback]) -> list[Callback]:
    """The callbacks without a second PriorPersistence: the first measures (a config's own, before the one a study
    appends for configs that have none; two would log the same tags)."""
    first = next((c for c in callbacks if isinstance(c, PriorPersistence)), None)
    return [c for c in callbacks if not isinstance(c, PriorPersistence) or c is first]


def _as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def _remove_if_empty(log_dir: str | None) -> None:
    if log_dir is not None:
        RunDir(log_dir).remove_if_empty()


def run_name(model: Any, seed: Any) -> str:
    """``<task>-<init>-seed<seed>``, e.g. ``2parity-mask-seed0``: the directory under ``default_root_dir`` of a run
    that configured no logger (``-seed<seed>`` only when the run is seeded)."""
    task = str(getattr(getattr(model, "task", None), "name", None) or "run").rsplit("/", 1)[-1]
    parts = [task, str(getattr(model, "init_method", None) or "")]
    if isinstance(seed, int) and not isinstance(seed, bool):
        parts.append(f"seed{seed}")
    return "-".join(re.sub(r"[^A-Za-z0-9._+]+", "_", part) for part in parts if part)


def _default_logger(root: str | None, model: Any, seed: Any, name: str | None = None,
                    version: int | str | None = None) -> TensorBoardLogger:
    """The TensorBoardLogger Lightning would create (``save_dir`` = default_root_dir, the SLURM job id as the
    version under SLURM), named ``run_name`` instead of ``lightning_logs``, with no ``hp_metric`` placeholder.
    A study's run directory keeps ``lightning_logs``: the study already names it ``<task>/<init>/seed<k>``.
    ``name`` and ``version``: the run directory's, when the run's ScalarsLogger has chosen it."""
    root = root or os.getcwd()
    if name is None:
        name = StudyRunDir.LOGS if StudyRunDir(root).run_record.is_file() else run_name(model, seed)
    if version is None:
        version = _slurm_version(root, name)
    return TensorBoardLogger(save_dir=root, name=name, version=version, default_hp_metric=False)


def _slurm_version(root: str, name: str) -> str | int | None:
    """Under SLURM, the job id as the version (Lightning's default); None elsewhere: the next free version."""
    version = SLURMEnvironment.job_id()
    if version is not None:
        # Two fits in one SLURM job (or a second fit after the first finished) must not share a directory; a
        # resumed fit finds its own through --ckpt_path instead (_continue_run_directory).
        job, taken, k = version, Path(root) / name, 1
        while (taken / (version if isinstance(version, str) else f"version_{version}")).exists():
            version, k = f"version_{job}_{k}", k + 1
    return version


def _bad_input(message: str) -> None:
    """Bad input: one line on stderr and exit 2, before anything is written."""
    errors.bad_input(message)


def _underlying_message(err: BaseException) -> str:
    """The message of the error a class raised, without jsonargparse's report around it (its "Does not validate
    against any of the Union subtypes" lists the class's own error as the first item under "Errors:")."""
    text = str(err).strip()
    if text.startswith("Call to compute_fn of link") and ") failed: " in text:  # a linked value's computation
        text = text.rsplit(") failed: ", 1)[1].strip()
    lines = text.splitlines()
    if "Errors:" in lines:
        items = [line.strip()[2:] for line in lines[lines.index("Errors:") + 1 :] if line.strip().startswith("- ")]
        if items:
            return items[0]
    return text


def _resolve_last(config, subcommand: str) -> Checkpoint:
    """``--ckpt_path last``: the newest run's ``last.ckpt`` under ``trainer.default_root_dir`` (the newest intact
    checkpoint beside it if that one is cut short), the same for fit, validate, test and predict; the checkpoint
    as read to compare it with the config."""
    root = Path(config.trainer.get("default_root_dir") or ".")
    lasts = RunDir.lasts(root)
    if not lasts:
        then = "train from scratch (omit --ckpt_path)" if subcommand == "fit" else "train one first"
        _bad_input(f"--ckpt_path last: no {RunDir.LAST} under {root}/*/*/{RunDir.CHECKPOINTS}/; expected a run trained "
                   f"there ({then}) "
                   "or a checkpoint file")
    # Only a run of this config (its task, init and seed): the newest run under the root may be another one.
    others = []
    for last in lasts:
        found, note = RunDir.resolve_last(root, last)
        checkpoint = Checkpoint(found)
        problems = _other_run(checkpoint, config)
        if not problems:
            break
        others.append((last, problems))
    else:
        newest, problems = others[0]
        _bad_input(f"--ckpt_path last: none of the {len(others)} run(s) under {root} is of this config (the newest, "
                   f"{newest.parent.parent}: {problems}); expected a run of this task, init and seed there, or a "
                   "checkpoint file")
    if note:
        print(f"maskprior: {note}", flush=True)
    if subcommand == "fit":
        print(f"resuming from {found}", flush=True)
    return checkpoint


def _other_run(checkpoint: Checkpoint, config) -> str | None:
    """How the run of ``checkpoint`` differs from the one ``config`` describes (binding options, the options that
    shape its weights, seed), or None for the same run."""
    try:
        problems = checks.binding_mismatch(checkpoint.hparams, config.get("model"),
                                           _datamodule_spec(config.get("data")))
        problems += checks.shape_mismatch(checkpoint.hparams, config.get("model"))  # an older run may fit exactly
    except checks.CheckpointError:
        return None  # unreadable: choosing it names the problem
    run_dir = checkpoint.run_dir
    then = run_dir.config().get("seed_everything") if run_dir is not None else None
    now = config.get("seed_everything")
    if isinstance(then, int) and isinstance(now, int) and not isinstance(now, bool) and then != now:
        problems.append(f"seed_everything: checkpoint {then}, config {now}")
    return "; ".join(problems) or None


@rank_zero_only
def rank_zero_print(line: str) -> None:
    """A note on the console from the first process only (the CLI runs once per process under DDP)."""
    print(line, flush=True)


def _note_evaluation_changes(config, checkpoint: Checkpoint | None, subcommand: str) -> None:
    """Evaluating a run that a resume changed: one line naming each option that decides what the evaluation measures
    (precision, the evaluation splits' sizes) whose value here is not the one the run ended with (its config.yaml
    is the run as it started; changes.yaml holds the rest)."""
    run_dir = checkpoint.run_dir if checkpoint is not None else None
    if run_dir is None:
        return
    differ = record.evaluation_changes(run_dir, config.as_dict())
    if differ:
        listed = ", ".join(f"{option} {now!r} (the run ended with {then!r})" for option, (then, now) in differ.items())
        options = " ".join(f"--{option} {then}" for option, (then, _) in differ.items())
        rank_zero_print(f"maskprior: {subcommand} with {listed}: a resume of run {run_dir.path} changed them "
                        f"(changes.yaml); add {options} to measure the run as it ended")


def _use_discovered_structure(model_config, checkpoint: Checkpoint | None) -> None:
    """A run whose structure an estimator found (``discover:<method>``) is resumed, tested or reloaded with the
    structure its checkpoint records, not with what the estimator would find now."""
    if checkpoint is None or not checkpoint.is_read:
        return
    found = checkpoint.hparams.get("discovered_structure")
    if isinstance(found, dict) and model_config is not None:
        model_config.discovered_structure = found


def _without_purge_step(trainer_config) -> None:
    """A resumed fit's config.yaml names its TensorBoard version with a ``purge_step`` (what the killed run logged
    after its checkpoint is hidden). Testing or validating with that config must not purge what the resumed fit
    logged after that step: the purge belongs to the fit alone."""
    logger = trainer_config.get("logger")
    init_args = getattr(logger, "init_args", None)
    if init_args is not None and getattr(logger, "class_path", "").endswith("TensorBoardLogger"):
        if init_args.get("purge_step") is not None:
            init_args.purge_step = None


def _continue_run_directory(config, checkpoint: Checkpoint | None) -> None:
    """Resuming a fit: ``--ckpt_path last`` finds the newest ``last.ckpt``, and the logs continue in its run directory.

    A checkpoint at ``<save_dir>/<name>/<version>/checkpoints/x.ckpt`` makes the TensorBoard logger write
    to that same ``<version>`` directory instead of a new one, with ``purge_step`` just after the checkpoint's
    step: points a killed run logged after its last checkpoint are hidden, so no step appears twice.
    """
    # "last" is resolved already, into ``checkpoint`` (_read_checkpoint)
    run_dir = checkpoint.run_dir if checkpoint is not None else None
    if run_dir is None or not checkpoint.path.is_file():
        return
    version_dir = run_dir.path
    logger = config.trainer.get("logger")
    if logger not in (None, True):
        is_tensorboard = getattr(logger, "class_path", "").endswith("TensorBoardLogger")
        if not is_tensorboard or logger.init_args.get("version") is not None:
            return  # a logger the user chose: leave it alone
    step = checkpoint.global_step
    init_args = {"save_dir": str(version_dir.parent.parent), "name": version_dir.parent.name,
                 "version": version_dir.name}
    if logger in (None, True):
        init_args["default_hp_metric"] = False  # as _default_logger: the run's HPARAMS session is HparamsSession's
    if step:
        # Callbacks log step S's measurement before the checkpoint at step S is saved; Lightning's own
        # training scalars at step S come after it and are logged again, identically, by the resumed run.
        init_args["purge_step"] = int(step) + 1
    config.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=Namespace(
        **{**(logger.init_args.as_dict() if logger not in (None, True) else {}), **init_args}))


_EPILOG = (
    "more commands: `maskprior study -c study/boolean_cpu.yaml` runs a grid of fits and the paper's table "
    "(maskprior study --help); `maskprior tune -c tune/quick.yaml` searches fit options with Optuna, each trial a "
    "fit (maskprior tune --help); `maskprior report DIR` rewrites a study's or a tune's tables and figures from "
    "its directory (maskprior report --help); `maskprior discover -c CONFIG --out FILE` estimates a structure from a "
    "task's training data (maskprior discover --help); `maskprior configs` lists the packaged configs (-c takes "
    "their short names). "
    "`maskprior predict -c CONFIG --ckpt_path RUN/checkpoints/last.ckpt` writes RUN/predictions.csv."
)


def _datamodule_spec(data) -> dict[str, Any] | None:
    if data is None:
        return None
    spec = data.as_dict() if isinstance(data, Namespace) else dict(data)
    return {"class_path": spec.get("class_path"), "init_args": dict(spec.get("init_args") or {})}


def _task_spec(datamodule: L.LightningDataModule):
    if not isinstance(datamodule, MaskPriorDataModule):
        raise TypeError(f"{type(datamodule).__name__} is not a maskprior datamodule; expected a subclass of "
                        "lightning_maskprior.datamodules.MaskPriorDataModule (it says what the task is: task_spec())")
    return datamodule.task_spec()


def _print_metrics(trainer: L.Trainer, prefix: str, title: str) -> None:
    log_dir = trainer.log_dir or trainer.default_root_dir  # a collective call: every rank makes it
    if trainer.global_rank != 0:
        return
    values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
    if not values:
        return
    width = max(len(k) for k in values)
    lines = [f"{k:<{width}}  {v:.6f}" for k, v in sorted(values.items())]
    print(f"\n{title} (run directory: {log_dir})\n" + "\n".join(lines), flush=True)


def main(args: list[str] | None = None) -> None:
    """``maskprior fit / validate / test / predict ...`` (``args`` without the program name; None: ``sys.argv``)."""
    argv = config_files.resolve_argv(sys.argv[1:] if args is None else list(args))  # -c NAME: packaged configs
    try:  # freed tensors stay in the process instead of coming back as fresh pages every step (allocator.py)
        allocator.keep_freed_memory_if_enabled()
    except ValueError as err:
        print(f"maskprior: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    if args is None:
        sys.argv[1:] = argv  # LightningCLI (and DDP's re-launched ranks) read sys.argv
    else:
        args = argv
    try:
        _run_cli(args)
    except Diverged as err:
        print(f"maskprior: {err}", file=sys.stderr, flush=True)
        sys.exit(run_status.EXIT_DIVERGED)
    except SIGTERMException:  # Lightning's own SIGTERM stop (before training started): still "not finished"
        sys.exit(run_status.EXIT_SIGTERM)
    finally:
        # A DDP run leaves its process group (gloo/NCCL threads) alive; tearing it down at
        # interpreter exit instead sometimes aborts the process ("terminate called without an
        # active exception") after a successful fit. Close it here, on every rank.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_cli(args: list[str] | None) -> None:
    # The shared trainer options (configs/trainer/default.yaml) come first; each -c composes over them.
    defaults = {"default_config_files": [str(path) for path in config_files.default_files()]}
    MaskPriorCLI(
        MaskPriorModule,
        L.LightningDataModule,
        subclass_mode_data=True,
        trainer_defaults={"default_root_dir": "runs"},
        parser_kwargs={subcommand: defaults for subcommand in ("fit", "validate", "test", "predict")},
        save_config_callback=record.RunRecord,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
        parser_class=OneLineParser,
    )


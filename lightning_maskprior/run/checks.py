"""Checks of what a run is given (its checkpoint, its options), made before anything trains.

Each error names the file or option, the bad value and what was expected. A checkpoint is read safely, once
(``rundir.Checkpoint``: ``torch.load(weights_only=True)``); config files are checked as the parser reads them
(``config_files.CheckedConfigFiles``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from lightning_maskprior.checkpoints import CheckpointError, check_checkpoint_fits, checkpoint_mismatch
from lightning_maskprior.run.rundir import Checkpoint

__all__ = ["CheckpointError", "checkpoint_mismatch"]  # raised and used by the checks below

# ckpt_path values Lightning resolves itself (not files).
SPECIAL_CKPT_PATHS = ("last", "best", "hpc")


# ----------------------------------------------------------------------------------- checkpoints
def check_ckpt_path(
    ckpt_path: str | Path | Checkpoint | None, model: nn.Module | None = None, weights_only: bool | None = None
) -> Checkpoint | None:
    """Fail before any training if ``ckpt_path`` is unreadable or does not fit ``model``; the checkpoint, or None
    for none or one that Lightning resolves itself.

    ``last``, ``best``, ``hpc`` and ``registry`` paths are Lightning's to resolve. With ``weights_only``
    false (the user's explicit choice to trust the file) nothing is unpickled here: only the zip structure
    is checked; the shapes are then compared in ``MaskPriorModule.on_load_checkpoint``.
    """
    if ckpt_path is None or str(ckpt_path) in SPECIAL_CKPT_PATHS or str(ckpt_path).startswith("registry"):
        return None
    checkpoint = ckpt_path if isinstance(ckpt_path, Checkpoint) else Checkpoint(ckpt_path)
    if weights_only is False:
        checkpoint.check_file()
        return checkpoint
    if model is not None:
        check_checkpoint_fits(checkpoint.contents, model, checkpoint.path)
    else:
        checkpoint.contents  # noqa: B018 - read (and so checked) now
    return checkpoint


# The datamodule options that say where the data is read from, or how it is batched and evaluated: a checkpoint
# may be tested or resumed with others. Every other option defines the task, and must be the checkpoint's.
RUN_ONLY_DATA_OPTIONS = frozenset({"batch_size", "eval_batch_size", "num_workers", "val_size", "test_size",
                                   "num_test_stories", "download", "root", "data_dir", "cache_dir"})
# The model options that decide what was trained (the structure and where it went, and the objective: the loss it
# was trained on and the metrics it is scored by), beside the datamodule.
BINDING_MODEL_OPTIONS = ("init", "init_options", "structure", "objective")


def _plain(value: Any) -> Any:
    """A config value as plain data, for comparison: Namespaces as dicts, None options as {}."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def binding_mismatch(hparams: Mapping[str, Any], model: Mapping[str, Any], data: Mapping[str, Any] | None) -> list[str]:
    """What a checkpoint was trained on that the config does not ask for: ``option: checkpoint X, config Y`` lines.

    ``hparams`` are the checkpoint's hyperparameters; ``model`` and ``data`` the config's ``model`` and ``data``
    entries. The datamodule (its class and every option but ``RUN_ONLY_DATA_OPTIONS``), the init method, its
    options, the structure and the objective must agree; an option the checkpoint does not record is not compared.
    """
    problems = []
    saved = _plain(hparams.get("datamodule")) or {}
    asked = _plain(data) or {}
    if asked.get("class_path") and not saved.get("class_path"):
        # Bound to nothing, it would be scored on any task whose shapes it fits.
        problems.append(f"data: the checkpoint records no datamodule (hyper_parameters.datamodule), the config asks "
                        f"for {asked['class_path']}; expected a checkpoint a fit wrote (a MaskPriorModule built in "
                        "Python records it when given datamodule={class_path, init_args})")
    elif saved.get("class_path") and asked.get("class_path") and saved["class_path"] != asked["class_path"]:
        problems.append(f"data: checkpoint {saved['class_path']}, config {asked['class_path']}")
    elif saved and asked:
        then, now = saved.get("init_args") or {}, asked.get("init_args") or {}
        for key in sorted(then.keys() & now.keys() - RUN_ONLY_DATA_OPTIONS):
            if then[key] != now[key]:
                problems.append(f"data.init_args.{key}: checkpoint {then[key]!r}, config {now[key]!r}")
    model = _plain(model) or {}
    for key in BINDING_MODEL_OPTIONS:
        if key not in hparams:
            continue
        then, now = _plain(hparams.get(key)), model.get(key)
        if key == "init_options":
            then, now = then or {}, now or {}
        if then != now:
            problems.append(f"model.{key}: checkpoint {then!r}, config {now!r}")
    return problems


# The model options that shape the trained weights: a checkpoint fits only a model built with its values.
SHAPE_MODEL_OPTIONS = ("backbone", "parameterisation", "prior_rank")


def shape_mismatch(hparams: Mapping[str, Any], model: Mapping[str, Any]) -> list[str]:
    """``model.<option>: checkpoint X, config Y`` for each option of ``SHAPE_MODEL_OPTIONS`` (leaf by leaf: the
    backbone's ``init_args.dim``...) where the config says another value than the checkpoint's hyperparameters."""
    from lightning_maskprior.run.record import differences, flatten

    model = _plain(model) or {}
    problems = []
    for key in SHAPE_MODEL_OPTIONS:
        if key in hparams and key in model:
            changed = differences(flatten({key: _plain(hparams[key])}), flatten({key: model[key]}))
            problems += [f"model.{option}: checkpoint {a!r}, config {b!r}" for option, (a, b) in changed.items()]
    return problems


def check_checkpoint_binds(checkpoint: Checkpoint, model: Mapping[str, Any], data: Mapping[str, Any] | None) -> None:
    """Raise a CheckpointError naming both sides if the checkpoint was trained on another task, data, init or
    objective."""
    problems = binding_mismatch(checkpoint.hparams, model, data)
    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} belongs to another run than the config describes: {'; '.join(problems)}. "
            "Give the run's own config (-c <run directory>/config.yaml) or a checkpoint of this task and init."
        )


def check_same_optimizer(checkpoint: Checkpoint, model: Mapping[str, Any]) -> None:
    """A resumed fit continues the checkpoint's optimizer state: refuse another optimizer class, naming both (its
    options may change: run/resume.py applies them)."""
    then = _plain(checkpoint.hparams.get("optimizer"))
    now = _plain((_plain(model) or {}).get("optimizer"))
    then = then.get("class_path") if isinstance(then, Mapping) else None
    now = now.get("class_path") if isinstance(now, Mapping) else None
    if then and now and then != now:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was trained with model.optimizer {then}, the config asks for {now}: a "
            "resumed fit continues the checkpoint's optimizer state. Expected the same optimizer class (its options "
            "may change), or a new fit without --ckpt_path"
        )


def check_resumable(checkpoint: Checkpoint, trainer: Mapping[str, Any] | None = None) -> None:
    """A fit resumes a checkpoint's optimizer state and loops: refuse one of weights only, or one that trained more
    epochs than ``trainer.max_epochs`` (Lightning would fail mid-setup, after config.yaml was rewritten); warn that
    one without loop state (epoch and batch progress) cannot resume exactly."""
    contents = checkpoint.contents
    progress = ((contents.get("loops") or {}).get("fit_loop") or {}).get("epoch_progress") or {}
    done = (progress.get("current") or {}).get("completed")
    max_epochs = (trainer or {}).get("max_epochs")
    if _number(done) and _number(max_epochs) and max_epochs >= 0 and done > max_epochs:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} has trained {done} epochs, more than trainer.max_epochs {max_epochs}; "
            f"expected trainer.max_epochs >= {done} to resume it"
        )
    if "optimizer_states" not in contents or "lr_schedulers" not in contents:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} holds the model's weights only (no optimizer state: saved with "
            "save_weights_only?); expected a full checkpoint of a fit (RUN/checkpoints/last.ckpt) to resume from"
        )
    if "loops" not in contents:
        print(f"maskprior: warning: checkpoint {checkpoint.path} holds no loop state (epoch and batch progress): the "
              f"fit resumes at epoch {contents.get('epoch')} from the start of an epoch, not exactly where it stopped",
              file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- a fit's options
def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_fit_options(trainer: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """Refuse, naming the option, a fit that would train nothing or that Lightning would fail on mid-run.

    ``trainer`` and ``model`` are the fit config's entries. Lightning accepts ``max_epochs: 0`` or
    ``limit_train_batches: 0`` (and leaves an empty run) and divides by ``accumulate_grad_batches`` and
    ``check_val_every_n_epoch`` only once training runs.
    """
    rules = [
        ("max_epochs", lambda v: v is None or v == -1 or (_number(v) and v >= 1),
         "a whole number of epochs >= 1 (or -1: no limit)"),
        ("max_steps", lambda v: v is None or v == -1 or (_number(v) and v >= 1), "a number of steps >= 1 (or -1)"),
        ("limit_train_batches", lambda v: v is None or (_number(v) and v > 0), "a fraction in (0, 1] or a count >= 1"),
        ("accumulate_grad_batches", lambda v: v is None or (isinstance(v, int) and v >= 1), "a whole number >= 1"),
        ("check_val_every_n_epoch", lambda v: v is None or (isinstance(v, int) and v >= 1),
         "a whole number of epochs >= 1 (or null: by val_check_interval only)"),
        ("gradient_clip_val", lambda v: v is None or (_number(v) and v >= 0), "a number >= 0 (0 or null: no clipping)"),
    ]
    for key, fits, expected in rules:
        value = trainer.get(key)
        if not fits(value):
            raise ValueError(f"trainer.{key} must be {expected}, got {value!r}: the fit would train nothing or fail")
    optimizer = model.get("optimizer")
    init_args = getattr(optimizer, "init_args", None) or (optimizer.get("init_args") if isinstance(optimizer, Mapping)
                                                          else None) or {}
    lr = init_args.get("lr") if hasattr(init_args, "get") else None
    if lr is not None and not (_number(lr) and lr > 0):
        raise ValueError(f"model.optimizer.init_args.lr must be a number > 0, got {lr!r}: the fit would train "
                         "nothing")


# ------------------------------------------------------------------------------------------- loggers
def check_logger_stores(logger: Any) -> None:
    """Refuse, naming it, an MLFlowLogger whose tracking store MLflow cannot open (a ``sqlite:///`` file in a place
    that cannot hold one, a scheme MLflow does not know, a server it cannot reach), before anything is written; the
    logger itself would fail only once the run logs. ``logger`` is the config's ``trainer.logger`` (one class
    config or a list of them)."""
    for entry in logger if isinstance(logger, list | tuple) else [logger]:
        class_path = getattr(entry, "class_path", None) or (entry.get("class_path") if isinstance(entry, Mapping)
                                                             else None)
        if not isinstance(class_path, str) or not _is_mlflow_logger(class_path):
            continue
        init_args = getattr(entry, "init_args", None) or {}
        # What MLFlowLogger opens: its tracking_uri (whose default the parser filled in from MLFLOW_TRACKING_URI),
        # else a file store under its save_dir.
        uri = init_args.get("tracking_uri") if "tracking_uri" in init_args else os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = f"file:{init_args.get('save_dir') or './mlruns'}"
        try:
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as err:  # noqa: BLE001 - whatever the store raised, it cannot be used
            reason = _first_sentences(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            raise ValueError(f"trainer.logger: {class_path.rsplit('.', 1)[-1]} cannot open its tracking_uri {uri!r} "
                             f"({reason}); expected a tracking store MLflow can open, e.g. sqlite:///mlflow.db (a "
                             "database file, made if missing) or http://HOST:5000 (a tracking server)") from None


def _is_mlflow_logger(class_path: str) -> bool:
    from lightning.pytorch.loggers import MLFlowLogger

    module, _, name = class_path.rpartition(".")
    try:

        cls = getattr(importlib.import_module(module), name)
        return isinstance(cls, type) and issubclass(cls, MLFlowLogger)
    except Exception:  # noqa: BLE001 - not importable: the parser names it
        return False


def _first_sentences(text: str, limit: int = 240) -> str:
    """``text`` up to the last full sentence within ``limit`` characters (a library's message can run to a page)."""
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[: end + 1] if end > 0 else text[:limit] + "..."

"""Reopen a finished run: ``load_run(run_dir)`` returns the trained module and its datamodule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_maskprior.checkpoints import CheckpointError
from lightning_maskprior.module import MaskPriorModule, build_datamodule
from lightning_maskprior.run.checks import binding_mismatch, shape_mismatch
from lightning_maskprior.run.precision import FALLBACK
from lightning_maskprior.run.rundir import Checkpoint, RunDir, find_checkpoint


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, map_location: Any = "cpu"):
    """``(module, datamodule)`` of a finished run, the module in eval mode and the datamodule set up to validate.

    Args:
        run_dir: A run directory (``runs/2parity-mask-seed0/version_N``, or a study run's directory holding one).
        checkpoint: Which checkpoint (default: ``last.ckpt``, else the newest one).
        map_location: Where the weights go (default: the CPU).

    The datamodule is built from the run's record (``config.yaml`` with the segments a resume appended; the
    checkpoint's copy of it when there is none); a
    config.yaml that describes another run than the checkpoint's (an edited task, init, width, parameterisation or
    rank) raises a CheckpointError naming both values, as the CLI refuses such a pair. The module is the
    checkpoint's: the structure it trained with (not what its estimator or builder would give now), its objective. A run
    fine-tuned from a pretrained file (``backbone.init_args.checkpoint_path``) reopens without that file: the
    trained weights are in the checkpoint.
    """
    ckpt = Path(checkpoint) if checkpoint is not None else find_checkpoint(run_dir)
    owner = RunDir.of_checkpoint(ckpt)
    if owner is not None and owner.data_spec() is not None:
        # The datamodule comes from config.yaml, the model from the checkpoint: the CLI's binding check, so an
        # edited config.yaml never pairs the old model with another task.
        config = owner.config()
        hparams = Checkpoint(ckpt).hparams
        problems = [*binding_mismatch(hparams, config.get("model") or {}, owner.data_spec()),
                    *shape_mismatch(hparams, config.get("model") or {})]
        if problems:
            raise CheckpointError(f"{owner.config_path} does not describe the run of checkpoint {ckpt}: "
                                  f"{'; '.join(problems)}. Expected the config.yaml its fit wrote (restore it), or "
                                  "checkpoint= of a run of this config")
    module = MaskPriorModule.load_from_checkpoint(ckpt, map_location=map_location, **_without_pretrained(ckpt))
    module.eval()
    spec = (owner.data_spec() if owner is not None else None) or module.hparams.get("datamodule")
    datamodule = build_datamodule(spec)
    datamodule.setup("validate")
    return module, datamodule


def run_precision(run_dir: str | Path, checkpoint: str | Path | None = None) -> str:
    """The precision a run trained and validated in (its ``config.yaml``'s ``trainer.precision``), e.g.
    ``bf16-mixed``: give it to the Trainer that re-validates a reopened run, and the metrics come out as logged."""
    ckpt = Path(checkpoint) if checkpoint is not None else find_checkpoint(run_dir)
    owner = RunDir.of_checkpoint(ckpt)
    return owner.precision() if owner is not None else FALLBACK


def _without_pretrained(ckpt: Path) -> dict[str, Any]:
    """``backbone`` with its ``checkpoint_path`` cleared when the run started from a pretrained file (the weights
    come from ``ckpt``); no override otherwise."""
    backbone = Checkpoint(ckpt).hparams.get("backbone")
    init_args = backbone.get("init_args") if isinstance(backbone, dict) else None
    if not isinstance(init_args, dict) or not init_args.get("checkpoint_path"):
        return {}
    return {"backbone": {**backbone, "init_args": {**init_args, "checkpoint_path": None}}}

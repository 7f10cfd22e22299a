"""Reopen a finished run: ``load_run(run_dir)`` returns the trained module and its datamodule."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import yaml

LAST = "last.ckpt"  # what every fit keeps in <run directory>/checkpoints/


def newest_last_checkpoint(root: str | Path) -> Path | None:
    """The newest ``<root>/<name>/<version>/checkpoints/last.ckpt`` (``<name>``: e.g. ``2parity-mask-seed0``), or None.

    What ``--ckpt_path last`` resumes, and what a study's cell resumes an interrupted run from.
    """
    found = sorted(Path(root).glob(f"*/*/checkpoints/{LAST}"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def is_intact(path: str | Path) -> bool:
    """Whether a checkpoint file is complete: torch.save writes a zip archive, whose directory is at its end."""
    path = Path(path)
    return path.is_file() and path.stat().st_size > 0 and zipfile.is_zipfile(path)


def resolve_last(root: str | Path) -> tuple[Path | None, str | None]:
    """What ``--ckpt_path last`` means under ``root``: the newest run's ``last.ckpt``, or, when that file is not
    intact, the newest intact checkpoint beside it. Returns the path (None: no checkpoint at all) and a line
    saying what was chosen instead, if anything was."""
    last = newest_last_checkpoint(root)
    if last is None:
        return None, None
    if is_intact(last):
        return last, None
    others = sorted((p for p in last.parent.glob("*.ckpt") if p != last and is_intact(p)),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    if not others:
        return last, None  # reading it names the problem
    return others[0], f"{last} is not a complete checkpoint (truncated?); using the newest intact one, {others[0]}"


def find_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint of a run: ``checkpoints/last.ckpt``, else the newest ``.ckpt`` (newest run directory first)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return run_dir
    dirs = [run_dir / "checkpoints"] if (run_dir / "checkpoints").is_dir() else sorted(
        run_dir.rglob("checkpoints"), key=lambda p: p.stat().st_mtime, reverse=True)
    for directory in dirs:
        if (directory / LAST).is_file():
            return directory / LAST
        found = sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no checkpoint under {run_dir} (looked for checkpoints/{LAST} and */checkpoints/*.ckpt)")


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, map_location: Any = "cpu"):
    """``(module, datamodule)`` of a finished run, the module in eval mode and the datamodule set up to validate.

    Args:
        run_dir: A run directory (``runs/2parity-mask-seed0/version_N``, or a study run's directory holding one).
        checkpoint: Which checkpoint (default: ``last.ckpt``, else the newest one).
        map_location: Where the weights go (default: the CPU).

    The datamodule is built from the run's ``config.yaml`` (the checkpoint's copy of it when there is none).
    """
    from lightning_maskprior.module import MaskPriorModule, build_datamodule

    ckpt = Path(checkpoint) if checkpoint is not None else find_checkpoint(run_dir)
    module = MaskPriorModule.load_from_checkpoint(ckpt, map_location=map_location)
    module.eval()
    spec = module.hparams.get("datamodule")
    config = ckpt.parent.parent / "config.yaml"
    if config.is_file():
        data = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("data")
        if isinstance(data, dict) and data.get("class_path"):
            spec = data
    datamodule = build_datamodule(spec)
    datamodule.setup("validate")
    return module, datamodule


def run_precision(run_dir: str | Path, checkpoint: str | Path | None = None) -> str:
    """The precision a run trained and validated in (its ``config.yaml``'s ``trainer.precision``), e.g.
    ``bf16-mixed``: give it to the Trainer that re-validates a reopened run, and the metrics come out as logged."""
    ckpt = Path(checkpoint) if checkpoint is not None else find_checkpoint(run_dir)
    config = ckpt.parent.parent / "config.yaml"
    trainer = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("trainer") if config.is_file() else None
    return str((trainer or {}).get("precision") or "32-true")

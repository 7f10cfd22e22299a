"""``ScalarsLogger``: the Lightning logger that keeps a run's scalars file (``run/scalars.py`` reads it back). The
``maskprior`` CLI adds one first among every run's loggers, whatever the user configured."""

from __future__ import annotations

import csv
import io
import math
import os
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_maskprior.run import atomic
from lightning_maskprior.run.scalars import HEADER, SCALARS


class ScalarsLogger(CSVLogger):
    """Every scalar a run logs, appended to ``<save_dir>/<name>/<version>/scalars.csv`` as it is logged.

    The file is long (one ``step,tag,value`` row per point), so a metric that appears late (the first validation, a
    test) adds rows, never a column: nothing already written is rewritten, except once when a resumed fit starts
    (``purge_step``). It is Lightning's ``CSVLogger`` in every other respect (its directory and version, and
    ``hparams.yaml``), so the Trainer treats it as one: with it first among the loggers, ``trainer.log_dir`` is its
    directory and a ModelCheckpoint without a ``dirpath`` saves under ``<its directory>/checkpoints``.
    (Lightning's own CSV writer keeps one column per metric, rewrites its file whenever a new metric appears, and
    deletes ``metrics.csv`` from a directory that holds anything else, as a resumed run's directory does.)

    Args:
        save_dir: Directory under which the run's directory is made (``trainer.default_root_dir``).
        name: The run's name: its directory is ``<save_dir>/<name>/<version>``.
        version: ``version_<N>`` for a number, the directory's name for a string; None: the next free number.
        purge_step: A resumed fit's first step: points at this step or later that the file already holds (logged by
            the killed run after its last checkpoint) are dropped before the first new one is written, as
            TensorBoard's ``purge_step`` hides them.
    """

    def __init__(self, save_dir: str | Path, name: str | None = "lightning_logs", version: int | str | None = None,
                 purge_step: int | None = None) -> None:
        super().__init__(save_dir=save_dir, name=name, version=version)
        self.purge_step = purge_step
        self.hparams: dict[str, Any] = {}
        self._file: io.TextIOBase | None = None
        self._writer: Any = None
        self._calls = 0
        self._purged = False  # the purge is done once: a validation after the fit reopens the file to append

    @property
    def path(self) -> Path:
        """The scalars file: ``<log_dir>/scalars.csv``."""
        return Path(self.log_dir) / SCALARS

    @property
    def experiment(self) -> ScalarsLogger:
        """The logger itself (it writes its file directly)."""
        return self

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace | None = None, *args: Any, **kwargs: Any) -> None:
        """Keep the hyperparameters in ``<log_dir>/hparams.yaml``, written once per run directory as
        TensorBoardLogger writes it: a later call (the validation after a fit, a resumed fit) leaves the file, and
        with it what the module added (``discovered_structure``)."""
        if isinstance(params, Namespace):
            params = vars(params)
        self.hparams.update(params or {})
        path = Path(self.log_dir) / "hparams.yaml"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            save_hparams_to_yaml(path, self.hparams)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Append one row per scalar, flushed at once: a run killed after its next checkpoint has lost none."""
        if step is None:
            step = self._calls
        self._calls += 1
        rows = [(int(step), tag, repr(value)) for tag, value in _flat_scalars(metrics)]
        if not rows:
            return
        if self._writer is None:
            self._open()
        self._writer.writerows(rows)
        self._file.flush()

    @rank_zero_only
    def save(self) -> None:
        if self._file is not None:
            self._file.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None

    def _open(self) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        prepare_for_append(path, None if self._purged else self.purge_step)
        self._purged = True
        self._file = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - closed in finalize
        self._writer = csv.writer(self._file, lineterminator="\n")
        if self._file.tell() == 0:
            self._writer.writerow(HEADER)


def _flat_scalars(metrics: Mapping[str, Any], prefix: str = ""):
    """``(tag, float)`` for every number in ``metrics`` (nested mappings become ``outer/inner``; tensors their
    value); anything that is not one number is left out."""
    for key, value in metrics.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flat_scalars(value, f"{tag}/")
            continue
        if hasattr(value, "numel"):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, bool | int | float):
            yield tag, float(value)


def prepare_for_append(path: Path, purge_step: int | None) -> None:
    """Make a scalars file ready to append to: without its rows at ``purge_step`` or later (when given), and without
    a last row a killed process left half written (a row appended to it would be garbled). Rewritten, atomically,
    only when there is one of those to drop."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        complete = f.read(1) == b"\n"
    if complete and purge_step is None:
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    kept = lines[:1] + [line for line in lines[1:] if purge_step is None or _step(line) < purge_step]
    if len(kept) < len(lines) or not complete:
        atomic.write_text(path, "".join(kept))


def _step(line: str) -> float:
    try:
        return int(line.split(",", 1)[0])
    except ValueError:
        return math.inf  # not a row: dropped with the purged ones

"""PredictionWriter: ``maskprior predict`` writes one CSV row per example to the run directory."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from lightning_maskprior.run.rundir import RunDir


class PredictionWriter(BasePredictionWriter):
    """Write ``predict_step``'s per-example values to ``<run_dir>/predictions.csv``.

    Columns: whatever ``predict_step`` returns (``prediction``, ``target``, and for Boolean tasks ``label``,
    ``unseen`` and ``mdi``). A value with several entries per example (a sequence of digits or tokens) is
    written space-separated. Under DDP each rank writes ``predictions_rank<r>.csv``.

    Args:
        run_dir: Where to write (default: the trainer's log directory).
        filename: The file's name.
    """

    def __init__(self, run_dir: str | Path | None = None, filename: str = RunDir.PREDICTIONS) -> None:
        super().__init__(write_interval="batch")
        self.run_dir, self.filename = run_dir, filename
        self.path: Path | None = None
        self._file = self._writer = None
        self._columns: list[str] | None = None
        self.rows = 0

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        run_dir = Path(self.run_dir or trainer.log_dir or trainer.default_root_dir)
        name = self.filename
        if trainer.world_size > 1:
            name = f"{Path(name).stem}_rank{trainer.global_rank}{Path(name).suffix}"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / name
        self._file = self.path.open("w", newline="", encoding="utf-8")
        self._writer, self._columns, self.rows = csv.writer(self._file), None, 0

    def write_on_batch_end(self, trainer, pl_module, prediction: Any, batch_indices, batch, batch_idx: int,
                           dataloader_idx: int) -> None:
        if self._writer is None or not isinstance(prediction, dict):
            return
        if self._columns is None:
            self._columns = list(prediction)
            self._writer.writerow(self._columns)
        columns = [_cells(prediction[k]) for k in self._columns]
        for row in zip(*columns, strict=True):
            self._writer.writerow(row)
        self.rows += len(columns[0]) if columns else 0

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
            print(f"wrote {self.rows} predictions to {self.path}", flush=True)


def _cells(value: Tensor) -> list:
    value = value.detach().cpu()
    if value.dtype.is_floating_point:
        value = value.float()
    elif value.dtype == torch.bool:
        value = value.int()
    if value.dim() == 1:
        return value.tolist()
    return [" ".join(str(v) for v in row.flatten().tolist()) for row in value]

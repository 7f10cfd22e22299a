"""Shared fixtures: a tiny Boolean task and model that train in seconds on a CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

torch.set_num_threads(min(2, os.cpu_count() or 1))



def denormals(t: torch.Tensor) -> int:
    """How many entries of ``t`` are denormal float32 numbers (non-zero, below the smallest normal one)."""
    t = t.detach().float().abs()
    return int(((t > 0) & (t < torch.finfo(torch.float32).tiny)).sum())


# A Boolean config shrunk to a seconds-long run: n = 6 (64 points), a width-16, 2-layer model.
TINY_BOOLEAN = [
    "--data.init_args.n", "6", "--data.init_args.eval_batch_size", "64",
    "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "2",
    "--model.backbone.init_args.head_dim", "8", "--model.backbone.init_args.mlp_dim", "32",
]  # fmt: skip


@pytest.fixture
def tiny_args(tmp_path) -> list[str]:
    """CLI overrides that shrink a Boolean config to a seconds-long run."""
    return [
        *TINY_BOOLEAN,
        "--trainer.max_epochs", "2",
        "--trainer.check_val_every_n_epoch", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path / "runs"),
    ]

"""The ``maskprior`` command: LightningCLI (fit / validate / test) over MaskPriorModule.

    maskprior fit -c configs/boolean/2parity.yaml -c configs/init/mask.yaml
    maskprior fit --help
    maskprior study -c configs/study/boolean_cpu.yaml   (a grid of runs and the paper's table; see study.py)
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

from lightning_maskprior.module import MaskPriorModule


class MaskPriorCLI(LightningCLI):
    """LightningCLI with the datamodule's TaskSpec linked into the model."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data", "model.task", apply_on="instantiate", compute_fn=_task_spec)

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


def _task_spec(datamodule: L.LightningDataModule):
    if not hasattr(datamodule, "task_spec"):
        raise TypeError(f"{type(datamodule).__name__} has no task_spec(); it is not a maskprior datamodule")
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
    """Entry point of the ``maskprior`` console script."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["study"]:  # not a LightningCLI subcommand: a grid of fit/test runs
        from lightning_maskprior.study import main as study_main

        return study_main(argv[1:])
    try:
        MaskPriorCLI(
            MaskPriorModule,
            L.LightningDataModule,
            subclass_mode_data=True,
            trainer_defaults={"default_root_dir": "runs"},
            save_config_kwargs={"overwrite": True},
            args=args,
            auto_configure_optimizers=False,
        )
    finally:
        # A DDP run leaves its process group (gloo/NCCL threads) alive; tearing it down at
        # interpreter exit instead sometimes aborts the process ("terminate called without an
        # active exception") after a successful fit. Close it here, on every rank.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

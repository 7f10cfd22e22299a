"""Where a whole run's time goes, against its training steps alone: start-up, training batches, validation, the rest.

    python benchmarks/run_overhead.py                                   # Boolean and addition paper configs, 2 epochs
    python benchmarks/run_overhead.py --config boolean/paper/2parity.yaml --epochs 5
    python benchmarks/run_overhead.py --config arithmetic/paper/addition.yaml -- --data.init_args.val_size 5000

For each config it measures, in this process and one after the other:

1. **the whole fit** as ``maskprior fit`` builds it (the config's callbacks, validation cadence, TensorBoard logger,
   checkpoints), for ``--epochs`` epochs with the mask init: its wall time from building the model to the end of
   ``Trainer.fit``, split by a timing callback into start-up (until the first training batch), training batches,
   validation and the rest (callbacks between batches, logging, checkpoints);
2. **the training steps alone**: the same model, data, optimizer and precision, in a plain loop over the same
   number of batches (forward, loss, backward, optimizer step), nothing else.

It prints both, their ratio, and the ratio extrapolated to the config's own ``max_epochs`` (start-up once, every
epoch's share as measured). The final test over the held-out set is not part of either: its numbers are what a run
reports, and it is the same whatever the cadence. Target: a paper-scale Boolean and a paper-scale arithmetic run
within 1.5x of their training steps alone.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import config_files
from lightning_maskprior.run.cli import MaskPriorCLI

DEFAULT_CONFIGS = ("boolean/paper/2parity.yaml", "arithmetic/paper/addition.yaml")


class Clock(Callback):
    """Wall time of the phases of a fit: start-up (until the first training batch), training batches, validation."""

    def __init__(self, start: float) -> None:
        self.start, self.first_batch = start, None
        self.train = self.validation = 0.0
        self._batch = self._val = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.first_batch is None:
            self.first_batch = now
        self._batch = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train += time.perf_counter() - self._batch

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validation += time.perf_counter() - self._val


def build(config: str, epochs: int, extra: list[str], root: str) -> MaskPriorCLI:
    args = ["-c", config, "-c", "init/mask.yaml", "--trainer.max_epochs", str(epochs),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.default_root_dir", root, *extra]
    args = config_files.resolve_argv(["fit", *args])[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MaskPriorCLI(MaskPriorModule, L.LightningDataModule, subclass_mode_data=True, run=False, args=args,
                            auto_configure_optimizers=False, save_config_callback=None)


def whole_fit(config: str, epochs: int, extra: list[str]) -> tuple[float, Clock, int, int]:
    """Seconds of the whole fit, its clock, the optimizer steps it took and the config's own max_epochs."""
    with tempfile.TemporaryDirectory(prefix="run_overhead_") as root:
        start = time.perf_counter()
        cli = build(config, epochs, extra, root)
        clock = Clock(start)
        cli.trainer.callbacks.append(clock)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        seconds = time.perf_counter() - start
        steps = cli.trainer.global_step
    full = build_epochs(config, extra)
    return seconds, clock, steps, full


def build_epochs(config: str, extra: list[str]) -> int:
    """The config's own max_epochs (what the full run trains)."""
    import yaml

    path = config_files.resolve(config)
    epochs = (yaml.safe_load(path.read_text()) or {}).get("trainer", {}).get("max_epochs")
    for i, arg in enumerate(extra):
        if arg == "--trainer.max_epochs" and i + 1 < len(extra):
            epochs = int(extra[i + 1])
    return int(epochs or 1)


def steps_alone(config: str, epochs: int, extra: list[str], steps: int) -> float:
    """Seconds of ``steps`` training steps of the same model in a plain loop, in the run's precision."""
    with tempfile.TemporaryDirectory(prefix="run_overhead_") as root:
        cli = build(config, epochs, extra, root)
        module, datamodule = cli.model, cli.datamodule
        datamodule.setup("fit")
        configured = module.configure_optimizers()
        # The schedule's LambdaLR is not stepped: its factor needs a trainer, and one multiply per step is nothing.
        optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
        precision = str(cli.trainer.precision)
        dtype = torch.bfloat16 if precision.startswith("bf16") else None
        context = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
        module.train()
        done, start = 0, time.perf_counter()
        while done < steps:
            for batch in datamodule.train_dataloader():
                with context():
                    loss = module.objective.loss(module(batch["inputs"]), batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done += 1
                if done == steps:
                    break
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help="A config (packaged name or path); repeat for several. Default: "
                        + ", ".join(DEFAULT_CONFIGS))
    parser.add_argument("--epochs", type=int, default=2, help="Epochs of each measured fit (default 2).")
    parser.add_argument("extra", nargs="*", help="More maskprior fit options for every config, after --.")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; the mask init; {args.epochs} epoch(s) each")
    for config in args.config or DEFAULT_CONFIGS:
        whole, clock, steps, full = whole_fit(config, args.epochs, args.extra)
        alone = steps_alone(config, args.epochs, args.extra, steps)
        startup = (clock.first_batch or clock.start) - clock.start
        rest = whole - startup - clock.train - clock.validation
        per_epoch = (whole - startup) / args.epochs
        extrapolated = (startup + per_epoch * full) / (alone / args.epochs * full)
        print(f"\n{config}: {steps} optimizer steps")
        print(f"  whole fit         {whole:8.1f} s   start-up {startup:.1f} s, training batches {clock.train:.1f} s, "
              f"validation {clock.validation:.1f} s, the rest {rest:.1f} s")
        print(f"  steps alone       {alone:8.1f} s")
        print(f"  whole / steps     {whole / alone:8.2f}   ({args.epochs} epochs; extrapolated to its {full} epochs: "
              f"{extrapolated:.2f}; target <= 1.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``maskprior discover``: estimate a structure from a task config's training data and write it as YAML.

The estimators live in :mod:`lightning_maskprior.discover`; this is the command around them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L

from lightning_maskprior import discover as estimators
from lightning_maskprior.attention import attention_layers
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import atomic, config_files
from lightning_maskprior.run.cli import MaskPriorCLI

# The estimators' options on the command line: given ones go to the method, which refuses those it does not take.
ESTIMATOR_OPTIONS: dict[str, tuple[type, str]] = {
    "tolerance": (float, "fourier: a coefficient counts above this fraction of the largest one (default 1e-6)."),
    "steps": (int, "attention, learned: optimizer steps of the discovery model on the training split (default 300)."),
    "lr": (float, "attention, learned: its Adam learning rate (default 1e-3)."),
    "z_threshold": (float, "attention, learned: a token is relevant where the robust z-score of its mean score with "
                           "the other tokens exceeds this in some layer and head; every pair of relevant tokens "
                           "opens (default 4)."),
    "probe_size": (int, "attention: training examples the attention is averaged over (default 256)."),
    "sparsity": (float, "learned: weight of the penalty sum sigmoid(M) over every entry (default 1e-3)."),
    "seed": (int, "attention, learned: seed of the discovery model (default 0)."),
}


def main(argv: list[str]) -> None:
    """``maskprior discover``: estimate a structure from a task config's training data and write it as YAML."""
    parser = argparse.ArgumentParser(
        prog="maskprior discover", description=estimators.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", action="append", required=True, metavar="CONFIG",
                        help="A task config (repeatable, as for maskprior fit); its datamodule's training split is "
                        "read. Other --data.* options after it override the config, as for fit.")
    parser.add_argument("--method", default="fourier", help=f"The estimator: one of {sorted(estimators.ESTIMATORS)}.")
    parser.add_argument("--out", type=Path, default=None,
                        help="Write the structure YAML here (default: print it); give it to --model.structure.")
    group = parser.add_argument_group("estimator options (each method takes its own; the default is the method's)")
    for name, (kind, text) in ESTIMATOR_OPTIONS.items():
        group.add_argument(f"--{name}", type=kind, help=text)
    group.add_argument("--run", type=Path, help="attention: read this trained run's model (a run directory, as "
                       "load_run takes) instead of training one; --steps defaults to 0 then.")
    args, overrides = parser.parse_known_args(argv)
    options = {name: getattr(args, name) for name in ESTIMATOR_OPTIONS if getattr(args, name) is not None}
    try:
        datamodule, module = _datamodule(args.config, overrides)
        make_module = module.fresh
        if args.run is not None:
            if args.method != "attention":
                raise ValueError(f"--run is an option of the attention estimator, not of {args.method!r}")
            make_module = _trained(args.run)
            options.setdefault("steps", 0)
        found = estimators.discover(args.method, datamodule, make_module=make_module, **options)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    num_heads = attention_layers(module.backbone)[0].num_heads  # the heads the structure is laid out over
    text = found.to_yaml(num_heads)
    if args.out is None:
        print(text, end="")
        return
    atomic.write_text(args.out, text)
    layout = "shared by every head" if found.heads(num_heads) is None else f"one interaction per head of {num_heads}"
    print(f"{args.out}: {len(found.pairs)} open pair(s), {layout}; {found.summary[-1]}")


def _trained(run: Path):
    """A module factory that gives the trained model of ``run`` (whatever init is asked for)."""
    from lightning_maskprior.run.load import load_run

    module, _ = load_run(run)
    return lambda init: module


def _datamodule(configs: list[str], overrides: list[str]) -> tuple[Any, MaskPriorModule]:
    """The datamodule and model the configs (and overrides) describe, parsed and built as ``maskprior fit`` builds
    them (the model with the default init and no structure: the model-based estimators train fresh copies of it)."""
    argv = config_files.resolve_argv(["fit", *(a for c in configs for a in ("-c", c)), *overrides,
                                      "--model.init", "default",  # a config's own structure options do not carry:
                                      "--model.structure", "{pairs: [], symmetric: true, diagonal: true}",
                                      "--trainer.logger", "false"])[1:]
    with tempfile.TemporaryDirectory(prefix="discover_") as root, warnings.catch_warnings(), _quiet_lightning():
        warnings.simplefilter("ignore")
        cli = MaskPriorCLI(MaskPriorModule, L.LightningDataModule, subclass_mode_data=True, run=False,
                           args=[*argv, "--trainer.default_root_dir", root], auto_configure_optimizers=False,
                           save_config_callback=None)
    return cli.datamodule, cli.model


@contextlib.contextmanager
def _quiet_lightning():
    """Lightning's info lines (seed, accelerator, precision, tips) while the command builds a trainer it never fits
    with: the command's own output is the structure and its one-line summary."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)

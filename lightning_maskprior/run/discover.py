"""``maskprior discover``: estimate a structure from a task config's training data and write it as YAML.

The estimators live in :mod:`lightning_maskprior.discover`; this is the command around them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L

from lightning_maskprior import discover as estimators
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import atomic, config_files
from lightning_maskprior.run.cli import MaskPriorCLI


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
    parser.add_argument("--tolerance", type=float, default=1e-6,
                        help="fourier: a coefficient counts above this fraction of the largest one.")
    args, overrides = parser.parse_known_args(argv)
    try:
        datamodule = _datamodule(args.config, overrides)
        found = estimators.discover(args.method, datamodule, tolerance=args.tolerance)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    text = found.to_yaml()
    if args.out is None:
        print(text, end="")
        return
    atomic.write_text(args.out, text)
    print(f"{args.out}: {len(found.pairs)} open pair(s); {found.summary[-1]}")


def _datamodule(configs: list[str], overrides: list[str]) -> Any:
    """The datamodule the configs (and overrides) describe, parsed and built as ``maskprior fit`` builds it."""
    argv = config_files.resolve_argv(["fit", *(a for c in configs for a in ("-c", c)), *overrides,
                                      "--model.init", "default", "--trainer.logger", "false"])[1:]
    with tempfile.TemporaryDirectory(prefix="discover_") as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = MaskPriorCLI(MaskPriorModule, L.LightningDataModule, subclass_mode_data=True, run=False,
                           args=[*argv, "--trainer.default_root_dir", root], auto_configure_optimizers=False,
                           save_config_callback=None)
    return cli.datamodule

"""Attention on the structure at init: how much of an init's pattern the model's layers show before any training.

    python scripts/init_mass.py -c arithmetic/paper/multiplication.yaml \
        --init qk_opt "{}" --init qk_opt "{pos_scale: 50.0}" --init mask "{}" [--examples 256] [--seed 0]

Builds the model each ``--init NAME OPTIONS`` describes on the configs (as ``maskprior fit`` builds it, nothing
trained), runs one batch of ``--examples`` training examples through it and prints, per layer and as the mean over
layers, the attention mass on the structure's open entries over the queries whose row closes something (a fully
open row has all its mass open whatever the init), as ``scripts/open_mass.py`` reads it from a run's saved maps.
Uniform attention gives those rows' open fraction. The query/key inits fit Wq, Wk to the positional embeddings; this
says whether the fitted pattern survives in what the layers really receive (tokens and positions together).
"""

from __future__ import annotations

import argparse
import warnings

import torch


def build(configs: list[str], init: str, options: str, seed: int, overrides: list[str]):
    """The module and datamodule ``maskprior fit -c ... --model.init init --model.init_options options`` builds."""
    import lightning as L

    from lightning_maskprior.module import MaskPriorModule
    from lightning_maskprior.run import config_files
    from lightning_maskprior.run.cli import MaskPriorCLI

    argv = config_files.resolve_argv(["fit", *(a for c in configs for a in ("-c", c)), *overrides,
                                      "--model.init", init, "--model.init_options", options,
                                      "--seed_everything", str(seed), "--trainer.logger", "false"])[1:]
    cli = MaskPriorCLI(MaskPriorModule, L.LightningDataModule, subclass_mode_data=True, run=False,
                       args=argv, auto_configure_optimizers=False, save_config_callback=None,
                       parser_kwargs={"default_config_files": [str(p) for p in config_files.default_files()]})
    return cli.model, cli.datamodule


def first_inputs(datamodule, examples: int):
    """The model inputs of the first training batch, cut to ``examples``."""
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    inputs = batch["inputs"] if isinstance(batch, dict) else batch[0] if isinstance(batch, list | tuple) else batch
    return inputs[:examples]


def restricted_mass(module, inputs) -> list[float]:
    """Per layer: the mean attention mass on open entries over the (query, head) rows that close something."""
    from lightning_maskprior.inits import attention_probabilities

    module.eval()
    with torch.no_grad():
        probs = attention_probabilities(module.backbone, inputs)
    structure = module.structure.expanded(len(probs), probs[0].shape[1]) > 0  # (layers, heads, N, N)
    masses = []
    for p, open in zip(probs, structure, strict=True):
        rows = ~open.all(-1)  # (heads, N)
        masses.append(float((p * open).sum(-1).mean(0)[rows].mean()))
    return masses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", action="append", required=True, help="fit configs, composed in order")
    parser.add_argument("--init", nargs=2, action="append", required=True, metavar=("NAME", "OPTIONS"),
                        help="an init method and its options as YAML, e.g. qk_opt '{pos_scale: 50.0}'")
    parser.add_argument("--examples", type=int, default=256, help="training examples in the probe batch")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything of each build")
    parser.add_argument("--override", action="append", default=[], help="a further fit option, e.g. --override=--x=1")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    for name, options in args.init:
        module, datamodule = build(args.config, name, options, args.seed, args.override)
        masses = restricted_mass(module, first_inputs(datamodule, args.examples))
        layers = " ".join(f"{m:.3f}" for m in masses)
        print(f"{name} {options}: mean {sum(masses) / len(masses):.3f} | per layer {layers}", flush=True)


if __name__ == "__main__":
    main()

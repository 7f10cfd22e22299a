"""The ``maskprior`` command: one table of subcommands, each handed to the part of the package that runs it.

    maskprior fit -c boolean/2parity.yaml -c init/mask.yaml     (also validate, test, predict: LightningCLI)
    maskprior study -c study/boolean_cpu.yaml                   (a grid of runs and the paper's tables)
    maskprior report runs/study/boolean_cpu                     (a study's tables and figures, regenerated)
    maskprior discover -c boolean/2parity.yaml --out s.yaml     (a structure estimated from the training data)
    maskprior configs                                           (the packaged configs, by short name)

Each command's module is imported only when that command runs, so ``maskprior configs`` starts in a moment and
nothing here is imported back by the modules it dispatches to.
"""

from __future__ import annotations

import importlib
import sys

from lightning_maskprior.run import checks, config_files

# subcommand -> (module, function): the function takes the arguments after the subcommand.
COMMANDS: dict[str, tuple[str, str]] = {
    "study": ("lightning_maskprior.study.cli", "main"),
    "report": ("lightning_maskprior.study.report", "main"),
    "discover": ("lightning_maskprior.run.discover", "main"),
    "configs": ("lightning_maskprior.run.config_files", "main"),
}


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``maskprior`` console script (``args`` without the program name; None: ``sys.argv``)."""
    argv = config_files.resolve_argv(sys.argv[1:] if args is None else list(args))  # -c NAME: packaged configs
    command = argv[0] if argv else None
    if command not in COMMANDS:
        from lightning_maskprior.run import cli

        if args is None:
            sys.argv[1:] = argv  # LightningCLI (and DDP's re-launched ranks) read sys.argv
            return cli.main(None)
        return cli.main(argv)
    if command == "study":
        checks.check_argv(argv)  # the study file (and its -c files): exit 2 naming a file that is not YAML
    module, function = COMMANDS[command]
    return getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    main()

"""The ``maskprior`` command: one table of subcommands, each handed to the part of the package that runs it.

    maskprior fit -c boolean/2parity.yaml -c init/mask.yaml     (also validate, test, predict: LightningCLI)
    maskprior study -c study/boolean_cpu.yaml                   (a grid of runs and the paper's tables)
    maskprior tune -c tune/quick.yaml                           (an Optuna study over runs: trials, best.yaml)
    maskprior report runs/study/boolean_cpu                     (a study's or a tune's tables and figures)
    maskprior discover -c boolean/2parity.yaml --out s.yaml     (a structure estimated from the training data)
    maskprior configs                                           (the packaged configs, by short name)

Each command's module is imported only when that command runs, so ``maskprior configs`` starts in a moment and
nothing here is imported back by the modules it dispatches to.
"""

from __future__ import annotations

import importlib
import os
import sys

from lightning_maskprior.run import config_files

# subcommand -> (module, function): the function takes the arguments after the subcommand.
COMMANDS: dict[str, tuple[str, str]] = {
    "study": ("lightning_maskprior.study.cli", "main"),
    "tune": ("lightning_maskprior.tune.cli", "main"),
    "report": ("lightning_maskprior.report", "main"),
    "discover": ("lightning_maskprior.run.discover", "main"),
    "configs": ("lightning_maskprior.run.config_files", "main"),
}


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``maskprior`` console script (``args`` without the program name; None: ``sys.argv``)."""
    from lightning_maskprior.run.errors import quiet_writer_threads

    quiet_writer_threads()  # a writer thread's OSError is the command's one line, not a thread's traceback first
    try:
        _dispatch(args)
        sys.stdout.flush()  # a reader that went away fails here, inside the handler, not at interpreter exit
    except BrokenPipeError:
        # The output's reader stopped early (`maskprior configs | head -3`): end quietly, as Unix tools do
        # (exit status 128 + SIGPIPE), without a traceback or a second error from flushing at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except OSError as err:
        # A path the machine refuses (no permission, a read-only or full disk, a name too long, a file where a
        # directory is expected...), wherever in fit, study, report or discover: one line naming it, exit 2.
        from lightning_maskprior.run.errors import bad_input, describe_os_error

        bad_input(describe_os_error(err))


def _dispatch(args: list[str] | None) -> None:
    argv = config_files.resolve_argv(sys.argv[1:] if args is None else list(args))  # -c NAME: packaged configs
    command = argv[0] if argv else None
    if command not in COMMANDS:
        from lightning_maskprior.run import cli

        if args is None:
            sys.argv[1:] = argv  # LightningCLI (and DDP's re-launched ranks) read sys.argv
            return cli.main(None)
        return cli.main(argv)
    module, function = COMMANDS[command]
    return getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    main()

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
from lightning_maskprior.plugins import is_import_path
from lightning_maskprior.run import atomic, config_files
from lightning_maskprior.run.cli import MaskPriorCLI, OneLineParser


def estimator_option_names(*others: str) -> dict[str, list[str]]:
    """Each option name any estimator declares (the registered ones and ``others``, e.g. one named by import path),
    with the estimators that take it."""
    names: dict[str, list[str]] = {}
    for method in [*sorted(estimators.ESTIMATORS), *others]:
        for name in estimators.estimator_options(method):
            names.setdefault(name, []).append(method)
    return names


def _options_help() -> str:
    """Every estimator's options, as its declaration (signature and docstring) gives them."""
    parts = ["estimator options (each method takes its own; given here as --NAME VALUE, in YAML as "
             "--model.structure '{discover: METHOD, options: {NAME: VALUE}}'):"]
    for method in sorted(estimators.ESTIMATORS):
        text = estimators.options_parser(method, prog=f"--method {method}").format_help()
        body = text.split("options:", 1)[-1].splitlines()
        body = [line for line in body if line.strip() and "-h, --help" not in line and "Show this help" not in line]
        parts += ["", f"--method {method}:", *body]
    return "\n".join(parts)


def _split_options(argv: list[str], names: dict[str, list[str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """``argv`` without the estimator options (``--NAME VALUE`` or ``--NAME=VALUE``), and those options."""
    rest, given, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in names:
            if inline or "=" in arg:
                given.append((name, inline))
            elif i + 1 < len(argv):
                given.append((name, argv[i + 1]))
                i += 1
            else:
                raise ValueError(f"--{name} needs a value")
        else:
            rest.append(arg)
        i += 1
    return rest, given


def main(argv: list[str]) -> None:
    """``maskprior discover``: estimate a structure from a task config's training data and write it as YAML."""
    parser = argparse.ArgumentParser(
        prog="maskprior discover", description=estimators.__doc__, epilog=_options_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", action="append", required=True, metavar="CONFIG",
                        help="A task config (repeatable, as for maskprior fit); its datamodule's training split is "
                        "read. Other --data.* options after it override the config, as for fit.")
    parser.add_argument("--method", default="fourier", help=f"The estimator: one of {sorted(estimators.ESTIMATORS)}, "
                        "or module.path:function of your own (lightning_maskprior.discover.Estimator).")
    parser.add_argument("--out", type=Path, default=None,
                        help="Write the structure YAML here (default: print it); give it to --model.structure. "
                        "Never one of the -c configs.")
    parser.add_argument("--run", type=Path, help="attention: read this trained run's model (a run directory, as "
                        "load_run takes; a run of the task the configs describe) instead of training one; --steps "
                        "defaults to 0 then.")
    try:
        argv, given = _split_options(list(argv), estimator_option_names(*_plugin_method(argv)))
    except ValueError as err:
        _bad_input(str(err))
    args, overrides = parser.parse_known_args(argv)
    try:
        method = args.method
        estimators.check_estimator_options(method, {})  # an unknown method, before the configs are read
        unknown = sorted({name for name, _ in given} - set(estimators.estimator_options(method)))
        if unknown:
            raise ValueError(f"estimator {method!r} has no option {', '.join(unknown)}; its options: "
                             f"{', '.join(estimators.estimator_options(method))}")
        _check_overrides(overrides, method)
        options = _parsed(method, given)
        configs = [Path(c) for c in config_files.resolve_argv([a for c in args.config for a in ("-c", c)])[1::2]]
        _check_out(args.out, configs, overrides)
        if args.run is not None and method != "attention":
            raise ValueError(f"--run is an option of the attention estimator, not of {method!r}")
        datamodule, module = _datamodule(args.config, overrides)
        make_module = module.fresh
        if args.run is not None:
            make_module = _trained(args.run, module)
            options.setdefault("steps", 0)
        found = estimators.discover(method, datamodule, make_module=make_module, **options)
    except (ValueError, FileNotFoundError) as err:
        _bad_input(str(err))
    num_heads = attention_layers(module.backbone)[0].num_heads  # the heads the structure is laid out over
    text = found.to_yaml(num_heads)
    if args.out is None:
        print(text, end="")
        return
    layout = "shared by every head" if found.heads(num_heads) is None else f"one interaction per head of {num_heads}"
    unidentified = sum(1 for p in found.pairs if found.identifiable.get(p) is False)
    summary = f"; {found.summary[-1]}" if found.summary else ""  # an estimator of yours may give none
    atomic.write_text(args.out, text)
    print(f"{args.out}: {len(found.pairs)} open pair(s) ({unidentified} not identifiable from the data), {layout}"
          f"{summary}")


def _plugin_method(argv: list[str]) -> list[str]:
    """The estimator ``--method`` names by import path, if it does (its options are then read from it), resolved
    now: an error names it."""
    methods = [value for _, option, value, _ in config_files.option_values(list(argv), ("--method",))]
    if methods and methods[-1] not in estimators.ESTIMATORS and is_import_path(methods[-1]):
        return [methods[-1]]
    return []


# The fit options the command passes on to the parser that builds the task and its model (-c configs compose with
# them, as for maskprior fit).
FIT_OPTIONS = ("--data", "--model", "--trainer", "--seed_everything")


def _check_overrides(overrides: list[str], method: str) -> None:
    """Refuse an option the command does not take, naming it and the ones it does (the fit's parser would name it
    with the fit's usage); a fit option's own name and value are the fit parser's to check."""
    for arg in overrides:
        if arg.startswith("-") and not any(arg.partition("=")[0] == option or arg.startswith(f"{option}.")
                                           for option in FIT_OPTIONS):
            ours = ", ".join(f"--{name}" for name in estimators.estimator_options(method)) or "none"
            raise ValueError(f"maskprior discover has no option {arg.partition('=')[0]}; expected -c/--config, "
                             f"--method, --out, --run, an option of estimator {method!r} ({ours}; another method's "
                             "with its --method) or a fit option of the task's datamodule or model "
                             f"({', '.join(f'{o}.*' if o != '--seed_everything' else o for o in FIT_OPTIONS)})")


def _bad_input(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _parsed(method: str, given: list[tuple[str, str]]) -> dict[str, Any]:
    """The estimator options given on the command line, typed and checked by the estimator's declaration."""
    if not given:
        return {}
    try:
        parsed = estimators.options_parser(method).parse_args([a for name, value in given for a in (f"--{name}",
                                                                                                    value)])
    except argparse.ArgumentError as err:
        raise ValueError(f"estimator {method!r}: {estimators._one_line(str(err))}") from None
    return {name: parsed[name] for name, _ in given}


def _check_out(out: Path | None, configs: list[Path], overrides: list[str] = ()) -> None:
    """Refuse to write the structure over a file the command reads: one of its configs, or a file an option names
    (``--data.init_args.X FILE``)."""
    if out is None:
        return
    for config in configs:
        if _same_file(out, config):
            raise ValueError(f"--out {out} is the config given with -c {config}: the structure would replace it; "
                             "give another file")
    named = tuple(arg.partition("=")[0] for arg in overrides if arg.startswith("--"))
    for _, option, value, _ in config_files.option_values(list(overrides), named):
        if value and _same_file(out, Path(value)):
            raise ValueError(f"--out {out} is the file given with {option}: the structure would replace it; give "
                             "another file")


def _same_file(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))


def _trained(run: Path, module: MaskPriorModule):
    """A module factory that gives the trained model of ``run`` (whatever init is asked for), once the run is shown
    to be one of the task the configs describe (its datamodule's options, as a checkpoint's binding checks them)."""
    from lightning_maskprior.run.checks import binding_mismatch
    from lightning_maskprior.run.load import load_run

    trained, _ = load_run(run)
    saved = trained.hparams.get("datamodule")
    if not saved:
        raise ValueError(f"run {run} records no datamodule, so its task cannot be told; expected a run of the task "
                         "the configs describe")
    problems = binding_mismatch({"datamodule": saved}, {}, module.hparams.get("datamodule"))
    if problems:
        raise ValueError(f"run {run} was trained on another task than the configs describe: {'; '.join(problems)}; "
                         f"give a run of this task, or its own config (-c {run}/config.yaml)")
    return lambda init: trained


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
                           save_config_callback=None,  # the configs compose over the CLI's defaults, as in a fit
                           parser_class=OneLineParser,  # an unknown option: one line, not the fit's whole usage
                           parser_kwargs={"default_config_files": [str(p) for p in config_files.default_files()],
                                          "prog": "maskprior discover"})
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

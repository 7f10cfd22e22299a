"""The packaged configs (``configs/`` of the repository, installed as ``lightning_maskprior/configs``).

``-c NAME`` resolves from any directory: ``NAME`` itself if that file exists (relative to the current
directory), else ``./configs/NAME``, else the packaged ``NAME`` (a leading ``configs/`` is accepted), so
``maskprior fit -c boolean/2parity.yaml -c init/mask.yaml`` works after a plain ``pip install``, and a local
copy (``maskprior configs copy boolean/2parity.yaml``) wins over the packaged one.

    maskprior configs                            list the packaged configs
    maskprior configs show boolean/2parity.yaml  print one
    maskprior configs copy boolean/2parity.yaml  copy it to ./configs/boolean/2parity.yaml to edit
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CONFIG_OPTIONS = ("-c", "--config")
DEFAULTS = ("trainer/default.yaml",)  # read by fit, validate, test and predict before any -c (default_files)


def packaged_dir() -> Path:
    """Where the packaged configs are: inside the installed package, or ``configs/`` of a clone."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "configs", package.parent / "configs"):
        if candidate.is_dir():
            return candidate
    return package / "configs"


def default_files() -> list[Path]:
    """The configs the CLI applies as defaults, before any ``-c``, to every ``fit``, ``validate``, ``test`` and
    ``predict`` (jsonargparse's ``default_config_files``): the trainer options every run shares, whatever its
    task and accelerator. A task config holds only what differs from them."""
    return [packaged_dir() / name for name in DEFAULTS]


def packaged(name: str | Path) -> Path | None:
    """The packaged config ``name`` (e.g. ``boolean/2parity.yaml`` or ``configs/boolean/2parity.yaml``), or None."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        return None
    if parts[0] == "configs" and len(parts) > 1:
        parts = parts[1:]
    path = packaged_dir().joinpath(*parts)
    return path if path.is_file() else None


def resolve(name: str | Path, base: Path | None = None) -> Path | None:
    """The file ``-c name`` means: ``base/name``, else ``base/configs/name``, else the packaged one; None if none."""
    base = Path.cwd() if base is None else base
    path = Path(name).expanduser()
    for candidate in (path if path.is_absolute() else base / path, base / "configs" / path):
        if candidate.is_file():
            return candidate
    return packaged(name)


def option_values(argv: list[str], options: tuple[str, ...]) -> Iterator[tuple[int, str, str, bool]]:
    """``(index, option, value, inline)`` of each ``--opt value`` / ``--opt=value`` in ``argv`` for ``options``.

    ``index`` is the argument holding the value: the option's own (``inline``, ``--opt=value``) or the next one.
    """
    for index, arg in enumerate(argv):
        option, equals, value = arg.partition("=")
        if option not in options:
            continue
        if equals:
            yield index, option, value, True
        elif index + 1 < len(argv):
            yield index + 1, option, argv[index + 1], False


def resolve_argv(argv: list[str]) -> list[str]:
    """``argv`` with every ``-c`` / ``--config`` value that is not a file here replaced by the packaged config."""
    out = list(argv)
    for index, option, value, inline in option_values(argv, _CONFIG_OPTIONS):
        found = _replacement(value)
        if found is not None:
            out[index] = f"{option}={found}" if inline else found
    return out


def _replacement(value: str) -> str | None:
    if not value or value.lstrip().startswith(("{", "[")) or Path(value).expanduser().is_file():
        return None  # inline YAML or a file that exists here: left as given
    found = resolve(value)
    return None if found is None else str(found)


def check_yaml_file(path: str | Path, what: str = "config") -> Any:
    """The content of YAML file ``path``; a ValueError naming the file, line and problem if it is not a YAML mapping.

    A missing file is left to the parser, which names it.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {err.start}): expected a YAML file") from None
    if not text.strip():
        raise ValueError(f"{what} {path} is empty: expected a mapping of options (key: value); a copy cut short?")
    try:
        content = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = err.problem or err.context or "cannot parse"
        if err.context and err.problem:  # e.g. "while parsing a flow sequence" that a missing ']' left open
            start = err.context_mark
            since = f" that starts at line {start.line + 1}, column {start.column + 1}" if start is not None else ""
            problem += f" ({err.context}{since})"
        raise ValueError(f"{what} {path}: YAML syntax error{where}: {problem}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{what} {path}: YAML syntax error: {err}") from None
    if content is not None and not isinstance(content, dict):
        raise ValueError(
            f"{what} {path} holds a YAML {type(content).__name__}; expected a mapping of options (key: value)"
        )
    return content


class CheckedConfigFiles:
    """A jsonargparse parser whose config files (``-c``) are checked as it reads them: one that is not UTF-8, is
    empty, is not YAML or is not a mapping is one line naming the file (jsonargparse's own report of a YAML error
    does not name it) and exit 2. ``config_file_kind`` names such a file in the message."""

    config_file_kind = "config"

    def parse_path(self, cfg_path: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            check_yaml_file(str(cfg_path), self.config_file_kind)
        except ValueError as err:
            from lightning_maskprior.run.errors import bad_input

            bad_input(str(err))
        return super().parse_path(cfg_path, *args, **kwargs)


def names() -> list[str]:
    """Every packaged config, as the short name ``-c`` takes."""
    root = packaged_dir()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.yaml"))


def main(argv: list[str]) -> None:
    """``maskprior configs``: list, show or copy out the packaged configs."""
    parser = argparse.ArgumentParser(prog="maskprior configs", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action")
    sub.add_parser("list", help="list the packaged configs (the default)")
    show = sub.add_parser("show", help="print a packaged config")
    show.add_argument("name")
    copy = sub.add_parser("copy", help="copy a packaged config out, to edit it")
    copy.add_argument("name")
    copy.add_argument("dest", nargs="?", help="file or folder (default: ./configs/NAME, which then wins over the "
                      "packaged one)")
    copy.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args(argv)
    if args.action in (None, "list"):
        print(f"packaged configs ({packaged_dir()}); use as maskprior fit -c NAME [-c NAME ...]:")
        for name in names():
            print(f"  {name}")
        return
    source = packaged(args.name)
    if source is None:
        parser.exit(2, f"maskprior configs: no packaged config {args.name!r}; `maskprior configs` lists them\n")
    if args.action == "show":
        print(source.read_text(encoding="utf-8"), end="")
        return
    rel = source.relative_to(packaged_dir())
    dest = Path(args.dest) if args.dest else Path("configs") / rel
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        parser.exit(2, f"maskprior configs: {dest} exists; give --force to overwrite it\n")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    print(f"copied {rel} to {dest}")

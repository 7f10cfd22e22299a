"""Errors that are the user's input or machine, not a bug, as one line: what the ``maskprior`` command prints
(``error: ...``) before it exits 2, whatever raised them (jsonargparse's parser, Lightning, the operating system)."""

from __future__ import annotations

import errno
import os
import re
import sys
import threading
from typing import NoReturn

# What each operating-system error asks of the path, by errno.
_OS_EXPECTED = {
    errno.EACCES: "permission to read or write it",
    errno.EPERM: "permission to read or write it",
    errno.EROFS: "a writable filesystem (this one is read-only)",
    errno.ENOSPC: "free space on its disk",
    errno.EDQUOT: "free space within your disk quota",
    errno.ENAMETOOLONG: "a shorter name (at most 255 characters per part of the path)",
    errno.ENOTDIR: "a directory, but a part of the path is a file",
    errno.EISDIR: "a file, but it is a directory",
    errno.ENOENT: "a path that exists",
    errno.EEXIST: "a path that is not taken",
}


def describe_os_error(err: OSError) -> str:
    """``<path>: <what the OS said> (<ERRNO>); expected <what the path needs>`` in one line."""
    named = [p for p in (err.filename, err.filename2) if p is not None] or [_path_written(err)]
    paths = " -> ".join(os.fsdecode(p) if isinstance(p, bytes) else str(p) for p in named if p is not None)
    if _file_not_directory(err):
        # mkdir(exist_ok=True) of a path that is a file: the OS says EEXIST, but the path is not a directory
        return (f"{paths}: Not a directory: it is a file (ENOTDIR; the system said File exists, EEXIST); expected "
                "a directory there, or a path that does not exist yet")
    name = errno.errorcode.get(err.errno or 0)
    what = err.strerror or str(err) or type(err).__name__
    expected = _OS_EXPECTED.get(err.errno or 0)
    line = f"{paths}: {what}" if paths else what
    if name:
        line += f" ({name})"
    return f"{line}; expected {expected}" if expected else line


def _path_written(err: OSError) -> str | bytes | None:
    """The path an OSError that names none arose at: the innermost frame of its traceback with a ``filename`` or
    ``path`` of its own (a full disk found when a file is closed, as TensorBoard's event writer closes each write)."""
    found, tb = None, err.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        for name in ("filename", "path"):
            value = local.get(name)
            if isinstance(value, str | bytes | os.PathLike):
                found = os.fspath(value)
                break
        tb = tb.tb_next
    return found


def _file_not_directory(err: OSError) -> bool:
    """An EEXIST whose path is there and is not a directory: what ``mkdir(exist_ok=True)`` raises for a file."""
    if err.errno != errno.EEXIST or err.filename is None or err.filename2 is not None:
        return False
    try:
        return os.path.lexists(err.filename) and not os.path.isdir(err.filename)
    except (TypeError, ValueError):
        return False


def quiet_writer_threads() -> None:
    """An OSError in TensorBoard's event-writer thread (a read-only or full run directory) is not printed by the
    thread as a traceback: the writer raises it again in the thread that logs, where the command names it in one
    line. Any other thread's exception is printed as Python prints it."""
    default = threading.excepthook
    if getattr(default, "quiets_writer_threads", False):
        return  # installed already (main() called again in one process)

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            return
        default(args)

    hook.quiets_writer_threads = True
    threading.excepthook = hook


def bad_input(message: str) -> NoReturn:
    """Bad input: one line on stderr and exit 2."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def one_line(message: str) -> str:
    """A (possibly multi-line) message as one line: jsonargparse's nested reports as ``key: expected TYPE, got
    VALUE``; anything else with its lines joined."""
    text = str(message).strip()
    if "Parser key" in text:
        condensed = _not_accepted(text) or _parser_message(text)
        if condensed:
            return condensed
    return re.sub(r"\s*\n\s*", " ", text)


_TYPE = re.compile(r"<class '([\w.]+)'>")


def _type_name(text: str) -> str:
    text = _TYPE.sub(lambda m: "null" if m.group(1) == "NoneType" else m.group(1), text.strip())
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", text)
    return f"one of {literal.group(1)}" if literal else text


def _join(items: list[str]) -> str:
    items = list(dict.fromkeys(items))
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _not_accepted(text: str) -> str | None:
    """jsonargparse's ``Parser key "data": ... Problem with given class_path 'pkg.Cls': Option 'nope' is not
    accepted`` as ``data.init_args.nope: pkg.Cls has no option nope; its options: a, b, ...``."""
    key = re.search(r'Parser key "([^"]+)"', text)
    found = re.search(r"Problem with given class_path '([\w.]+)':\s*Option '([^']+)' is not accepted", text)
    callable_ = re.search(r"Option '([^']+)' is not accepted\. Got value: Namespace\(class_path='([\w.]+)'", text)
    if not key or not (found or callable_):
        return None
    class_path, option = found.groups() if found else callable_.groups()[::-1]
    line = f"{key.group(1)}.init_args.{option}: {class_path} has no option {option}"
    try:  # the class is imported already: the parser read its signature
        import importlib
        import inspect

        module, _, name = class_path.rpartition(".")
        parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters.values()
        names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not found:  # a callable class (the backbone): its first argument is given when it is called, not set
            names = names[1:]
    except (ImportError, AttributeError, TypeError, ValueError):
        return line
    return f"{line}; its options: {', '.join(names)}" if names else line


def _parser_message(text: str) -> str | None:
    """jsonargparse's ``Parser key "model.optimizer": ... Parser key "lr": ... Expected a <class 'float'> ... Given
    value: abc`` as ``model.optimizer.init_args.lr: expected float or torch.Tensor, got 'abc'``."""
    keys = list(re.finditer(r'Parser key "([^"]+)"', text))
    if not keys:
        return None
    path = keys[0].group(1)
    for before, key in zip(keys, keys[1:], strict=False):
        between = text[before.end() : key.start()]
        # A key inside a class's own parser (a class_path given, or a callable class) is one of its init_args.
        nested = "class_path" in between or "callable class" in between
        path += f".init_args.{key.group(1)}" if nested else f".{key.group(1)}"
    # The innermost key's own report: its lines, up to the first line indented no deeper than the key's.
    start = text.rfind("\n", 0, keys[-1].start()) + 1
    indent = len(text[start:]) - len(text[start:].lstrip())
    lines = []
    for line in text[keys[-1].end() :].splitlines()[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        lines.append(line.strip())
    section = "\n".join(lines)
    subtypes = re.search(r"Subtypes: \[(.*)\]", section)
    if subtypes:
        expected = [_type_name(t) for t in re.split(r", (?=<class|typing\.|[\w.]+\[|[\w.]+$)", subtypes.group(1))]
    else:
        expected = [_type_name(m.group(1)) for m in re.finditer(r"Expected an? (<class '[\w.]+'>|typing\.[^\n]*?\])"
                                                                r"(?:\.|$| |\n)", section)]
    given = re.search(r"Given value: (.*?)(?:\. Got value: .*)?$", section, re.M) or re.search(
        r"Got value: (.*)$", section, re.M)
    if not expected and not given:
        return None
    line = f"{path}: expected {_join(expected) if expected else 'another value'}"
    return f"{line}, got {given.group(1).strip()!r}" if given else line


class OneLineErrors:
    """A jsonargparse parser whose errors are one line (``error: key: expected TYPE, got VALUE``) and exit 2, instead
    of the usage and jsonargparse's report of every type it tried (mixed into the fit and study parsers; this
    module imports no torch or Lightning, so the study's command starts fast)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active  # where jsonargparse decides to raise instead of exit

        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        print(f"error: {one_line(message)} (`{prog} --help` lists the options)", file=sys.stderr, flush=True)
        raise SystemExit(2)

"""Plug-ins from your own code: an init method, a structure estimator, a structure builder or an objective, named
by a registered name (``mask``, ``fourier``...) or by import path (``my_pkg.inits:my_init``).

    maskprior fit -c boolean/2parity.yaml --model.init my_pkg.inits:my_init
    maskprior fit -c boolean/2parity.yaml -c init/mask.yaml --model.structure discover:my_pkg.estimators:my_estimator
    maskprior fit -c boolean/2parity.yaml -c init/mask.yaml --model.structure my_pkg.structures:ring
    maskprior fit -c boolean/2parity.yaml --model.objective my_pkg.objectives:huber

An import path is ``module.path:attribute`` (as the Boolean datamodule's own ``target`` and ``seen`` take it); the
module is imported from the Python path (``PYTHONPATH``), by every process that needs it: the fit, a study's check
of its inits, each of its runs, ``load_run``. What it names is checked against its contract
(a ``typing.Protocol`` beside its registry: :class:`~lightning_maskprior.inits.InitMethod`,
:class:`~lightning_maskprior.discover.Estimator`, :class:`~lightning_maskprior.priors.StructureBuilder`,
:class:`~lightning_maskprior.objectives.ObjectiveFactory`) when it is resolved, and one that does not satisfy it is
refused with one :class:`PluginError` naming the plug-in and what it lacks.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any


class PluginError(ValueError):
    """A plug-in (an init method, estimator, structure builder, objective or backbone) that cannot be found or does
    not satisfy its contract; the message names it and what it lacks, in one line."""


# the words an error uses for each kind of plug-in
KIND_NAMES = {"init": "init method", "estimator": "discovery method", "structure": "structure builder",
              "objective": "objective"}

# kind -> (module, registry): each registry maps a name to its plug-in, filled by the module's register decorator.
REGISTRIES: dict[str, tuple[str, str]] = {
    "init": ("lightning_maskprior.inits", "INIT_METHODS"),
    "estimator": ("lightning_maskprior.discover", "ESTIMATORS"),
    "structure": ("lightning_maskprior.priors", "STRUCTURE_BUILDERS"),
    "objective": ("lightning_maskprior.objectives", "OBJECTIVES"),
}
# kind -> the check of a plug-in against the contract of its kind, given by the registry's ``registrar``: it checks
# the registered plug-ins when they are registered, and one named by import path when it is resolved.
CHECKS: dict[str, Callable[[str, Any], None]] = {}

__all__ = ["CHECKS", "KIND_NAMES", "PluginError", "PluginFailed", "REGISTRIES", "calling", "import_path",
           "is_import_path", "registrar", "registry", "resolve"]


class PluginFailed(RuntimeError):
    """An exception raised in a user's own plug-in (or while importing its module): not the project's check of a
    value, so it keeps its traceback (chained to this one, which names the plug-in) and the command exits 1."""


def is_import_path(name: str) -> bool:
    """Whether ``name`` is ``module.path:attribute`` rather than a registered name."""
    return ":" in name


def registrar(kind: str, registered: dict[str, Any], what: str,
              check: Callable[[str, Any], None]) -> Callable[[str], Callable[[Any], Any]]:
    """The ``register(name)`` decorator of plug-ins of ``kind``: it checks a function against the contract of its
    kind (``check(name, fn)``, kept in :data:`CHECKS` for those named by import path) and adds it to ``registered``
    under ``name``; a ValueError naming ``what`` and ``name`` where that name is taken."""
    CHECKS[kind] = check

    def register(name: str) -> Callable[[Any], Any]:
        def decorator(fn: Any) -> Any:
            if name in registered:
                raise ValueError(f"{what} {name!r} is already registered")
            CHECKS[kind](name, fn)
            registered[name] = fn
            return fn

        return decorator

    return register


def registry(kind: str) -> dict[str, Any]:
    """The registered plug-ins of ``kind`` (``init``, ``estimator``, ``structure``, ``objective``) by name."""
    if kind not in REGISTRIES:
        raise ValueError(f"unknown kind of plug-in {kind!r}; expected one of {sorted(REGISTRIES)}")
    module, name = REGISTRIES[kind]
    return getattr(importlib.import_module(module), name)


def import_path(path: str, what: str = "plug-in") -> Any:
    """The object ``module.path:attribute`` names (``attribute`` may be dotted: ``Class.method``), imported now; a
    PluginError naming ``what`` and ``path`` where the module cannot be imported or lacks the attribute."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise PluginError(f"{what} {path!r}: an import path must look like 'package.module:attribute'")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if not _names_the_module(err, module_name):
            raise PluginFailed(f"{what} {path!r}: importing module {module_name!r} failed") from err
        raise PluginError(f"{what} {path!r}: module {module_name!r} cannot be imported ({type(err).__name__}: {err}); "
                          "is its directory on the Python path (PYTHONPATH)?") from None
    except Exception as err:  # the module's own code failed while it was imported: the user's traceback
        raise PluginFailed(f"{what} {path!r}: importing module {module_name!r} failed") from err
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise PluginError(f"{what} {path!r}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target


def resolve(kind: str, name: str) -> Any:
    """The plug-in of ``kind`` that ``name`` names: a registered one, or ``module.path:attribute`` imported now and
    checked against the contract of its kind (:data:`CHECKS`)."""
    registered = registry(kind)
    what = KIND_NAMES[kind]
    if not isinstance(name, str) or not name:
        raise PluginError(f"{what}: expected a registered name or module.path:attribute, got {name!r}")
    if name in registered:
        return registered[name]
    if not is_import_path(name):
        raise PluginError(f"unknown {what} {name!r}; expected one of {sorted(registered)}, or module.path:attribute "
                          f"naming one of your own")
    plugin = import_path(name, what)
    CHECKS[kind](name, plugin)
    return plugin


# ----------------------------------------------------------------------- reading a plug-in's signature
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def parameters_of(what: str, name: str, fn: Any, expected: str) -> list[inspect.Parameter]:
    """The parameters of plug-in ``fn``; a PluginError naming ``what`` and ``name`` where it is not a function or has
    no signature, saying the ``expected`` form."""
    if not callable(fn):
        raise PluginError(f"{what} {name!r} is a {type(fn).__name__}, not a function; expected {expected}")
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise PluginError(f"{what} {name!r} has no signature to read; expected {expected}") from None


def leading(params: list[inspect.Parameter], count: int) -> tuple[list[inspect.Parameter], list[inspect.Parameter]]:
    """The first ``count`` positional parameters (fewer where there are not as many), and the others."""
    given = [p for p in params[:count] if p.kind in POSITIONAL]
    if len(given) < count and any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        given = params[:count]
    return given, params[len(given):]


def without_default(params: list[inspect.Parameter]) -> list[str]:
    """The names of the ``params`` a caller must give (no default, not ``*args`` or ``**kwargs``)."""
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def shown(params: list[inspect.Parameter]) -> str:
    """The names of ``params`` as an error shows them."""
    return ", ".join(p.name for p in params) or "nothing"


# ----------------------------------------------------------------------- calling a user's plug-in
def _names_the_module(err: ModuleNotFoundError, module_name: str) -> bool:
    """Whether ``err`` says that ``module_name`` (or a package above it) is missing, not a module it imports."""
    missing = err.name or ""
    return module_name == missing or module_name.startswith(f"{missing}.")


@contextlib.contextmanager
def calling(kind: str, name: Any) -> Iterator[None]:
    """Run code that calls the plug-in ``name`` of ``kind``: an exception raised inside a user's own plug-in (one
    named by import path, raised in its module's code) becomes :class:`PluginFailed` naming it, chained to the
    original so its traceback is shown; the project's own checks of a value stay one-line errors."""
    try:
        yield
    except (PluginError, PluginFailed):
        raise
    except Exception as err:
        if isinstance(name, str) and is_import_path(name) and _raised_in_module(err, name.partition(":")[0]):
            raise PluginFailed(f"{KIND_NAMES[kind]} {name!r} raised {type(err).__name__}: {err}") from err
        raise


def _raised_in_module(err: BaseException, module_name: str) -> bool:
    """Whether a frame of ``err``'s traceback runs code of ``module_name``'s file."""
    module = sys.modules.get(module_name)
    source = getattr(module, "__file__", None)
    tb = err.__traceback__
    while source is not None and tb is not None:
        if tb.tb_frame.f_code.co_filename == source:
            return True
        tb = tb.tb_next
    return False

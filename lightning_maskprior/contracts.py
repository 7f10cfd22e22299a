"""The public contracts of what a user plugs in: a backbone, a task's datamodule, an init method, a structure
estimator, a structure builder and an objective, each a ``typing.Protocol``, and the checks that refuse a plug-in
that does not satisfy its contract with one :class:`PluginError` naming it and what it lacks.

The project reads these and nothing else: :mod:`~lightning_maskprior.module`, :mod:`~lightning_maskprior.inits` and
:mod:`~lightning_maskprior.discover` read a backbone through :class:`PriorBackbone` (and the query/key inits through
:class:`QueryKeyBackbone`), a datamodule through :class:`TaskDataModule` (the ``fourier`` estimator through
:class:`BooleanDataModule`). Plug-ins are named by a registered name or by import path
(:mod:`lightning_maskprior.plugins`).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from lightning_maskprior.discover import Discovery
    from lightning_maskprior.priors import Structure
    from lightning_maskprior.task import Objective, TaskSpec


class PluginError(ValueError):
    """A plug-in (an init method, estimator, structure builder, objective or backbone) that cannot be found or does
    not satisfy its contract; the message names it and what it lacks, in one line."""


# the words an error uses for each kind of plug-in
KIND_NAMES = {"init": "init method", "estimator": "discovery method", "structure": "structure builder",
              "objective": "objective"}


# ------------------------------------------------------------------------------------------------- backbones
@runtime_checkable
class PriorBackbone(Protocol):
    """A backbone: an ``nn.Module`` whose constructor takes the task's ``TaskSpec`` as its first argument and whose
    attention layers carry the prior (:class:`~lightning_maskprior.attention.PriorAttention`, or layers
    ``inject_prior`` made so); ``attention_layers(backbone)`` finds them, in forward order. Subclass
    :class:`~lightning_maskprior.models.Backbone` to make it selectable as ``model.backbone`` on the command line.

    The attributes and methods below are optional hooks, read where present:

    Attributes:
        num_prefix_tokens: Tokens the attention sees before the task's own (a CLS token, register tokens; timm's
            name): the structure is padded by as many rows and columns (``structure_for_sequence``), the query/key
            inits fit the task's tokens only, a ``relative`` prior keeps their rows and columns apart, and the
            model-based estimators read the attention among the task's tokens after them. 0 where absent.
        seq_len: The task's tokens (``TaskSpec.seq_len``), where the backbone takes sequences of tokens.
    """

    num_prefix_tokens: int

    def __call__(self, inputs: Any) -> Tensor:
        """The outputs the task's objective reads, for a batch's ``inputs``."""

    def structure_for_sequence(self, structure: Structure) -> Structure:
        """Map a structure over the task's tokens onto the sequence the attention sees (prefix tokens first, heads as
        the model has them); without it the structure is used as it is."""

    def patch_grid(self) -> tuple[int, int]:
        """(rows, columns) of a vision backbone's patch grid, patches row-major after the prefix tokens: the
        ``impulse`` init's grid, and a ``relative`` prior's 2-D offsets."""


@runtime_checkable
class QueryKeyBackbone(PriorBackbone, Protocol):
    """What the query/key inits (``qk_svd``, ``qk_opt``, ``impulse``, and the ``pos_scale`` option of the others)
    read besides :class:`PriorBackbone`; an init that needs a missing one names it."""

    def positional_embedding(self) -> Tensor:
        """(prefix + task tokens, dim): what each position of the attention's sequence carries apart from its token;
        a CLS row is the CLS token plus its position."""

    def scale_positional_embedding(self, factor: float) -> None:
        """Multiply the learnable positional embedding in place."""

    def attention_norms(self) -> list[nn.Module]:
        """The normalisation right before each prior-carrying attention layer, in their order (pre-norm blocks:
        ``block.norm1``)."""

    def example_inputs(self, batch_size: int, generator: torch.Generator | None = None) -> Any:
        """A batch ``backbone(inputs)`` accepts, drawn from the input distribution (``qk_opt`` with
        ``fit_on: inputs``)."""


def prefix_tokens(backbone: Any) -> int:
    """The backbone's ``num_prefix_tokens`` (0 where it has none); a PluginError naming the backbone where it is not a
    whole number >= 0."""
    value = getattr(backbone, "num_prefix_tokens", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PluginError(f"backbone {type(backbone).__name__}: num_prefix_tokens must be a whole number of tokens "
                          f">= 0 (the CLS and register tokens before the task's), got {value!r}")
    return value


def check_backbone(backbone: Any) -> None:
    """A PluginError naming the backbone and the hook where an optional hook of :class:`PriorBackbone` is there but
    is not what the contract says (a ``num_prefix_tokens`` that is not a count, a hook that is not a method)."""
    prefix_tokens(backbone)
    hooks = ("structure_for_sequence", "patch_grid", "positional_embedding", "scale_positional_embedding",
             "attention_norms", "example_inputs")
    for hook in hooks:
        value = getattr(backbone, hook, None)
        if value is not None and not callable(value):
            raise PluginError(f"backbone {type(backbone).__name__}: {hook} must be a method (see "
                              f"lightning_maskprior.contracts.PriorBackbone), got {type(value).__name__}")


# ------------------------------------------------------------------------------------------------ datamodules
@runtime_checkable
class TaskDataModule(Protocol):
    """A datamodule that says what its task is: subclass
    :class:`~lightning_maskprior.datamodules.MaskPriorDataModule`, which adds the seeded loaders.

    Its batches are dicts: ``batch["inputs"]`` goes to the backbone, the rest (``target``, ...) to the objective.
    The model-based estimators train on ``train_dataloader()``'s batches after ``setup("fit")``.
    """

    def task_spec(self) -> TaskSpec:
        """The task: token count, vocabulary, output width, objective, oracle structure (or None) and init
        defaults (``TaskSpec.init_defaults``: options per init method, registered name or import path)."""

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets of ``stage``, deterministically from the datamodule's seed."""

    def train_dataloader(self) -> Any:
        """The training batches."""


@runtime_checkable
class BooleanDataModule(TaskDataModule, Protocol):
    """A Boolean task, as the ``fourier`` estimator reads it (``BooleanGOTUDataModule`` is one).

    Attributes:
        n: The number of input bits.
        train_set: The training split, after ``setup("fit")``: ``train_set.tensors["inputs"]`` (points, n) of +-1
            and ``train_set.tensors["target"]`` (points,).
    """

    n: int
    train_set: Any

    def seen_region(self) -> Tensor:
        """(2^n,) Boolean: the points of the cube the training data may come from."""


def is_boolean_task(datamodule: Any) -> bool:
    """Whether ``datamodule`` is a :class:`BooleanDataModule` with its number of bits set."""
    return isinstance(datamodule, BooleanDataModule) and callable(datamodule.seen_region) and datamodule.n is not None


def check_task_datamodule(datamodule: Any, who: str) -> None:
    """A PluginError naming the datamodule and the methods of :class:`TaskDataModule` it lacks, for ``who`` (the
    estimator that reads it)."""
    missing = [m for m in ("task_spec", "setup", "train_dataloader") if not callable(getattr(datamodule, m, None))]
    if missing:
        raise PluginError(f"{who} reads a task's datamodule, but {type(datamodule).__name__} has no "
                          f"{', '.join(f'{m}()' for m in missing)} (see lightning_maskprior.contracts.TaskDataModule)")


# ------------------------------------------------------------------------------------------ functions, by kind
class InitMethod(Protocol):
    """Where a structure goes: ``fn(backbone, structure, **options)`` changes the backbone in place.

    ``backbone`` is a :class:`PriorBackbone`; ``structure`` is the task's
    :class:`~lightning_maskprior.priors.Structure` mapped onto the attention's sequence (None where the task has
    none). Every option after them has a default (``model.init_options`` and the task's ``init_defaults`` override
    them), and their annotations give their checks (``PositiveFloat`` and the other constrained types of
    jsonargparse give ranges). Register one with ``register_init(name, uses_structure=...)``, or name it by import
    path (``--model.init my_pkg.inits:my_init``).

    Attributes:
        uses_structure: True where the method places the structure (it then needs one, and gets the task's as it
            is); False or absent where it only measures against it (the structure's heads are then merged where they
            do not fit the model's). ``register_init`` sets it; a function named by import path sets it itself.
    """

    uses_structure: bool

    def __call__(self, backbone: Any, structure: Structure | None, /, **options: Any) -> None: ...


class Estimator(Protocol):
    """Where a structure comes from: ``fn(datamodule, **options) -> Discovery`` reads a
    :class:`TaskDataModule`'s training split (after ``setup("fit")``).

    Its first parameter is named ``datamodule``; one that trains a model also takes ``make_module``
    (``make_module(init)``: a fresh, structure-free ``MaskPriorModule`` of the run). Every other parameter is an
    option with a type and a default, documented in the docstring's ``Args:`` (``maskprior discover --help`` shows
    them). Register one with ``register_estimator(name)``, or name it by import path
    (``--model.structure discover:my_pkg.estimators:my_estimator``, ``maskprior discover --method ...``).
    """

    def __call__(self, datamodule: TaskDataModule, **options: Any) -> Discovery: ...


class StructureBuilder(Protocol):
    """A structure from its token count: ``fn(seq_len, **options) -> Structure`` over the task's ``seq_len`` tokens.

    Named by ``--model.structure NAME`` or ``{builder: NAME, options: {...}}``: a registered builder
    (``register_structure(name)``: ``full``, ``diagonal``, ``cyclic_window``...) or an import path
    (``my_pkg.structures:ring``).
    """

    def __call__(self, seq_len: int, /, **options: Any) -> Structure: ...


class ObjectiveFactory(Protocol):
    """A task's objective replaced: ``fn(task) -> Objective`` (an ``Objective`` subclass whose constructor takes the
    ``TaskSpec``, or a function), named by ``--model.objective`` (a name registered with ``register_objective``, or
    ``my_pkg.objectives:huber``). The :class:`~lightning_maskprior.task.Objective` it returns implements ``loss``,
    ``make_metrics`` and ``update_metrics``."""

    def __call__(self, task: TaskSpec, /) -> Objective: ...


def _signature(what: str, name: str, fn: Any, expected: str) -> list[inspect.Parameter]:
    if not callable(fn):
        raise PluginError(f"{what} {name!r} is a {type(fn).__name__}, not a function; expected {expected}")
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise PluginError(f"{what} {name!r} has no signature to read; expected {expected}") from None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _split(params: list[inspect.Parameter], count: int) -> tuple[list[inspect.Parameter], list[inspect.Parameter]]:
    """The first ``count`` positional parameters (fewer where there are not as many), and the others."""
    given = [p for p in params[:count] if p.kind in _POSITIONAL]
    if len(given) < count and any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        given = params[:count]
    return given, params[len(given):]


def _without_default(params: list[inspect.Parameter]) -> list[str]:
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def _shown(params: list[inspect.Parameter]) -> str:
    return ", ".join(p.name for p in params) or "nothing"


def check_init(name: str, fn: Any) -> None:
    """A PluginError naming init method ``name`` where ``fn`` is not an :class:`InitMethod`."""
    expected = "fn(backbone, structure, **options) (see lightning_maskprior.contracts.InitMethod)"
    params = _signature("init method", name, fn, expected)
    given, options = _split(params, 2)
    if len(given) < 2:
        raise PluginError(f"init method {name!r} takes ({_shown(params)}); expected {expected}: its first two "
                          "parameters receive the backbone and the task's Structure (or None)")
    required = _without_default(options)
    if required:
        raise PluginError(f"init method {name!r}: option(s) {', '.join(required)} have no default; expected a default "
                          "for every option after (backbone, structure) (init_options override them)")
    flag = getattr(fn, "uses_structure", False)
    if not isinstance(flag, bool):
        raise PluginError(f"init method {name!r}: uses_structure must be True or False, got {flag!r}")


def uses_structure(fn: Any) -> bool:
    """Whether init method ``fn`` places the structure (:attr:`InitMethod.uses_structure`)."""
    return bool(getattr(fn, "uses_structure", False))


def check_estimator(name: str, fn: Any) -> None:
    """A PluginError naming estimator ``name`` where ``fn`` is not an :class:`Estimator`."""
    expected = "fn(datamodule, **options) -> Discovery (see lightning_maskprior.contracts.Estimator)"
    params = _signature("estimator", name, fn, expected)
    if not params or params[0].name != "datamodule" or params[0].kind not in _POSITIONAL:
        raise PluginError(f"estimator {name!r} takes ({_shown(params)}); expected {expected}: its first parameter, "
                          "named datamodule, receives the task's datamodule")
    required = _without_default([p for p in params[1:] if p.name != "make_module"])
    if required:
        raise PluginError(f"estimator {name!r}: option(s) {', '.join(required)} have no default; expected a default "
                          "for every option")


def check_structure_builder(name: str, fn: Any) -> None:
    """A PluginError naming structure builder ``name`` where ``fn`` is not a :class:`StructureBuilder`."""
    expected = "fn(seq_len, **options) -> Structure (see lightning_maskprior.contracts.StructureBuilder)"
    params = _signature("structure builder", name, fn, expected)
    given, _ = _split(params, 1)
    if not given:
        raise PluginError(f"structure builder {name!r} takes ({_shown(params)}); expected {expected}: its first "
                          "parameter receives the task's token count")


def check_objective_factory(name: str, fn: Any) -> None:
    """A PluginError naming objective ``name`` where ``fn`` cannot be called with the task alone
    (:class:`ObjectiveFactory`)."""
    expected = "fn(task) -> Objective (see lightning_maskprior.contracts.ObjectiveFactory)"
    params = _signature("objective", name, fn, expected)
    given, others = _split(params, 1)
    if not given or _without_default(others):
        raise PluginError(f"objective {name!r} takes ({_shown(params)}); expected {expected}: called with the task's "
                          "TaskSpec alone")


# kind -> the check of a plug-in named by import path (registered ones are checked when they are registered)
CHECKS = {"init": check_init, "estimator": check_estimator, "structure": check_structure_builder,
          "objective": check_objective_factory}

"""The public contracts of the classes a user plugs in: a backbone and a task's datamodule, each a ``typing.Protocol``,
and the checks that refuse one that does not satisfy its contract with one :class:`PluginError` naming it.

The project reads these and nothing else: :mod:`~lightning_maskprior.module`, :mod:`~lightning_maskprior.inits` and
:mod:`~lightning_maskprior.discover` read a backbone through :class:`PriorBackbone` (and the query/key inits through
:class:`QueryKeyBackbone`), a datamodule through :class:`TaskDataModule` (the ``fourier`` estimator through
:class:`BooleanDataModule`). The contracts of the functions a user plugs in stand beside the registries that check
them (:mod:`lightning_maskprior.plugins`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lightning_maskprior.plugins import PluginError

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from lightning_maskprior.priors import Structure
    from lightning_maskprior.task import TaskSpec

__all__ = ["BooleanDataModule", "PluginError", "PriorBackbone", "QueryKeyBackbone", "TaskDataModule", "check_backbone",
           "check_task_datamodule", "is_boolean_task", "prefix_tokens"]


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

"""Low-data arithmetic: every ordered pair of 3-digit operands, a small seeded fraction to train on.

Digit order (tokens and labels): most significant digit first, as written, unless ``operand_order`` or
``answer_order`` say ``lsd_first``. For a + b with 3-digit operands the input tokens are ``[a2 a1 a0 b2 b1 b0]``
(a = 100 a2 + 10 a1 + a0) and the answer digits are ``[s3 s2 s1 s0]`` (4 for addition, 6 for multiplication,
zero-padded to fixed width).

The paper predicts "the whole answer in one forward pass" from the digit tokens alone; three read-outs are
readings of that sentence:

- pooled (the default): the backbone sees the 6 digits only and predicts every answer digit from one pooled
  vector (``pooling: mean``);
- ``answer_tokens``: the inputs also carry one blank token (id 10) per answer digit, and the backbone reads each
  answer digit at its token (``pooling: tokens``);
- ``operand_readout``: one answer digit read at each operand token itself (``pooling: tokens``); the answer,
  zero-padded to ``answer_width`` digits, occupies the last ``answer_width`` tokens.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_maskprior import priors
from lightning_maskprior.datamodules.base import MaskPriorDataModule
from lightning_maskprior.datamodules.loaders import TensorDictDataset
from lightning_maskprior.objectives import DigitsObjective
from lightning_maskprior.priors import Structure
from lightning_maskprior.task import TaskSpec

OPERATIONS = ("add", "mul")
DigitOrder = Literal["msd_first", "lsd_first"]  # most significant digit first (as written), or least
ORDERS = get_args(DigitOrder)
# The prior's rows at the tokens an answer digit is read at: the operand structure the paper states, or the operand
# digits that answer digit depends on.
ReadoutRows = Literal["operands", "dependencies"]
READOUT_ROWS = get_args(ReadoutRows)
# arXiv 2608.00418, Table 2: 3% of the pairs for multiplication, 0.4% for addition.
PAPER_FRACTIONS = {"add": 0.004, "mul": 0.03}
BLANK = 10  # token id of an answer token: a placeholder the model writes the answer digit into


def to_digits(values: Tensor, width: int) -> Tensor:
    """Integers (B,) to (B, width) digits, most significant first, zero-padded."""
    powers = 10 ** torch.arange(width - 1, -1, -1, device=values.device)
    return values[:, None] // powers % 10


def from_digits(digits: Tensor) -> Tensor:
    """(B, width) digits, most significant first, back to integers (B,)."""
    powers = 10 ** torch.arange(digits.shape[1] - 1, -1, -1, device=digits.device)
    return (digits * powers).sum(dim=1)


def widest_answer(operation: str, num_digits: int) -> int:
    """Digits of the largest answer: num_digits + 1 for a sum, 2 num_digits for a product."""
    return num_digits + 1 if operation == "add" else 2 * num_digits


class ArithmeticDataModule(MaskPriorDataModule):
    """Digit-tokenised addition or multiplication of every ordered pair of ``num_digits``-digit operands.

    All 10^(2 num_digits) pairs (10^6 for 3 digits, operands 000-999) are generated in ``setup``;
    a seeded random ``train_fraction`` of them is the training set and the remaining pairs are held
    out. Test covers the whole held-out remainder (or a seeded ``test_size`` sample of it);
    validation a seeded ``val_size`` sample of it, for speed. The split depends only on ``seed``,
    so every DDP rank builds the same data.

    Args:
        operation: ``add`` or ``mul``.
        train_fraction: Fraction of all pairs used for training, in (0, 1). Default: the paper's,
            0.004 for addition and 0.03 for multiplication.
        num_digits: Digits per operand (paper: 3).
        answer_tokens: Append one blank token per answer digit to the input (read out with
            ``pooling: tokens``); False gives the 6 operand digits only (read out with a pooled head, or at the
            operand tokens with ``operand_readout``).
        operand_readout: Read one answer digit at each of the last ``answer_width`` operand tokens
            (``pooling: tokens``) instead of from a pooled vector. Excludes ``answer_tokens``.
        answer_width: Answer digits predicted, zero-padded at the most significant end. Default: the widest
            answer (num_digits + 1 for a sum, 2 num_digits for a product); with ``operand_readout`` at most
            2 num_digits, one per operand token.
        answer_order: ``msd_first`` (as written) or ``lsd_first`` (reversed): the order of the answer digits in
            the labels, the read-out tokens and the ``digit_acc_<k>`` metrics (k = 0 the first in this order).
        operand_order: ``msd_first`` (as written) or ``lsd_first``: the order of each operand's digit tokens.
        readout_rows: With ``operand_readout``, the structure's rows at the read-out tokens: ``operands`` (the
            paper's operand structure, as on every other token) or ``dependencies`` (each attends to the operand
            digits its answer digit depends on, those of power <= the digit's own, in every layer and head;
            the rows of the answer tokens always are these).
        structure_heads: Heads of the task's structure; must equal the backbone's ``num_heads``.
        val_size: Held-out pairs evaluated at each validation (None: all of them).
        test_size: Held-out pairs evaluated by ``test`` (None: all of them).
        batch_size: Training batch size (paper: 256).
        eval_batch_size: Batch size for validation and test.
        seed: Seed of the split, the validation/test samples and the shuffling.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        operation: str = "add",
        train_fraction: float | None = None,
        num_digits: int = 3,
        answer_tokens: bool = True,
        operand_readout: bool = False,
        answer_width: int | None = None,
        answer_order: DigitOrder = "msd_first",
        operand_order: DigitOrder = "msd_first",
        readout_rows: ReadoutRows = "operands",
        structure_heads: int = 4,
        val_size: int | None = 20_000,
        test_size: int | None = None,
        batch_size: int = 256,
        eval_batch_size: int = 4096,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if operation not in OPERATIONS:
            raise ValueError(f"unknown arithmetic operation {operation!r}; expected one of {list(OPERATIONS)}")
        if train_fraction is None:
            train_fraction = PAPER_FRACTIONS[operation]
        if not 0.0 < float(train_fraction) < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        if not 1 <= num_digits <= 4:
            raise ValueError(f"num_digits must be 1..4 (10^(2 num_digits) pairs are generated), got {num_digits}")
        if structure_heads < 1:
            raise ValueError(f"structure_heads must be positive, got {structure_heads}")
        for name, size in (("val_size", val_size), ("test_size", test_size)):
            if size is not None and size < 1:
                raise ValueError(f"{name} must be positive or None (all held-out pairs), got {size}")
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError(f"batch sizes must be positive, got {batch_size} and {eval_batch_size}")
        for name, order in (("answer_order", answer_order), ("operand_order", operand_order)):
            if order not in ORDERS:
                raise ValueError(f"{name} must be one of {list(ORDERS)}, got {order!r}")
        if readout_rows not in READOUT_ROWS:
            raise ValueError(f"readout_rows must be one of {list(READOUT_ROWS)}, got {readout_rows!r}")
        if readout_rows != "operands" and not operand_readout:
            raise ValueError(
                f"readout_rows={readout_rows!r} applies to the operand read-out; set operand_readout: true")
        if answer_tokens and operand_readout:
            raise ValueError("answer_tokens and operand_readout are two read-outs; choose one")
        widest = widest_answer(operation, num_digits)
        if answer_width is None:
            answer_width = widest
        most = 2 * num_digits if operand_readout else 2 * widest
        if not widest <= answer_width <= most:
            raise ValueError(
                f"answer_width must be in [{widest}, {most}] for {operation} of {num_digits}-digit operands"
                f"{' read at the operand tokens' if operand_readout else ''}, got {answer_width}"
            )
        self.operation, self.train_fraction, self.num_digits = operation, float(train_fraction), num_digits
        self.answer_tokens, self.operand_readout, self.structure_heads = answer_tokens, operand_readout, structure_heads
        self.answer_order, self.operand_order, self.readout_rows = answer_order, operand_order, readout_rows
        self.val_size, self.test_size = val_size, test_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.seed, self.num_workers = seed, num_workers
        self.num_answer = answer_width
        self.num_pairs = 10 ** (2 * num_digits)
        self.num_train = int(round(self.train_fraction * self.num_pairs))
        if not 0 < self.num_train < self.num_pairs:
            raise ValueError(
                f"train_fraction {train_fraction} of {self.num_pairs} pairs leaves {self.num_train} for training; "
                "both training and held-out sets need at least one pair"
            )
        self.train_set: TensorDictDataset | None = None

    # ------------------------------------------------------------------ the task, for the model
    @property
    def seq_len(self) -> int:
        return 2 * self.num_digits + (self.num_answer if self.answer_tokens else 0)

    @property
    def readout_positions(self) -> list[int]:
        """The tokens the answer digits are read at, in the answer's order (empty: a pooled read-out)."""
        if self.answer_tokens:
            return list(range(2 * self.num_digits, self.seq_len))
        if self.operand_readout:
            return list(range(2 * self.num_digits - self.num_answer, 2 * self.num_digits))
        return []

    def structure(self) -> Structure:
        """Operand structure (addition: sum and carry heads; multiplication: cross pairs), plus answer tokens,
        over the tokens in their order. With ``operand_readout`` the operand structure is the whole prior: the
        paper's priors are stated over the operand digits alone."""
        build = priors.digit_addition if self.operation == "add" else priors.digit_multiplication
        structure = build(self.num_digits, self.structure_heads)
        if self.answer_tokens:
            structure = priors.with_answer_tokens(
                structure, self.num_digits, self.num_answer, lsd_first=self.answer_order == "lsd_first")
        d = self.num_digits
        order = list(range(structure.seq_len))
        if self.operand_order == "lsd_first":
            order = [*range(d - 1, -1, -1), *range(2 * d - 1, d - 1, -1), *range(2 * d, structure.seq_len)]
            structure = structure.reorder(order, name=f"{structure.name} (operands least significant first)")
        if self.readout_rows == "dependencies":  # operand tokens alone: operand_readout has no answer tokens
            powers = priors.digit_powers(d)[order]
            answer_powers = range(self.num_answer)
            if self.answer_order == "msd_first":
                answer_powers = reversed(answer_powers)
            reads = dict(zip(self.readout_positions, answer_powers, strict=True))
            structure = priors.with_readout_dependencies(structure, powers, reads)
        return structure

    def task_spec(self) -> TaskSpec:
        extras = {}
        if self.readout_positions:
            extras["readout_positions"] = self.readout_positions
        return TaskSpec(
            name=f"arithmetic/{self.operation}",
            seq_len=self.seq_len,
            vocab_size=11 if self.answer_tokens else 10,
            num_outputs=10 if self.readout_positions else 10 * self.num_answer,
            objective=DigitsObjective(self.num_answer),
            structure=self.structure(),
            # arXiv 2608.00418: arithmetic masks open = +5, closed = -5.
            init_defaults={
                **{m: {"open_value": 5.0, "closed_value": -5.0} for m in ("mask", "fixed")},
                # The paper: QK-SVD's target pattern open = 10000 / closed = 0, through the pseudo-inverse of the
                # layer-normed positions (it scales positions x18 for vision only, as the impulse init:
                # configs/init/qk_svd_pos18.yaml is that variant); QK-Opt 2,000 iterations.
                "qk_svd": {"open_value": 10000.0, "closed_value": 0.0, "pos_scale": 1.0},
                "qk_opt": {"steps": 2000},
            },
            extras=extras,
        )

    # ------------------------------------------------------------------------------ the data
    def examples(self, index: Tensor) -> TensorDictDataset:
        """Pairs number ``index`` (pair k is a = k // 10^d, b = k % 10^d) as tokens and answer digits."""
        base = 10**self.num_digits
        a, b = index // base, index % base
        answer = a + b if self.operation == "add" else a * b
        inputs = [to_digits(a, self.num_digits), to_digits(b, self.num_digits)]
        if self.operand_order == "lsd_first":
            inputs = [operand.flip(1) for operand in inputs]
        if self.answer_tokens:
            inputs.append(torch.full((len(index), self.num_answer), BLANK, dtype=torch.long))
        digits = to_digits(answer, self.num_answer)
        if self.answer_order == "lsd_first":
            digits = digits.flip(1)
        return TensorDictDataset(inputs=torch.cat(inputs, dim=1), digits=digits)

    def split(self) -> tuple[Tensor, Tensor, Tensor]:
        """(train, validation, test) pair indices: seeded, train disjoint from the other two."""
        generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(self.num_pairs, generator=generator)
        train, held_out = order[: self.num_train], order[self.num_train :]
        # Seeded samples of the held-out pairs (randperm is already random: take a prefix).
        val = held_out[: self.val_size] if self.val_size is not None else held_out
        test = held_out[-self.test_size :] if self.test_size is not None else held_out
        return train.sort().values, val.sort().values, test.sort().values

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train, val, test = self.split()
        self.train_set, self.val_set, self.test_set = self.examples(train), self.examples(val), self.examples(test)

    def dataset(self, split: str) -> TensorDictDataset:
        """The training pairs, the validation pairs, or the held-out test pairs (also for predict)."""
        return {"train": self.train_set, "val": self.val_set}.get(split, self.test_set)

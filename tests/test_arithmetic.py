"""The arithmetic benchmark: tokens, labels, split, structures, metrics and a tiny CLI run."""

import pytest
import torch

from conftest import CONFIGS
from lightning_maskprior import priors
from lightning_maskprior.cli import main
from lightning_maskprior.datamodules.arithmetic import ArithmeticDataModule, from_digits, to_digits
from lightning_maskprior.objectives import DigitsObjective
from lightning_maskprior.run.tensorboard import read_scalars


@pytest.fixture(scope="module")
def add3():
    dm = ArithmeticDataModule("add", seed=1)
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def mul3():
    dm = ArithmeticDataModule("mul", seed=1)
    dm.setup("fit")
    return dm


def test_digits_round_trip():
    values = torch.randint(0, 10**6, (1000,))
    digits = to_digits(values, 6)
    assert digits.shape == (1000, 6) and digits.min() >= 0 and digits.max() <= 9
    assert torch.equal(from_digits(digits), values)
    assert to_digits(torch.tensor([42]), 4).tolist() == [[0, 0, 4, 2]]  # most significant first


@pytest.mark.parametrize("operation", ["add", "mul"])
def test_tokens_and_labels_match_python_arithmetic(operation, add3, mul3):
    dm = add3 if operation == "add" else mul3
    data = dm.test_set.tensors
    pick = torch.randint(0, len(dm.test_set), (500,), generator=torch.Generator().manual_seed(0))
    inputs, digits = data["inputs"][pick], data["digits"][pick]
    width = 4 if operation == "add" else 6
    assert inputs.shape == (500, 6 + width) and digits.shape == (500, width)
    assert bool((inputs[:, 6:] == 10).all())  # blank answer tokens
    for row, answer in zip(inputs.tolist(), digits.tolist(), strict=True):
        a = int("".join(map(str, row[:3])))
        b = int("".join(map(str, row[3:6])))
        expected = a + b if operation == "add" else a * b
        assert "".join(map(str, answer)) == str(expected).zfill(width)


def test_split_sizes_disjoint_and_complete(add3):
    assert len(add3.train_set) == 4000 and len(add3.val_set) == 20_000
    assert len(add3.test_set) == 10**6 - 4000

    def keys(dataset):
        return from_digits(dataset.tensors["inputs"][:, :6])

    train, val, test = keys(add3.train_set), keys(add3.val_set), keys(add3.test_set)
    assert not torch.isin(train, test).any() and not torch.isin(train, val).any()
    assert torch.isin(val, test).all()
    everything = torch.cat([train, test]).sort().values
    assert torch.equal(everything, torch.arange(10**6))


def test_generation_is_seeded():
    a, b, c = (ArithmeticDataModule("mul", train_fraction=0.01, num_digits=2, seed=s) for s in (3, 3, 4))
    for dm in (a, b, c):
        dm.setup()
    assert torch.equal(a.train_set.tensors["inputs"], b.train_set.tensors["inputs"])
    assert torch.equal(a.val_set.tensors["inputs"], b.val_set.tensors["inputs"])
    assert not torch.equal(a.train_set.tensors["inputs"], c.train_set.tensors["inputs"])


def test_six_digit_inputs_without_answer_tokens():
    dm = ArithmeticDataModule("add", num_digits=2, train_fraction=0.1, answer_tokens=False)
    dm.setup()
    spec = dm.task_spec()
    assert dm.train_set.tensors["inputs"].shape[1] == 4 and spec.vocab_size == 10
    assert spec.num_outputs == 3 * 10 and "readout_positions" not in spec.extras
    assert spec.structure.open.shape == (1, 4, 4, 4)


# ------------------------------------------------------------------------------- readings of the read-out
def operand(tokens, order):
    """An operand's value from its digit tokens in ``order``."""
    tokens = tokens if order == "msd_first" else tokens[::-1]
    return int("".join(map(str, tokens)))


@pytest.mark.parametrize("operation", ["add", "mul"])
@pytest.mark.parametrize("answer_order", ["msd_first", "lsd_first"])
@pytest.mark.parametrize("operand_order", ["msd_first", "lsd_first"])
def test_operand_readout_labels_match_python_arithmetic(operation, answer_order, operand_order):
    dm = ArithmeticDataModule(operation, train_fraction=0.01, answer_tokens=False, operand_readout=True,
                              answer_order=answer_order, operand_order=operand_order, val_size=300)
    dm.setup()
    inputs, digits = dm.val_set.tensors["inputs"], dm.val_set.tensors["digits"]
    width = 4 if operation == "add" else 6
    assert inputs.shape == (300, 6) and digits.shape == (300, width)
    spec = dm.task_spec()
    # One answer digit per operand token, the last `width` tokens; each a 10-way output.
    assert spec.extras["readout_positions"] == list(range(6 - width, 6)) and spec.num_outputs == 10
    assert spec.vocab_size == 10 and spec.seq_len == 6 and spec.objective.num_digits == width
    for row, answer in zip(inputs.tolist(), digits.tolist(), strict=True):
        a, b = operand(row[:3], operand_order), operand(row[3:], operand_order)
        written = "".join(map(str, answer if answer_order == "msd_first" else answer[::-1]))
        assert written == str(a + b if operation == "add" else a * b).zfill(width)


def test_answer_width_pads_the_sum_to_one_digit_per_operand_token():
    dm = ArithmeticDataModule("add", train_fraction=0.01, answer_tokens=False, operand_readout=True, answer_width=6)
    dm.setup()
    digits = dm.train_set.tensors["digits"]
    assert digits.shape[1] == 6 and not digits[:, :2].any()  # two leading zeros: a sum has 4 digits
    assert dm.task_spec().extras["readout_positions"] == [0, 1, 2, 3, 4, 5]
    pooled = ArithmeticDataModule("add", answer_tokens=False, answer_width=5)
    assert pooled.task_spec().num_outputs == 5 * 10 and "readout_positions" not in pooled.task_spec().extras


def test_the_split_is_the_papers_wording():
    """All pairs shuffled with the seed, the first fraction for training, every other pair for the test."""
    dm = ArithmeticDataModule("mul", train_fraction=0.03, seed=5, test_size=None)
    train, _, test = dm.split()
    order = torch.randperm(10**6, generator=torch.Generator().manual_seed(5))
    assert torch.equal(train, order[:30_000].sort().values) and torch.equal(test, order[30_000:].sort().values)


def test_least_significant_operands_carry_the_structure_with_them():
    msd, lsd = (ArithmeticDataModule("add", operand_order=order) for order in ("msd_first", "lsd_first"))
    # Tokens a2 a1 a0 b2 b1 b0 become a0 a1 a2 b0 b1 b2; the answer tokens stay where they are.
    order = [2, 1, 0, 5, 4, 3, 6, 7, 8, 9]
    moved = msd.structure().open[..., order, :][..., order]
    assert torch.equal(lsd.structure().open, moved)
    # Aligned digits still attend to each other: a0 (token 0) with b0 (token 3); the ones answer reads a0 and b0.
    sums = lsd.structure().open[0, 0]
    assert sums[0, 3] and sums[3, 0] and not sums[0, 4]
    assert set(sums[9, :6].nonzero().flatten().tolist()) == {0, 3}
    # The answer least significant first: the first answer token is the ones and reads only a0 and b0.
    reversed_answer = ArithmeticDataModule("add", operand_order="lsd_first", answer_order="lsd_first")
    assert set(reversed_answer.structure().open[0, 0, 6, :6].nonzero().flatten().tolist()) == {0, 3}


@pytest.mark.parametrize("operation", ["add", "mul"])
@pytest.mark.parametrize("answer_order", ["msd_first", "lsd_first"])
@pytest.mark.parametrize("operand_order", ["msd_first", "lsd_first"])
def test_dependency_rows_open_exactly_the_digits_the_answer_digit_depends_on(operation, answer_order, operand_order):
    """Checked by brute force over every pair of 2-digit operands: read-out token t opens operand token j
    (besides itself) exactly when changing j's digit can change the answer digit read at t."""
    dm = ArithmeticDataModule(operation, train_fraction=0.1, num_digits=2, answer_tokens=False, operand_readout=True,
                              answer_order=answer_order, operand_order=operand_order, structure_heads=2,
                              readout_rows="dependencies")
    pairs = dm.examples(torch.arange(10**4))
    inputs, digits = pairs.tensors["inputs"], pairs.tensors["digits"]
    answer = {tuple(x): tuple(y) for x, y in zip(inputs.tolist(), digits.tolist(), strict=True)}
    structure, operands = dm.structure().open, ArithmeticDataModule(
        operation, num_digits=2, answer_tokens=False, operand_readout=True, answer_order=answer_order,
        operand_order=operand_order, structure_heads=2).structure().open
    generator = torch.Generator().manual_seed(0)
    for k, t in enumerate(dm.readout_positions):
        for j in range(4):
            changed = inputs.clone()
            changed[:, j] = (changed[:, j] + torch.randint(1, 10, (len(changed),), generator=generator)) % 10
            depends = any(answer[tuple(x)][k] != y[k] for x, y in zip(changed.tolist(), digits.tolist(), strict=True))
            assert bool(structure[..., t, j].all()) == (depends or j == t)
            assert not (structure[..., t, j] ^ structure[0, 0, t, j]).any()  # the same in every layer and head
    # Rows no answer digit is read at keep the operand structure.
    others = [t for t in range(4) if t not in dm.readout_positions]
    assert torch.equal(structure[..., others, :], operands[..., others, :])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"answer_tokens": True, "operand_readout": True}, "answer_tokens and operand_readout are two read-outs"),
        ({"operation": "mul", "answer_tokens": False, "operand_readout": True, "answer_width": 7},
         r"answer_width must be in \[6, 6\] for mul of 3-digit operands read at the operand tokens, got 7"),
        ({"answer_width": 3}, r"answer_width must be in \[4, 8\] for add of 3-digit operands, got 3"),
        ({"answer_order": "reversed"}, r"answer_order must be one of \['msd_first', 'lsd_first'\], got 'reversed'"),
        ({"operand_order": "lsd"}, "operand_order must be one of"),
        ({"answer_tokens": False, "operand_readout": True, "readout_rows": "answer"}, "readout_rows must be one of"),
        ({"readout_rows": "dependencies"}, "applies to the operand read-out; set operand_readout: true"),
    ],
)
def test_bad_readings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticDataModule(**kwargs)


def test_a_pooled_backbone_on_a_task_read_at_tokens_is_refused():
    from lightning_maskprior.models import TokenTransformer

    spec = ArithmeticDataModule("mul", answer_tokens=False, operand_readout=True).task_spec()
    with pytest.raises(ValueError, match=r"reads its outputs at tokens \[0, 1, 2, 3, 4, 5\]: set pooling 'tokens'"):
        TokenTransformer(spec, dim=16, depth=1, head_dim=8, pooling="mean")
    assert TokenTransformer(spec, dim=16, depth=1, head_dim=8, pooling="tokens")(torch.zeros(2, 6).long()).shape == (
        2, 6, 10)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"operation": "sub"}, r"unknown arithmetic operation 'sub'"),
        ({"train_fraction": 0.0}, r"train_fraction must be in \(0, 1\), got 0.0"),
        ({"train_fraction": 1.0}, r"train_fraction must be in \(0, 1\)"),
        ({"train_fraction": -0.2}, r"train_fraction must be in \(0, 1\)"),
        ({"train_fraction": 1e-9}, "leaves 0 for training"),
        ({"num_digits": 5}, "num_digits must be 1..4"),
        ({"val_size": 0}, "val_size must be positive"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticDataModule(**kwargs)


def test_task_spec_carries_paper_mask_values():
    spec = ArithmeticDataModule("add").task_spec()
    assert spec.init_defaults["mask"] == {"open_value": 5.0, "closed_value": -5.0}
    assert spec.init_defaults["fixed"] == {"open_value": 5.0, "closed_value": -5.0}
    assert spec.extras["readout_positions"] == [6, 7, 8, 9] and spec.seq_len == 10


# ------------------------------------------------------------------------------- structures
def offdiag(open):
    return {tuple(p) for p in (open & ~torch.eye(len(open), dtype=torch.bool)).nonzero().tolist()}


def test_addition_structure_sum_and_carry_heads():
    s = ArithmeticDataModule("add").structure()
    assert s.open.shape == (1, 4, 10, 10)
    aligned = {(0, 3), (3, 0), (1, 4), (4, 1), (2, 5), (5, 2)}
    assert offdiag(s.open[0, 0, :6, :6]) == aligned and offdiag(s.open[0, 2, :6, :6]) == aligned
    carry = offdiag(s.open[0, 1, :6, :6])
    # tens of a (token 1) reads the ones of both operands (tokens 2, 5); ones read nothing lower.
    assert {j for i, j in carry if i == 1} == {2, 5} and not {j for i, j in carry if i in (2, 5)}
    assert {j for i, j in carry if i == 3} == {1, 2, 4, 5}
    # Answer tokens (thousands, hundreds, tens, ones) read operand digits of their power and below.
    answer = s.open[0, 0]
    assert [set(answer[6 + k, :6].nonzero().flatten().tolist()) for k in range(4)] == [
        {0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}, {1, 2, 4, 5}, {2, 5},
    ]
    assert not answer[:6, 6:].any()  # operands never read the blank answer tokens
    assert torch.equal(answer[6:, 6:], torch.eye(4, dtype=torch.bool))


def test_multiplication_structure_spreads_cross_pairs_over_heads():
    s = ArithmeticDataModule("mul").structure()
    assert s.open.shape == (1, 4, 12, 12)
    cross = {(i, j) for i in range(3) for j in range(3, 6)}
    per_head = [offdiag(s.open[0, h, :6, :6]) for h in range(4)]
    for h in range(3):  # one b digit per a digit in each of the first three heads
        assert len(per_head[h]) == 6 and {(i, j) for i, j in per_head[h] if i < 3} <= cross
    assert set().union(*per_head[:3]) == cross | {(j, i) for i, j in cross}
    assert per_head[3] == cross | {(j, i) for i, j in cross}
    assert not any(p[0] < 3 and p[1] < 3 for p in set().union(*per_head))  # no same-operand pairs


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6])
def test_structures_cover_any_head_count(heads):
    for build in (priors.digit_addition, priors.digit_multiplication):
        s = build(3, heads)
        assert s.open.shape == (1, heads, 6, 6)
    mul = priors.digit_multiplication(3, heads).open[0].any(dim=0)
    assert mul[:3, 3:].all()


def test_structure_heads_must_match_the_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "-c", str(CONFIGS / "arithmetic/addition.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
              "--model.backbone.init_args.num_heads", "2", "--trainer.default_root_dir", str(tmp_path)])
    assert info.value.code == 2
    assert "has 4 heads but the model has 2" in capsys.readouterr().err


# ------------------------------------------------------------------------------- objective
def test_digit_metrics_and_loss():
    objective = DigitsObjective(num_digits=3)
    target = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]])
    predicted = torch.tensor([[1, 2, 3], [4, 5, 0], [0, 0, 9], [0, 0, 0]])
    logits = torch.nn.functional.one_hot(predicted, 10).float() * 20
    batch = {"digits": target}
    metrics = objective.make_metrics()
    objective.update_metrics(metrics, logits, batch)
    values = metrics.compute()
    assert values["seq_acc"].item() == pytest.approx(2 / 4)
    assert values["digit_acc"].item() == pytest.approx(9 / 12)
    assert set(values) == {"seq_acc", "digit_acc", "digit_acc_0", "digit_acc_1", "digit_acc_2"}
    # Each answer digit's accuracy, most significant first: here only the last digit is ever wrong.
    metrics.reset()
    last_wrong = torch.tensor([[1, 2, 0], [4, 5, 0], [7, 8, 9], [0, 0, 1]])
    objective.update_metrics(metrics, torch.nn.functional.one_hot(last_wrong, 10).float(), batch)
    values = metrics.compute()
    assert [values[f"digit_acc_{k}"].item() for k in range(3)] == pytest.approx([1, 1, 1 / 4])
    # A pooled (B, digits * 10) output means the same, digit-major.
    metrics.reset()
    objective.update_metrics(metrics, logits.flatten(1), batch)
    assert metrics.compute()["seq_acc"].item() == pytest.approx(0.5)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), target.reshape(-1))
    torch.testing.assert_close(objective.loss(logits, batch), expected)
    with pytest.raises(ValueError, match=r"expected backbone output \(B, 3, 10\)"):
        objective.loss(torch.zeros(4, 10), batch)


# ------------------------------------------------------------------------------- end to end
TINY = [
    "--data.init_args.num_digits", "2",
    "--data.init_args.train_fraction", "0.05",
    "--data.init_args.val_size", "500",
    "--data.init_args.eval_batch_size", "512",
    "--data.init_args.batch_size", "64",
    "--model.backbone.init_args.dim", "16",
    "--model.backbone.init_args.depth", "2",
    "--model.backbone.init_args.head_dim", "8",
    "--model.backbone.init_args.mlp_dim", "32",
    "--trainer.max_epochs", "2",
    "--trainer.check_val_every_n_epoch", "1",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]


@pytest.mark.parametrize(
    "config,init,readout",
    [("addition", "mask", "tokens"), ("multiplication", "default", "tokens"), ("addition", "fixed", "mean"),
     ("multiplication", "mask", "operands")],
)
def test_tiny_fit_and_test(tmp_path, capsys, config, init, readout):
    args = ["-c", str(CONFIGS / f"arithmetic/{config}.yaml"), "-c", str(CONFIGS / f"init/{init}.yaml"), *TINY,
            "--trainer.default_root_dir", str(tmp_path)]
    if readout == "mean":
        args += ["--data.init_args.answer_tokens", "false", "--model.backbone.init_args.pooling", "mean"]
    if readout == "operands":  # one answer digit at each operand token, both least significant first
        args += ["--data.init_args.answer_tokens", "false", "--data.init_args.operand_readout", "true",
                 "--data.init_args.answer_order", "lsd_first", "--data.init_args.operand_order", "lsd_first"]
    main(["fit", *args])
    out = capsys.readouterr().out
    for name in ("seq_acc", "digit_acc", "loss"):
        assert f"val/{name} " in out
    run_dir = next(tmp_path.glob("*/version_*"))
    assert len(read_scalars(run_dir)["val/seq_acc"]) == 2
    main(["test", *args, "--data.init_args.test_size", "300", "--ckpt_path", "last"])
    out = capsys.readouterr().out
    for name in ("seq_acc", "digit_acc", "loss"):
        assert f"test/{name} " in out


def test_the_read_out_rows_change_the_prior_alone(tmp_path):
    """The default column needs no run per reading of the rows: ``readout_rows`` reaches the model through the
    prior only, so without one the two readings train the same model step for step (and with one, they do not)."""
    def val_curve(init: str, rows: str) -> list[float]:
        root = tmp_path / init / rows
        paper = CONFIGS / "arithmetic/paper/multiplication.yaml"
        main(["fit", "-c", str(paper), "-c", str(CONFIGS / f"init/{init}.yaml"), *TINY,
              "--trainer.max_epochs", "1", "--trainer.precision", "32-true",
              "--data.init_args.readout_rows", rows, "--trainer.default_root_dir", str(root)])
        scalars = read_scalars(next(root.glob("*/version_*")))
        return [*scalars["val/loss"], *scalars["val/digit_acc"]]

    assert val_curve("default", "operands") == val_curve("default", "dependencies")
    assert val_curve("mask", "operands") != val_curve("mask", "dependencies")

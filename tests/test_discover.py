"""Structures without an oracle: each estimator recovers a planted structure from the training data alone."""

from __future__ import annotations

import pytest
import torch
import yaml

from conftest import CONFIGS
from lightning_maskprior.cli import main
from lightning_maskprior.datamodules import ArithmeticDataModule, BooleanGOTUDataModule
from lightning_maskprior.discover import discover
from lightning_maskprior.priors import StructureSpec


def own(target: dict, seen: dict, n: int = 12) -> BooleanGOTUDataModule:
    return BooleanGOTUDataModule("planted", n=n, target=target, seen=seen)


@pytest.mark.parametrize("target, seen, pairs", [
    # a product the seen region collapses (x3 x7 = x3 + x7 - 1 where x3 = 1 or x7 = 1): its variables are isolated
    ({"x3*x7": 1.0}, {"1": 1.0, "x3": 1.0, "x7": 1.0}, [(3, 7)]),
    # a product the seen region keeps (seen where x0 = 1, which the product does not use)
    ({"x4*x9*x11": 1.0, "x5": 0.5}, {"1": 1.0, "x0": 1.0}, [(4, 9), (4, 11), (9, 11)]),
    # two products, apart
    ({"x1*x2": 1.0, "x8*x10": -2.0}, {"1": 1.0, "x0": 1.0}, [(1, 2), (8, 10)]),
])
def test_fourier_recovers_a_planted_structure_anywhere(target, seen, pairs):
    found = discover("fourier", own(target, seen))
    assert found.pairs == pairs
    assert found.seq_len == 12 and all(found.reasons[p] for p in pairs)


def test_the_shipped_tasks(tmp_path):
    found = {task: discover("fourier", BooleanGOTUDataModule(task, n=15)).pairs for task in ("2parity", "threesym")}
    assert found["2parity"] == [(0, 1)]  # the oracle's pair, though x0 x1 is not in the seen data's MDI
    assert found["threesym"] == [(0, 1), (0, 2), (1, 2)]  # which head has which pair is not in the data


def test_discovery_never_reads_the_evaluation_split():
    """Two tasks that differ only on the unseen slice (the evaluation split's extra points) discover the same."""
    seen = {"1": 1.0, "x3": 1.0, "x7": 1.0}
    plain = discover("fourier", own({"x3*x7": 1.0}, seen))
    # + 5 on the unseen points x3 = x7 = -1: 5 (1 - x3)(1 - x7) / 4
    poisoned, clean = own({"x3*x7": 2.25, "x3": -1.25, "x7": -1.25, "1": 1.25}, seen), own({"x3*x7": 1.0}, seen)
    poisoned.setup("fit")
    clean.setup("fit")
    assert not torch.equal(poisoned.cube.tensors["target"], clean.cube.tensors["target"])  # the evaluation differs
    assert torch.equal(poisoned.train_set.tensors["target"], clean.train_set.tensors["target"])  # training does not
    again = discover("fourier", poisoned)
    assert (again.pairs, again.summary) == (plain.pairs, plain.summary)


def test_the_command_writes_what_model_structure_reads(tmp_path, capsys):
    out = tmp_path / "structure.yaml"
    main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--out", str(out)])
    assert "1 open pair(s)" in capsys.readouterr().out
    spec = StructureSpec(**yaml.safe_load(out.read_text()))
    built = spec.build(15).layer(0)[0]
    assert built[0, 1] and built[1, 0] and built.diagonal().all() and int(built.sum()) == 15 + 2


@pytest.mark.parametrize("args, message", [
    (["--method", "oracle"], r"unknown discovery method 'oracle'; expected one of \['fourier'\]"),
    (["--tolerance", "0"], r"tolerance must be > 0, got 0.0"),
])
def test_bad_discovery_options_exit_2_naming_them(capsys, args, message):
    import re

    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), *args])
    assert info.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_the_fourier_estimator_refuses_a_task_that_is_not_boolean():
    with pytest.raises(ValueError, match=r"needs a Boolean task \(BooleanGOTUDataModule\); got ArithmeticDataModule"):
        discover("fourier", ArithmeticDataModule("add", num_digits=2, train_fraction=0.1))


def test_a_run_can_train_with_a_discovered_structure(tmp_path):
    from functools import partial

    from lightning_maskprior.models import TokenTransformer
    from lightning_maskprior.module import MaskPriorModule

    datamodule = {"class_path": "lightning_maskprior.datamodules.BooleanGOTUDataModule",
                  "init_args": {"task": "planted", "n": 8, "target": {"x2*x5": 1.0},
                                "seen": {"1": 1.0, "x2": 1.0, "x5": 1.0}}}
    backbone = partial(TokenTransformer, dim=16, depth=1, num_heads=3, head_dim=8, mlp_dim=16)
    module = MaskPriorModule(backbone, init="mask", structure="discover:fourier", datamodule=datamodule)
    open_ = module.structure.layer(0)[0]
    assert open_[2, 5] and open_[5, 2] and int(open_.sum()) == 8 + 2
    assert module.hparams["discovered_structure"] == {"method": "fourier", "pairs": [[2, 5]]}
    with pytest.raises(ValueError, match=r"structure 'discover:nope': expected .* discover:<method> with a method"):
        MaskPriorModule(backbone, init="mask", structure="discover:nope", datamodule=datamodule)

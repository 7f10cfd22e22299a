"""Structures for each task, user structures, and their error messages."""

import numpy as np
import pytest
import torch

from lightning_maskprior import priors
from lightning_maskprior.datamodules.boolean import BooleanGOTUDataModule
from lightning_maskprior.priors import Structure, StructureSpec


def test_2parity_structure_opens_only_x0_x1_and_diagonal():
    s = BooleanGOTUDataModule("2parity", n=15).structure()
    assert s.open.shape == (1, 1, 15, 15)
    expected = torch.eye(15, dtype=torch.bool)
    expected[0, 1] = expected[1, 0] = True
    assert torch.equal(s.open[0, 0], expected)


def test_majority_structure_is_diagonal():
    s = BooleanGOTUDataModule("majority3", n=15).structure()
    assert torch.equal(s.open[0, 0], torch.eye(15, dtype=torch.bool))


def test_cyclic3_structure_is_a_cyclic_window():
    s = BooleanGOTUDataModule("cyclic3", n=15).structure()
    open = s.open[0, 0]
    assert open.sum() == 45
    for i in range(15):
        assert {int(j) for j in open[i].nonzero()} == {i, (i + 1) % 15, (i + 2) % 15}


def test_threesym_puts_one_pair_per_head():
    s = BooleanGOTUDataModule("threesym", n=15).structure()
    assert s.open.shape == (1, 3, 15, 15)
    for head, (i, j) in enumerate([(0, 1), (1, 2), (2, 0)]):
        off_diagonal = s.open[0, head] & ~torch.eye(15, dtype=torch.bool)
        assert {tuple(p) for p in off_diagonal.nonzero().tolist()} == {(i, j), (j, i)}


def test_all_closed_row_is_rejected_with_its_location():
    open = torch.eye(4, dtype=torch.bool)
    open[2, 2] = False
    with pytest.raises(ValueError, match="row 2 .*no open entry"):
        Structure(open)


def test_open_must_exceed_closed():
    with pytest.raises(ValueError, match=r"open value \(-1.0\) must be greater than closed value \(1.0\)"):
        priors.diagonal(3).logits(-1.0, 1.0)


def test_logits_use_open_and_closed_values():
    logits = priors.pairs(3, [(0, 2)]).logits(10, -10)
    assert logits[0, 0, 0, 2] == 10 and logits[0, 0, 2, 0] == 10 and logits[0, 0, 0, 1] == -10


def test_pair_outside_sequence_is_rejected():
    with pytest.raises(ValueError, match="token 9, outside 0..4"):
        priors.pairs(5, [(0, 9)])


def test_yaml_spec_pairs_heads_and_layers():
    assert StructureSpec(pairs=[[0, 1]]).build(4).open.shape == (1, 1, 4, 4)
    per_head = StructureSpec(heads=[[[0, 1]], [[2, 3]]]).build(4)
    assert per_head.open.shape == (1, 2, 4, 4) and per_head.open[0, 1, 2, 3]
    per_layer = StructureSpec(layers=[[[[0, 1]]], [[[1, 2]]]], symmetric=False).build(3)
    assert per_layer.open.shape == (2, 1, 3, 3)
    assert per_layer.open[1, 0, 1, 2] and not per_layer.open[1, 0, 2, 1]


def test_yaml_spec_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of"):
        StructureSpec().build(3)
    with pytest.raises(ValueError, match="exactly one of"):
        StructureSpec(pairs=[[0, 1]], heads=[[[0, 1]]]).build(3)


@pytest.mark.parametrize("suffix", [".pt", ".npy"])
def test_structure_from_file(tmp_path, suffix):
    open = torch.eye(5, dtype=torch.bool)
    open[0, 4] = True
    path = tmp_path / f"s{suffix}"
    if suffix == ".pt":
        torch.save(open, path)
    else:
        np.save(path, open.numpy())
    s = StructureSpec(file=str(path)).build(5)
    assert torch.equal(s.open[0, 0], open)
    with pytest.raises(ValueError, match="structure is 5x5 but the sequence has 6 tokens"):
        StructureSpec(file=str(path)).build(6)


def test_structure_model_mismatch():
    s = priors.pairs_per_head(4, [[(0, 1)], [(1, 2)], [(2, 3)]])
    with pytest.raises(ValueError, match="3 heads but the model has 2"):
        s.for_model(num_layers=4, num_heads=2)


def test_grid_impulse_heads_point_at_their_neighbour():
    s = priors.grid_impulse(3, 3)
    assert s.open.shape == (1, 9, 9, 9)
    centre = 4  # patch (1, 1)
    for head, (dr, dc) in enumerate(priors.IMPULSE_OFFSETS):
        assert s.open[0, head, centre].nonzero().flatten().tolist() == [(1 + dr) * 3 + (1 + dc)]


def test_pad_adds_a_cls_token_that_sees_everything():
    s = priors.diagonal(3).pad(1)
    assert s.seq_len == 4
    assert s.open[0, 0, 0].all()
    assert not s.open[0, 0, 1:, 0].any()

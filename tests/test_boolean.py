"""The Boolean GOTU datamodule: labels, seen/unseen counts and the MDI against the paper."""

import pytest
import torch

from lightning_maskprior.datamodules.boolean import BooleanGOTUDataModule
from lightning_maskprior.datamodules.loaders import ExactDistributedSampler
from lightning_maskprior.fourier import (
    coefficients_from_expansion,
    cube_points,
    min_degree_interpolator,
    walsh_hadamard,
)


def built(task, n=15, **kwargs):
    dm = BooleanGOTUDataModule(task, n=n, **kwargs)
    dm.setup("fit")
    cube = dm.cube.tensors
    x = 2 * cube["inputs"].double() - 1  # tokens back to +-1
    return dm, x, cube


# task -> (f, seen condition, MDI formula from the paper, seen count out of 2^15)
FORMULAS = {
    "2parity": (
        lambda x: x[:, 0] * x[:, 1],
        lambda x: (x[:, 0] == 1) | (x[:, 1] == 1),
        lambda x: x[:, 0] + x[:, 1] - 1,
        3 * 2**13,
    ),
    "majority3": (
        lambda x: torch.sign(x[:, 0] + x[:, 1] + x[:, 2]),
        lambda x: (x[:, 0] == 1) | (x[:, 1] == 1),
        lambda x: (x[:, 0] + x[:, 1] + 2 * x[:, 2] - x[:, 0] * x[:, 2] - x[:, 1] * x[:, 2]) / 2,
        3 * 2**13,
    ),
    "cyclic3": (
        lambda x: sum(x[:, i] * x[:, (i + 1) % 15] * x[:, (i + 2) % 15] for i in range(15)),
        lambda x: ~((x[:, 0] == -1) & (x[:, 1] == -1) & (x[:, 2] == -1)),
        lambda x: sum(x[:, i] * x[:, (i + 1) % 15] * x[:, (i + 2) % 15] for i in range(1, 15))
        + x[:, 0] * x[:, 1] + x[:, 1] * x[:, 2] + x[:, 2] * x[:, 0] - x[:, 0] - x[:, 1] - x[:, 2] + 1,
        7 * 2**12,
    ),
    "threesym": (
        lambda x: x[:, 0] * x[:, 1] - 1.25 * x[:, 1] * x[:, 2] + 1.5 * x[:, 2] * x[:, 0],
        lambda x: x[:, 0] * x[:, 1] * x[:, 2] == 1,
        lambda x: x[:, 2] - 1.25 * x[:, 0] + 1.5 * x[:, 1],
        2**14,
    ),
}


@pytest.mark.parametrize("task", sorted(FORMULAS))
def test_labels_counts_and_mdi_match_paper(task):
    f, seen, mdi, seen_count = FORMULAS[task]
    dm, x, cube = built(task)
    assert len(x) == 2**15 and len(torch.unique(x, dim=0)) == 2**15
    torch.testing.assert_close(cube["target"].double(), f(x))
    assert torch.equal(~cube["unseen"], seen(x))
    assert dm.num_seen == seen_count and dm.num_unseen == 2**15 - seen_count
    torch.testing.assert_close(cube["mdi"].double(), mdi(x), atol=1e-5, rtol=0)
    # The MDI interpolates the seen region and is wrong on (part of) the unseen slice.
    s = seen(x)
    torch.testing.assert_close(cube["mdi"][s].double(), f(x)[s], atol=1e-5, rtol=0)
    assert (cube["mdi"][~s].double() - f(x)[~s]).abs().max() > 0.5
    # Training set = the whole seen region.
    assert len(dm.train_set) == seen_count
    train_x = 2 * dm.train_set.tensors["inputs"].double() - 1
    assert bool(seen(train_x).all())


def test_mdi_has_no_higher_degree_than_needed():
    # 2parity: f has degree 2, its MDI x0 + x1 - 1 has degree 1.
    n = 4
    c = coefficients_from_expansion({"x0*x1": 1.0}, n)
    seen = walsh_hadamard(coefficients_from_expansion({"1": 1, "x0": 1, "x1": 1}, n)) > 0
    m = min_degree_interpolator(c, seen, n)
    expected = coefficients_from_expansion({"x0": 1, "x1": 1, "1": -1}, n)
    torch.testing.assert_close(m, expected)


def test_walsh_hadamard_round_trip():
    values = torch.randn(2**6, dtype=torch.float64)
    torch.testing.assert_close(walsh_hadamard(walsh_hadamard(values)) / 2**6, values)
    points = cube_points(6).double()
    c = coefficients_from_expansion({"x1*x3": 2.0, "1": 0.5}, 6)
    torch.testing.assert_close(walsh_hadamard(c), 2 * points[:, 1] * points[:, 3] + 0.5)


def test_user_task_from_expansion():
    dm, x, cube = built("mine", n=6, target={"x0*x2": 1.0}, seen={"1": 1, "x0": 1, "x2": 1})
    torch.testing.assert_close(cube["target"].double(), x[:, 0] * x[:, 2])
    torch.testing.assert_close(cube["mdi"].double(), x[:, 0] + x[:, 2] - 1, atol=1e-6, rtol=0)
    assert dm.structure() is None


def parity01(x):
    return x[:, 0] * x[:, 1]


def seen01(x):
    return (x[:, 0] == 1) | (x[:, 1] == 1)


def test_user_task_from_import_path():
    dm, x, cube = built("mine", n=5, target="test_boolean:parity01", seen="test_boolean:seen01")
    torch.testing.assert_close(cube["mdi"].double(), x[:, 0] + x[:, 1] - 1, atol=1e-6, rtol=0)


def test_sampled_training_set_is_seeded_and_seen():
    a, _, _ = built("2parity", n=10, max_train_points=100, seed=3)
    b, _, _ = built("2parity", n=10, max_train_points=100, seed=3)
    assert len(a.train_set) == 100
    assert torch.equal(a.train_set.tensors["inputs"], b.train_set.tensors["inputs"])


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown Boolean task 'parity'.*2parity"):
        BooleanGOTUDataModule("parity")


def test_half_a_user_task_is_rejected():
    with pytest.raises(ValueError, match="both `target` and `seen`"):
        BooleanGOTUDataModule("mine", target={"x0": 1.0})


def test_bad_monomial_and_import_path():
    with pytest.raises(ValueError, match="cannot read monomial"):
        built("mine", n=4, target={"y0": 1.0}, seen={"1": 1.0})
    with pytest.raises(ValueError, match="cannot import"):
        built("mine", n=4, target="no_such_module:f", seen={"1": 1.0})


@pytest.mark.parametrize("size,world", [(10, 3), (7, 2), (2**6, 4)])
def test_exact_sampler_covers_every_example_once(size, world):
    data = list(range(size))
    seen = []
    for rank in range(world):
        sampler = ExactDistributedSampler(data, num_replicas=world, rank=rank)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        seen += indices
    assert sorted(seen) == data

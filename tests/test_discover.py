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
    found = {task: discover("fourier", BooleanGOTUDataModule(task, n=15)) for task in ("2parity", "threesym")}
    assert found["2parity"].pairs == [(0, 1)]  # the oracle's pair, though x0 x1 is not in the seen data's MDI
    assert found["2parity"].heads(3) is None  # one interaction: every head carries it, as in the oracle's
    assert found["threesym"].pairs == [(0, 1), (0, 2), (1, 2)]
    # three candidate products (x0 x1 = x2 on the seen region: each pair may be one) for three heads: one each, the
    # oracle's layout up to which head has which pair (that is not in the data)
    assert sorted(map(tuple, found["threesym"].heads(3))) == [((0, 1),), ((0, 2),), ((1, 2),)]
    assert found["threesym"].heads(2) is None  # more interactions than heads: shared


ALL = [(0, 1), (2, 5), (2, 7), (5, 7)]


@pytest.mark.parametrize("interactions, num_heads, heads", [
    ([(0, 1)], 4, None),  # one interaction: every head carries it
    ([(0, 1), (2, 5, 7)], 4, [[(0, 1)], [(2, 5), (2, 7), (5, 7)], ALL, ALL]),  # a head each, the rest carry all
    ([(0, 1), (2, 5, 7)], 2, [[(0, 1)], [(2, 5), (2, 7), (5, 7)]]),
    ([(0, 1), (2, 5), (2, 7), (5, 7)], 3, None),  # more interactions than heads: every head carries every pair
])
def test_the_one_layout_rule_over_heads(interactions, num_heads, heads):
    from lightning_maskprior.discover import Discovery

    found = Discovery("planted", 8, ALL, interactions=interactions)
    assert found.heads(num_heads) == heads
    spec = found.spec(num_heads)
    built = spec.build(8)
    assert built.num_heads == (1 if heads is None else num_heads)
    for h in range(built.num_heads):
        open_ = built.layer(0)[h]
        pairs = ALL if heads is None else heads[h]
        assert {(i, j) for i in range(8) for j in range(i + 1, 8) if open_[i, j]} == set(pairs)
        assert (open_ == open_.T).all() and open_.diagonal().all()


def test_the_command_lays_threesym_out_one_pair_per_head(tmp_path, capsys):
    out = tmp_path / "structure.yaml"
    main(["discover", "-c", str(CONFIGS / "boolean/threesym.yaml"), "--out", str(out)])
    assert "one interaction per head of 3" in capsys.readouterr().out
    built = StructureSpec(**yaml.safe_load(out.read_text())).build(15)
    per_head = [{(i, j) for i in range(15) for j in range(i + 1, 15) if built.layer(0)[h][i, j]} for h in range(3)]
    assert sorted(map(sorted, per_head)) == [[(0, 1)], [(0, 2)], [(1, 2)]]


def test_the_command_reads_a_config_whose_own_structure_closes_the_diagonal(tmp_path):
    """cyclic3_small gives its structure with diagonal: false; the discovery's own model must not inherit that."""
    out = tmp_path / "structure.yaml"
    main(["discover", "-c", str(CONFIGS / "boolean/cyclic3_small.yaml"), "--out", str(out)])
    built = StructureSpec(**yaml.safe_load(out.read_text())).build(15).layer(0)[0]
    assert all(built[i, (i + 1) % 15] and built[i, (i + 2) % 15] for i in range(15)) and built.diagonal().all()


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
    (["--method", "oracle"], r"unknown discovery method 'oracle'; expected one of \['attention', 'fourier', "
                              r"'learned'\]"),
    (["--tolerance", "0"], r"estimator 'fourier': option tolerance: not of type PositiveFloat: 0 does not conform"),
    (["--method", "learned", "--tolerance", "0.1"], r"estimator 'learned' has no option tolerance; its options: steps"),
    (["--method", "learned", "--sparsity", "-1"], r"estimator 'learned': option sparsity: not of type PositiveFloat"),
    (["--method", "learned", "--seeds", "[a]"], r"estimator 'learned': option seeds: "),
    (["--method", "learned", "--run", "somewhere"], r"--run is an option of the attention estimator, not of 'learned'"),
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

    from lightning_maskprior.discover import DiscoverySpec
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
    # a model-based estimator trains a fresh copy of the run's own backbone, in a forked random state: the run's
    # weights and random stream are those of the same run given the found pairs directly
    torch.manual_seed(0)
    # the estimator's options in YAML: {discover: NAME, options: {...}}, recorded as given
    options = {"steps": 200, "lr": 0.01, "seeds": [0]}
    module = MaskPriorModule(backbone, init="mask", structure=DiscoverySpec("learned", options), datamodule=datamodule)
    after = torch.rand(1)
    found = module.hparams["discovered_structure"]
    assert found["method"] == "learned" and found["options"] == options
    assert module.hparams["structure"] == {"discover": "learned", "options": options}
    spec = StructureSpec(heads=found["heads"]) if "heads" in found else StructureSpec(pairs=found["pairs"])
    torch.manual_seed(0)
    direct = MaskPriorModule(backbone, init="mask", structure=spec, datamodule=datamodule)
    assert torch.equal(torch.rand(1), after)
    for (name, mine), theirs in zip(module.state_dict().items(), direct.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name
    with pytest.raises(ValueError, match=r"estimator 'learned': option steps: not of type PositiveInt"):
        MaskPriorModule(backbone, init="mask", structure=DiscoverySpec("learned", {"steps": -1}), datamodule=datamodule)
    with pytest.raises(ValueError, match=r"structure 'discover:nope': expected .* discover:<method> or \{discover: "):
        MaskPriorModule(backbone, init="mask", structure="discover:nope", datamodule=datamodule)


# ------------------------------------------------------------------------------ the model-based estimators
def tiny_model(datamodule):
    """What ``make_module`` gives the estimators: a fresh structure-free module for the task (a tiny backbone)."""
    from functools import partial

    from lightning_maskprior.models import TokenTransformer
    from lightning_maskprior.module import MaskPriorModule

    backbone = partial(TokenTransformer, dim=16, depth=1, num_heads=2, head_dim=8, mlp_dim=32)
    return lambda init: MaskPriorModule(backbone, init=init, structure=StructureSpec(pairs=[]),
                                        task=datamodule.task_spec())


def planted(target):  # relevant variables away from 0-2; seen where x0 = 1 (x0 is constant in training)
    return BooleanGOTUDataModule("planted", n=8, target=target, seen={"1": 1.0, "x0": 1.0}, batch_size=64)


@pytest.mark.parametrize("method, seed", [("attention", 0), ("learned", 1)])
def test_model_based_estimators_recover_a_planted_structure(method, seed):
    """On a fixed seed of a tiny model (how often each recovers the shipped tasks' structures is measured by the
    discovery study, not here)."""
    datamodule = planted({"x3*x7": 1.0})
    found = discover(method, datamodule, make_module=tiny_model(datamodule), steps=300, lr=1e-2, seeds=[seed])
    assert found.pairs == [(3, 7)]
    assert "relevant tokens" in found.summary[-1] and found.reasons[(3, 7)].startswith("both relevant")
    # a degree-1 term makes x1 relevant too: its pairs with 3 and 7 open (which of them pair up is not told apart)
    datamodule = planted({"x3*x7": 1.0, "x1": 0.5})
    found = discover(method, datamodule, make_module=tiny_model(datamodule), steps=300, lr=1e-2, seeds=[seed])
    assert found.pairs == [(1, 3), (1, 7), (3, 7)]
    # the fourier analysis of the same data marks each pair: x3 x7 is in the MDI; x1 is in no product with them
    assert found.identifiable == {(1, 3): False, (1, 7): False, (3, 7): True}
    assert "no term with both" in found.reasons[(1, 3)] and "identifiable" in found.to_yaml()


def test_model_based_discovery_never_reads_the_evaluation_split():
    """As for fourier: a task poisoned on its unseen slice only (the evaluation's extra points) discovers the
    same, and the run's own random state is untouched (the discovery model trains in a forked one)."""
    seen = {"1": 1.0, "x0": 1.0}
    clean = BooleanGOTUDataModule("planted", n=8, target={"x3*x7": 1.0}, seen=seen, batch_size=64)
    # + 5 where x0 = -1 (never seen in training): 5 (1 - x0) / 2
    poisoned = BooleanGOTUDataModule("planted", n=8, target={"x3*x7": 1.0, "1": 2.5, "x0": -2.5}, seen=seen,
                                     batch_size=64)
    results = []
    for datamodule in (clean, poisoned):
        torch.manual_seed(123)
        found = discover("attention", datamodule, make_module=tiny_model(datamodule), steps=150, lr=1e-2,
                         seeds=[0])
        results.append((found.pairs, found.summary, torch.rand(1)))
    assert not torch.equal(clean.cube.tensors["target"], poisoned.cube.tensors["target"])
    assert torch.equal(clean.train_set.tensors["target"], poisoned.train_set.tensors["target"])
    assert results[0][:2] == results[1][:2]
    torch.manual_seed(123)
    assert torch.equal(results[0][2], torch.rand(1))  # the caller's random stream, as if nothing had run


def test_a_model_based_estimator_needs_a_model_and_a_run_needs_a_checkpoint(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"estimator 'attention' trains a model: give make_module"):
        discover("attention", planted({"x3*x7": 1.0}))
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--method", "attention", "--run",
              str(tmp_path / "empty_run")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "empty_run" in err and "checkpoint" in err and "Traceback" not in err


def test_the_attention_estimator_reads_a_trained_run(tmp_path, capsys):
    """--run: the model of a finished run, read as it is (no training)."""
    from conftest import TINY_BOOLEAN

    main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), *TINY_BOOLEAN, "--trainer.max_epochs", "1",
          "--trainer.default_root_dir", str(tmp_path / "runs")])
    run = next((tmp_path / "runs").glob("*/version_0"))
    capsys.readouterr()
    # a one-epoch run has not fitted its data: read anyway (a looser fit check), the check itself is tested below
    main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), *TINY_BOOLEAN, "--method", "attention", "--run",
          str(run), "--max_loss_ratio", "100", "--out", str(tmp_path / "structure.yaml")])
    text = (tmp_path / "structure.yaml").read_text()
    assert "the model as given" in text and StructureSpec(**yaml.safe_load(text)).build(int(TINY_BOOLEAN[1]))
    # a run of another task is refused, in one line (its structure is not this task's)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(CONFIGS / "boolean/majority3.yaml"), *TINY_BOOLEAN, "--method", "attention",
              "--run", str(run), "--max_loss_ratio", "100", "--out", str(tmp_path / "other.yaml")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "other.yaml").exists()
    assert "trained on another task than the configs describe: data.init_args.task: checkpoint '2parity', config " \
           "'majority3'" in err


def test_a_fit_with_a_discovered_structure_logs_its_cost_and_its_match_with_the_oracle(tmp_path):
    from conftest import TINY_BOOLEAN
    from lightning_maskprior.discover import agreement
    from lightning_maskprior.priors import Structure
    from lightning_maskprior.run.tensorboard import read_scalars

    main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"), *TINY_BOOLEAN,
          "--model.structure", "{discover: fourier, options: {tolerance: 0.001}}", "--trainer.max_epochs", "1",
          "--trainer.default_root_dir", str(tmp_path)])
    run = next(tmp_path.glob("*/version_0"))
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["structure"] == {"discover": "fourier", "options": {"tolerance": 0.001}}
    assert hparams["discovered_structure"] == {"method": "fourier", "pairs": [[0, 1]],  # what the run trained with
                                               "options": {"tolerance": 0.001}}
    scalars = read_scalars(run)
    logged = {tag: values for tag, values in scalars.items() if tag.startswith("discovery/")}
    assert logged.pop("discovery/seconds")[0][0] == 0  # step 0
    assert logged == {"discovery/pairs": [(0, 1.0)], "discovery/precision": [(0, 1.0)], "discovery/recall": [(0, 1.0)]}
    open_ = torch.eye(4, dtype=torch.bool).expand(1, 2, 4, 4).clone()
    open_[0, 1, 0, 2] = True  # one pair, in the second head only
    oracle = Structure(open_)
    assert agreement([(0, 2), (1, 3)], oracle) == {"precision": 0.5, "recall": 1.0}  # any layer or head counts
    assert agreement([], oracle) == {"recall": 0.0}


# ------------------------------------------------------------------ structures nobody tuned the estimators to
SEEN_3_7 = {"1": 1.0, "x3": 1.0, "x7": 1.0}  # x3 = 1 or x7 = 1


def test_a_variable_outside_the_seen_condition_is_part_of_no_collapsed_product():
    """x3 x7 + x1 seen where x3 = 1 or x7 = 1: the MDI x3 + x7 - 1 + x1. Only a product of the seen condition's
    variables can collapse, so x1 is a term of its own: (3, 7), not identifiable (the data fit x3 + x7 too)."""
    found = discover("fourier", own({"x3*x7": 1.0, "x1": 1.0}, SEEN_3_7, n=10))
    assert found.pairs == [(3, 7)] and found.identifiable == {(3, 7): False}
    assert "x3*x7 would be x3 + x7 - 1 on the seen region" in found.reasons[(3, 7)]


def test_a_triple_that_collapses_into_pairs_opens_all_three_and_says_which_the_data_identify():
    """x2 x5 x8 seen where x2 = 1 or x5 = 1 is x2 x8 + x5 x8 - x8 there: (2, 8) and (5, 8) are in the data, (2, 5)
    only in the triple the seen region collapsed; the output file reports the two parts apart."""
    found = discover("fourier", own({"x2*x5*x8": 1.0}, {"1": 1.0, "x2": 1.0, "x5": 1.0}, n=10))
    assert found.pairs == [(2, 5), (2, 8), (5, 8)]
    assert found.identifiable == {(2, 5): False, (2, 8): True, (5, 8): True}
    assert found.interactions == [(2, 5, 8)]  # one product: every head carries it
    text = found.to_yaml(3)
    identified, rest = text.split("# identifiable from the training data: 2 pair(s)")[1].split("# not identifiable")
    assert "2 <-> 8  fourier  identifiable: share the MDI monomial x2*x8 (+1)" in identified
    assert "2 <-> 5  fourier  NOT identifiable: x2*x5*x8 would be x2*x8 + x5*x8 - x8 on the seen region" in rest
    assert StructureSpec(**yaml.safe_load(text)).build(10)


def test_the_seen_region_is_the_declared_one_not_the_training_sample(tmp_path, capsys):
    """2Parity trained on a random 4096 of its seen points: the MDI on the declared seen region (x0 = 1 or x1 = 1),
    fitted to the sample, gives the oracle's pair."""
    out = tmp_path / "structure.yaml"
    main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--data.init_args.max_train_points", "4096",
          "--out", str(out)])
    assert yaml.safe_load(out.read_text())["pairs"] == [[0, 1]]
    assert "MDI of the 4096 training points on the seen region the task declares (degree 1)" in out.read_text()


def noise_labels(points: torch.Tensor) -> torch.Tensor:
    """A fair coin's +-1 at every point of the cube: labels with no structure."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (len(points),), generator=generator).double() * 2 - 1


def noisy_pair(points: torch.Tensor) -> torch.Tensor:
    """2 x1 x9 plus a fair coin's +-1: a planted pair under noise of half its size."""
    return 2 * points[:, 1].double() * points[:, 9].double() + noise_labels(points)


def test_labels_with_no_structure_open_no_pair_and_the_report_says_the_noise_floor(tmp_path, capsys):
    """Pure-noise labels on 12 tokens: every MDI coefficient is noise of spread about 1/sqrt(N), none stands 6 such
    spreads above it, so no pair opens (without the floor all 66 did, 65 called identifiable)."""
    found = discover("fourier", own("test_discover:noise_labels", SEEN_3_7))
    assert found.pairs == [] and found.interactions == []
    floor = next(line for line in found.summary if line.startswith("noise floor:"))
    assert "6 x 0.9999 x g / sqrt(3072) = 0.1082 x g" in floor and "g, the seen region's factor: 1.225" in floor
    text = found.to_yaml()
    assert "# noise floor: 6 x the spread a coefficient has where the labels are pure noise" in text
    assert "pairs: []" in text


def test_a_planted_pair_under_noise_opens_alone():
    found = discover("fourier", own("test_discover:noisy_pair", {"1": 1.0, "x0": 1.0}))
    assert found.pairs == [(1, 9)] and found.identifiable == {(1, 9): True}
    floor = next(line for line in found.summary if line.startswith("noise floor:"))
    assert "6 x 0.9994 x g" in floor  # the spread the planted pair leaves unexplained: the coin's (1), not 2.2


def test_a_sample_too_small_to_determine_the_target_is_refused():
    datamodule = own({"x3*x7": 1.0, "x1*x2*x4": 1.0}, SEEN_3_7, n=10)
    datamodule.max_train_points = 20
    with pytest.raises(ValueError, match=r"the 20 training points do not determine the target on the seen region"):
        discover("fourier", datamodule)


def test_pairs_open_only_where_every_seed_agrees():
    """Three seeds finding {3, 7, 9}, {3, 7} and {1, 3, 7}: (3, 7), with each seed's tokens reported."""
    from lightning_maskprior.discover import Relevance, _agreed

    hit = Relevance(z=9.0, effect=1.0, layer=0, head=1)
    found = _agreed("attention", {0: dict.fromkeys([3, 7, 9], hit), 1: dict.fromkeys([3, 7], hit),
                                  2: dict.fromkeys([1, 3, 7], hit)}, "mean attention both ways", "x uniform", [], 10)
    assert found.pairs == [(3, 7)]
    assert found.summary[-1] == ("relevant tokens by seed: seed 0: 3, 7, 9; seed 1: 3, 7; seed 2: 1, 3, 7; found by "
                                 "every seed: 3, 7 (every pair of them opens)")
    assert found.reasons[(3, 7)].count("seed ") == 3


def test_a_large_z_score_of_a_tiny_spread_opens_nothing():
    from lightning_maskprior.discover import relevant_tokens

    scores = torch.zeros(1, 1, 8, 8)
    scores[..., 2, :] = scores[..., :, 2] = 0.05  # token 2 stands out, by 0.05: an infinite z-score
    assert relevant_tokens(scores, z_threshold=4.0, min_effect=0.1) == {}
    assert list(relevant_tokens(scores * 10, z_threshold=4.0, min_effect=0.1)) == [2]


@pytest.mark.slow
def test_the_attention_estimator_agrees_across_seeds_on_a_planted_pair():
    """x3 x7 seen where x3 = 1 or x7 = 1, a two-layer model (one seed alone opened (3, 5) and (5, 7) too)."""
    from functools import partial

    from lightning_maskprior.models import TokenTransformer
    from lightning_maskprior.module import MaskPriorModule

    datamodule = BooleanGOTUDataModule("planted", n=10, target={"x3*x7": 1.0}, seen=SEEN_3_7, batch_size=64)
    backbone = partial(TokenTransformer, dim=16, depth=2, num_heads=3, head_dim=8, mlp_dim=32)

    def make_module(init):
        return MaskPriorModule(backbone, init=init, structure=StructureSpec(pairs=[]), task=datamodule.task_spec())

    found = discover("attention", datamodule, make_module=make_module, steps=200, lr=1e-2, seeds=[1, 2])
    assert found.pairs == [(3, 7)]
    assert "found by every seed: 3, 7" in found.summary[-1] and found.identifiable == {(3, 7): False}


def test_a_discovery_model_that_did_not_fit_stops_the_command(tmp_path, capsys):
    """x2 x5 x8 seen where x0 = 1 or x1 = 1: a briefly trained model is still at its initial loss, and what it
    attends to is not the task's structure: exit 2, one line saying so, no file."""
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"data": {"init_args": {
        "task": "planted", "n": 10, "target": {"x2*x5*x8": 1.0}, "seen": {"1": 1.0, "x0": 1.0, "x1": 1.0}}}}))
    out = tmp_path / "structure.yaml"
    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(task),
              "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "1",
              "--model.backbone.init_args.head_dim", "8", "--model.backbone.init_args.mlp_dim", "32",
              "--method", "attention", "--steps", "20", "--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and not out.exists()
    assert "the attention estimator's model did not fit its training data (seed 0: training loss" in err
    assert "fitted means at most 10%, max_loss_ratio 0.1" in err


def test_the_structure_is_never_written_over_an_input_config(tmp_path, capsys):
    task = tmp_path / "task.yaml"
    task.write_text((CONFIGS / "boolean/2parity.yaml").read_text())
    before = task.read_text()
    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(task), "--out", str(tmp_path / "." / "task.yaml")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--out {tmp_path}/task.yaml is the config given with -c" in err
    assert task.read_text() == before


def test_the_structure_is_never_written_over_a_file_given_with_an_option(tmp_path, capsys):
    data = tmp_path / "data.yaml"
    data.write_text("class_path: lightning_maskprior.datamodules.BooleanGOTUDataModule\ninit_args: {n: 6}\n")
    before = data.read_text()
    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--data", str(data), "--out", str(data)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--out {data} is the file given with --data" in err
    assert data.read_text() == before


def test_the_family_evaluation_scores_fourier_against_the_planted_pairs(monkeypatch):
    """benchmarks/discovery_family.py on a few of its tasks: every MDI pair is planted, fourier finds the identifiable
    ones and marks them so, and a planted task's own pairs are its oracle structure."""
    import importlib.util
    import sys

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("discovery_family", ROOT / "benchmarks/discovery_family.py")
    family = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "discovery_family", family)  # its dataclass looks its module up there
    spec.loader.exec_module(family)
    tasks = family.planted_family(6, seed=0)
    assert tasks == family.planted_family(6, seed=0)  # drawn with the seed
    rows = family.evaluate(tasks, ["fourier"], {})
    scores = family.summary(rows, "fourier")
    assert scores["identifiable: precision"].startswith("1.000") and scores["identifiable: recall"].startswith("1.000")
    oracle = tasks[0].datamodule().structure().layer(0)[0]
    assert {(i, j) for i in range(12) for j in range(i + 1, 12) if oracle[i, j]} == tasks[0].pairs()
    with pytest.raises(ValueError, match=r"structure is the oracle of a task of your own"):
        BooleanGOTUDataModule("2parity", structure=[[0, 1]])


def test_an_unknown_option_is_one_line_not_the_fits_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--tolerancee", "0.1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "maskprior discover has no option --tolerancee; expected -c/--config" in err
    assert "an option of estimator 'fourier' (--tolerance, --noise_multiple;" in err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err

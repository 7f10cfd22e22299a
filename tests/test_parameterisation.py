"""The prior's parameterisations (full, relative, low_rank): each against its materialised M in value and gradient,
the projection of an init's M onto each (exact where it can be, its error reported where not), and the option
carried through the module, the optimizer, a Lightning checkpoint and the CLI."""

from __future__ import annotations

import functools
import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import CONFIGS
from lightning_maskprior import priors
from lightning_maskprior.attention import PriorAttention, attention_layers, offset_index, project_prior
from lightning_maskprior.checkpoints import CheckpointError
from lightning_maskprior.cli import main
from lightning_maskprior.models import GPT
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.objectives import LanguageModelObjective
from lightning_maskprior.run.tensorboard import read_scalars
from lightning_maskprior.task import TaskSpec

DIM, HEAD_DIM = 24, 8


def _layer(parameterisation: str, n: int, heads: int = 3, causal: bool = False, grid=None, prefix: int = 0,
           rank: int = 2) -> PriorAttention:
    torch.manual_seed(0)
    layer = PriorAttention(DIM, heads, head_dim=HEAD_DIM, causal=causal)
    layer.set_parameterisation(parameterisation, rank, grid, prefix)
    layer.set_prior(torch.randn(heads, n, n) * 3, scale=2.0)
    return layer


CASES = {
    "relative": dict(parameterisation="relative", n=7),
    "relative causal, shared by the heads": dict(parameterisation="relative", n=7, causal=True),
    "relative on a 3x4 grid after 2 prefix tokens": dict(parameterisation="relative", n=14, grid=(3, 4), prefix=2),
    "low_rank": dict(parameterisation="low_rank", n=7, rank=2),
}


@pytest.mark.parametrize("kernel", ["explicit", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_parameterisation_is_its_materialised_m_in_value_and_gradient(case, kernel):
    """The layer against a full-M layer holding ``prior_matrix()``: the same output, the same gradient of the
    weights, and the gradient of the parameterisation's parameters is the full M's pulled back through M."""
    options = dict(CASES[case])
    layer = _layer(**options)
    if case.startswith("relative causal"):  # one prior for every head: (1, 2N - 1) offsets
        layer.set_prior(layer.prior_matrix().detach()[:1], scale=2.0)
    reference = PriorAttention(DIM, layer.num_heads, head_dim=HEAD_DIM, causal=layer.causal)
    reference.load_state_dict({k: v for k, v in layer.state_dict().items() if k.startswith(("qkv", "proj"))})
    reference.set_prior(layer.prior_matrix().detach(), scale=2.0)
    layer.kernel = reference.kernel = kernel
    x = torch.randn(2, options["n"], DIM)
    target = torch.randn(2, options["n"], DIM)
    out, expected = layer(x), reference(x)
    torch.testing.assert_close(out, expected)

    params = list(layer.prior_parameters().values())
    grads = torch.autograd.grad(F.mse_loss(out, target), [*params, layer.qkv.weight])
    grad_m, grad_qkv = torch.autograd.grad(F.mse_loss(expected, target), [reference.prior_logits, reference.qkv.weight])
    pulled_back = torch.autograd.grad(layer.prior_matrix(), params, grad_m)
    for got, want in zip(grads[:-1], pulled_back, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(grads[-1], grad_qkv)


def test_full_is_the_parameter_m_itself_under_its_old_name():
    layer = _layer("full", 5)
    assert list(layer.state_dict())[0] == "prior_logits" and set(layer.prior_parameters()) == {"prior_logits"}
    assert layer.prior_matrix() is layer.prior_logits and layer.projection_error == 0


def test_relative_holds_a_shift_invariant_structure_exactly():
    language = priors.causal_relative_distance(9).layer_values(0)  # M_ij = -max(i - j, 0)
    held, error = project_prior(language, "relative")
    assert error == 0 and set(held) == {"prior_offsets"} and held["prior_offsets"].shape == (1, 1, 17)
    offsets = held["prior_offsets"][0, 0]  # at i - j + 8: i - j = -8 .. 8
    assert torch.equal(offsets[8:], -torch.arange(9).float()) and torch.equal(offsets[:8], torch.zeros(8))
    cyclic = torch.where(priors.cyclic_window(8).layer(0), 10.0, -10.0)  # Cyclic3's window wraps around: Toeplitz too
    assert project_prior(cyclic, "relative")[1] == 0


def test_relative_takes_the_mean_over_each_offset_and_reports_the_error_where_the_structure_is_not_shift_invariant():
    m = torch.where(priors.pairs(6, [(0, 1)]).layer(0), 10.0, -10.0)  # 2Parity-like: one pair, not a shift
    layer = PriorAttention(DIM, 1, head_dim=HEAD_DIM)
    layer.set_parameterisation("relative")
    layer.set_prior(m)
    # offset i - j = 1 (table index 1 + 5): (1, 0) open, (2, 1) ... (5, 4) closed
    assert layer.prior_offsets[0, 0, 6].item() == pytest.approx((10 - 4 * 10) / 5)
    expected = ((m - layer.prior_matrix()).norm() / m.norm()).item()
    assert layer.projection_error == pytest.approx(expected) and layer.projection_error > 0.1


def test_relative_on_a_patch_grid_is_block_toeplitz_and_keeps_the_prefix_rows_and_columns():
    rows, cols, prefix, heads = 3, 4, 1, 2
    n = prefix + rows * cols
    torch.manual_seed(0)
    table = torch.randn(heads, (2 * rows - 1) * (2 * cols - 1))
    m = torch.randn(heads, n, n)
    m[:, prefix:, prefix:] = table[:, offset_index(rows, cols)]  # depends on the 2-D offset alone
    held, error = project_prior(m, "relative", grid=(rows, cols), prefix=prefix)
    assert error < 1e-6 and torch.allclose(held["prior_offsets"].flatten(1), table, atol=1e-6)
    assert held["prior_prefix_rows"].shape == (heads, prefix, n)
    assert held["prior_prefix_columns"].shape == (heads, n - prefix, prefix)
    # the impulse's centre head is a shift; its other heads keep the own entry open at the border, which is not
    centre = torch.where(priors.grid_impulse(rows, cols, [(0, 0)]).pad(prefix).layer(0), 10.0, -10.0)
    assert project_prior(centre, "relative", grid=(rows, cols), prefix=prefix)[1] == 0
    up = torch.where(priors.grid_impulse(rows, cols, [(-1, 0)]).pad(prefix).layer(0), 10.0, -10.0)
    assert project_prior(up, "relative", grid=(rows, cols), prefix=prefix)[1] > 0
    with pytest.raises(ValueError, match="3x4 grid after 2 prefix tokens does not fit a 13x13 prior"):
        project_prior(m, "relative", grid=(rows, cols), prefix=2)


def test_low_rank_is_exact_at_the_rank_of_m_keeps_the_diagonal_and_learns_from_zero():
    torch.manual_seed(0)
    m = torch.randn(2, 8, 3) @ torch.randn(2, 3, 8) + torch.diag_embed(torch.randn(2, 8))
    assert project_prior(m, "low_rank", rank=8)[1] < 1e-6  # rank N: exact
    at_rank, error = project_prior(m, "low_rank", rank=3)[1], project_prior(m, "low_rank", rank=1)[1]
    assert at_rank < 0.01 < error  # M's own rank: close (the alternating fit settles slowly), below it: not
    held = project_prior(m, "low_rank", rank=1)[0]
    approx = held["prior_left"] @ held["prior_right"].mT + torch.diag_embed(held["prior_diagonal"])
    torch.testing.assert_close(approx.diagonal(dim1=-2, dim2=-1), m.diagonal(dim1=-2, dim2=-1))
    layer = PriorAttention(DIM, 2, head_dim=HEAD_DIM)
    layer.set_parameterisation("low_rank", rank=2)
    layer.set_prior(torch.zeros(2, 8, 8))  # the zero init: M = 0, and U must still get a gradient
    assert torch.equal(layer.prior_matrix(), torch.zeros(2, 8, 8))
    layer(torch.randn(2, 8, DIM)).square().sum().backward()
    assert layer.prior_left.grad.abs().sum() > 0


def test_set_parameterisation_carries_an_installed_prior_over():
    layer = PriorAttention(DIM, 2, head_dim=HEAD_DIM, causal=True)
    m = priors.causal_relative_distance(6).layer_values(0)
    layer.set_prior(m, trainable=False, scale=10.0)
    layer.set_parameterisation("relative")
    assert set(layer.prior_parameters()) == {"prior_offsets"} and not layer.prior_offsets.requires_grad
    assert layer.prior_scale == 10.0 and torch.equal(layer.prior_matrix(), m)
    with pytest.raises(ValueError, match="parameterisation must be one of full, relative, low_rank; got 'toeplitz'"):
        layer.set_parameterisation("toeplitz")


# ------------------------------------------------------------------------------ in the module
def _task(structure: priors.Structure, n: int = 8, vocab: int = 40) -> TaskSpec:
    return TaskSpec("lm", n, vocab, vocab, LanguageModelObjective(), structure,
                    init_defaults={m: {"scale": 10.0} for m in ("mask", "fixed")})


GPT_TINY = functools.partial(GPT, dim=16, depth=2, num_heads=2, head_dim=8, dropout=0.0)


def test_module_holds_the_language_prior_relative_and_optimises_it_as_the_prior():
    task = _task(priors.causal_relative_distance(8))
    module = MaskPriorModule(backbone=GPT_TINY, init="mask", task=task, parameterisation="relative",
                             lr_schedule="constant")
    for layer in attention_layers(module):
        assert {k: tuple(v.shape) for k, v in layer.prior_parameters().items()} == {"prior_offsets": (1, 1, 15)}
        assert torch.equal(layer.prior_matrix(), task.structure.layer_values(0))
    assert module.projection_error == 0
    groups = {g["name"]: g["params"] for g in module.configure_optimizers().param_groups}
    assert {id(p) for p in groups["prior"]} == {id(layer.prior_offsets) for layer in attention_layers(module)}


def test_module_reports_the_projection_error_of_a_structure_that_is_not_relative(caplog):
    with caplog.at_level(logging.INFO):
        module = MaskPriorModule(backbone=GPT_TINY, init="mask", task=_task(priors.pairs(8, [(0, 3)])),
                                 parameterisation="relative")
    assert module.projection_error > 0.1
    assert f"relative error |M - projected|/|M| {module.projection_error:.3g}" in caplog.text


def test_a_rank_that_the_prior_would_ignore_is_refused_naming_it():
    """prior_rank with another parameterisation than low_rank, or above the prior's token count, changes nothing
    the run trains: refused instead of accepted and ignored."""
    task = _task(priors.causal_relative_distance(8))
    with pytest.raises(ValueError, match="prior_rank 3 is an option of the low_rank parameterisation, but "
                                         "parameterisation is 'full'"):
        MaskPriorModule(backbone=GPT_TINY, init="mask", task=task, prior_rank=3)
    with pytest.raises(ValueError, match="prior_rank 9 is above the 8 tokens of the prior"):
        MaskPriorModule(backbone=GPT_TINY, init="mask", task=task, parameterisation="low_rank", prior_rank=9)
    assert MaskPriorModule(backbone=GPT_TINY, init="mask", task=task, parameterisation="low_rank", prior_rank=8)


def test_low_rank_module_round_trips_through_a_lightning_checkpoint(tmp_path):
    task = _task(priors.causal_relative_distance(8))
    module = MaskPriorModule(backbone=GPT_TINY, init="mask", task=task, parameterisation="low_rank", prior_rank=3)
    tokens = torch.randint(40, (4, 9))
    batches = [{"inputs": tokens[:, :-1], "target": tokens[:, 1:]}]
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    trainer.save_checkpoint(tmp_path / "low_rank.ckpt")
    loaded = MaskPriorModule.load_from_checkpoint(tmp_path / "low_rank.ckpt", task=task)
    assert loaded.hparams.parameterisation == "low_rank" and loaded.hparams.prior_rank == 3
    for trained, reloaded in zip(attention_layers(module), attention_layers(loaded), strict=True):
        assert trained.prior_left.shape == (1, 8, 3)
        assert torch.equal(trained.prior_matrix(), reloaded.prior_matrix())
    with pytest.raises(CheckpointError, match="parameterisation 'low_rank', the config asks for 'full'"):
        MaskPriorModule.load_from_checkpoint(tmp_path / "low_rank.ckpt", task=task, parameterisation="full",
                                             prior_rank=8)  # the default rank: a rank is low_rank's option alone


def test_cli_fits_the_gpt_with_a_relative_prior_and_its_checkpoint_reloads(tmp_path):
    main(["fit", "-c", str(CONFIGS / "language/pydoc.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
          "--model.parameterisation", "relative",
          "--data.init_args.block_size", "16", "--data.init_args.vocab_size", "300",
          "--data.init_args.batch_size", "8", "--data.init_args.cache_dir", str(tmp_path / "cache"),
          "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "1",
          "--model.backbone.init_args.num_heads", "2", "--trainer.precision", "32-true",
          "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
          "--trainer.default_root_dir", str(tmp_path / "runs")])
    checkpoint = next((tmp_path / "runs").rglob("last.ckpt"))
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert not any(k.endswith("prior_logits") for k in state)
    offsets = state["backbone.blocks.0.attn.prior_offsets"]
    assert offsets.shape == (1, 1, 31)
    module = MaskPriorModule.load_from_checkpoint(checkpoint)
    assert module.hparams.parameterisation == "relative"
    assert torch.equal(attention_layers(module)[0].prior_offsets.detach(), offsets)


def test_callbacks_measure_a_relative_prior_and_the_projection_error_is_logged(tiny_args, tmp_path):
    """2Parity's structure is not a shift: the tiny fit logs its projection error, and PriorPersistence reads the
    relative prior's materialised M (its correlation with the structure, its drift) like a full one."""
    main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "-c", str(CONFIGS / "init/mask.yaml"), *tiny_args,
          "--model.parameterisation", "relative", "--trainer.max_epochs", "1", "--trainer.precision", "32-true"])
    scalars = read_scalars(next((tmp_path / "runs").rglob("version_*")))
    assert scalars["prior/projection_error"][0][1] > 0.1
    assert scalars["persistence_heads/prior_drift/layer0/head0"][0][1] == 0  # step 0
    assert "persistence_heads/prior_corr/layer1/head0" in scalars


# ------------------------------------------------------------------------------ injected models
def test_injected_timm_vit_holds_a_relative_prior_on_its_patch_grid_and_loads_it_back():
    timm = pytest.importorskip("timm")
    from lightning_maskprior import export_prior, inject_prior

    def vit():
        torch.manual_seed(0)
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                 num_classes=5).eval()  # 4 x 4 patches after a CLS token

    structure = priors.grid_impulse(4, 4, [(0, 0)]).pad(1)  # the centre head: a shift, held exactly
    model = inject_prior(vit(), structure, init="mask", parameterisation="relative")
    layers = attention_layers(model)
    assert all(layer.projection_error == 0 and layer.prior_grid == (4, 4) for layer in layers)
    assert {k: tuple(v.shape) for k, v in layers[0].prior_parameters().items()} == {
        "prior_offsets": (1, 7, 7), "prior_prefix_rows": (1, 1, 17), "prior_prefix_columns": (1, 16, 1)}
    images = torch.randn(2, 3, 32, 32)
    full = inject_prior(vit(), structure, init="mask")
    torch.testing.assert_close(model(images), full(images))
    assert torch.equal(export_prior(model)[0].logits, export_prior(full)[0].logits)

    fresh = inject_prior(vit())  # a saved model loads into a fresh injection, parameterisation included
    fresh.load_state_dict(model.state_dict())
    assert attention_layers(fresh)[0].parameterisation == "relative"
    torch.testing.assert_close(fresh(images), model(images))

    held_full = inject_prior(vit(), structure, init="zero")  # M held full: the saved relative M replaces it
    held_full.load_state_dict(model.state_dict(), strict=False)
    layer = attention_layers(held_full)[0]
    assert layer.parameterisation == "relative" and set(layer.prior_parameters()) == set(layers[0].prior_parameters())
    torch.testing.assert_close(held_full(images), model(images))


def test_injected_hf_gpt2_with_a_relative_language_prior_saves_and_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_maskprior import inject_prior
    from lightning_maskprior.inject import load_injected

    n = 16
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=n, attn_pdrop=0.0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    inject_prior(model, priors.causal_relative_distance(n), init="mask", scale=10.0, parameterisation="relative")
    layer = attention_layers(model)[0]
    assert set(layer.prior_parameters()) == {"prior_offsets"} and layer.projection_error == 0
    tokens = torch.randint(50, (2, n))
    logits = model(tokens).logits
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.load_state_dict(model.state_dict(), strict=False)
    inject_prior(reference, priors.causal_relative_distance(n), init="mask", scale=10.0)  # full M
    torch.testing.assert_close(logits, reference(tokens).logits)

    model.save_pretrained(tmp_path / "relative")
    loaded = load_injected(tmp_path / "relative").eval()
    held = attention_layers(loaded)[0]
    assert held.parameterisation == "relative" and held.prior_scale == 10.0
    assert torch.equal(held.prior_offsets, layer.prior_offsets)
    torch.testing.assert_close(loaded(tokens).logits, logits)

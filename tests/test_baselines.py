"""The baselines as their authors published them: every mimetic head alive, QK-Opt's renormalisation as in its
reference, the prior summed with the logits in float32 under bf16, the paper's QK settings as task defaults."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_maskprior import priors
from lightning_maskprior.attention import PriorAttention, attention_layers
from lightning_maskprior.datamodules.arithmetic import ArithmeticDataModule
from lightning_maskprior.datamodules.boolean import BooleanGOTUDataModule
from lightning_maskprior.datamodules.loaders import train_loader, worker_seed
from lightning_maskprior.inits import apply_init, fit_query_key, mimetic_values
from lightning_maskprior.models import TokenTransformer


# ------------------------------------------------------------------------------------------------ mimetic
@pytest.mark.parametrize("dim, heads, head_dim", [(128, 6, 32), (64, 3, 64), (32, 4, 8), (48, 3, 16)])
def test_mimetic_values_keep_the_product_and_give_every_head_a_share(dim, heads, head_dim):
    inner = heads * head_dim
    torch.manual_seed(0)
    z = (torch.rand(dim, dim, dtype=torch.float64) * 2 - 1) * (3 / dim) ** 0.5
    target = 0.4 * z - 0.4 * torch.eye(dim, dtype=torch.float64)
    torch.manual_seed(0)
    wv, wproj = mimetic_values(dim, inner, 0.4, 0.4)
    assert wv.shape == (inner, dim) and wproj.shape == (dim, inner)
    product = (wproj @ wv).double()
    if inner >= dim:  # full rank: the product is the target itself
        torch.testing.assert_close(product, target, atol=1e-5, rtol=1e-5)
    else:  # the best rank-inner approximation of it
        u, s, vh = torch.linalg.svd(target)
        torch.testing.assert_close(product, (u[:, :inner] * s[:inner]) @ vh[:inner], atol=1e-5, rtol=1e-5)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        assert wv[rows].norm() > 0.1 * wv.norm() / heads**0.5, f"head {h} has (almost) no value weights"
        assert wproj[:, rows].norm() > 0.1 * wproj.norm() / heads**0.5, f"head {h} has (almost) no projection"


def test_every_mimetic_head_of_a_wide_attention_gets_gradient():
    """Width 64 with 3 heads of 64 (inner 192): every head's Wv, Wproj, Wq and Wk are non-zero and learn."""
    torch.manual_seed(0)
    spec = BooleanGOTUDataModule("2parity", n=6).task_spec()
    backbone = TokenTransformer(spec, dim=64, depth=2, num_heads=3, head_dim=64, mlp_dim=64)
    apply_init("mimetic", backbone, None)
    inputs = torch.randint(0, 2, (32, 6))
    backbone(inputs).pow(2).mean().backward()
    for index, layer in enumerate(attention_layers(backbone)):
        d, inner = layer.head_dim, layer.inner_dim
        weight, grad = layer.qkv.weight, layer.qkv.weight.grad
        for h in range(layer.num_heads):
            for part, offset in (("Wq", 0), ("Wk", inner), ("Wv", 2 * inner)):
                rows = slice(offset + h * d, offset + (h + 1) * d)
                assert weight[rows].abs().sum() > 0, f"layer {index} head {h}: {part} is zero"
                assert grad[rows].abs().sum() > 0, f"layer {index} head {h}: {part} gets no gradient"
            columns = slice(h * d, (h + 1) * d)
            assert layer.proj.weight[:, columns].abs().sum() > 0, f"layer {index} head {h}: Wproj is zero"
            assert layer.proj.weight.grad[:, columns].abs().sum() > 0, f"layer {index} head {h}: no Wproj grad"


def test_mimetic_value_extras_of_the_mask_init_are_alive_too():
    torch.manual_seed(0)
    spec = BooleanGOTUDataModule("2parity", n=6).task_spec()
    backbone = TokenTransformer(spec, dim=32, depth=1, num_heads=3, head_dim=32, mlp_dim=32)
    apply_init("mask", backbone, spec.structure, value_alpha=0.4, value_beta=0.4)
    layer = attention_layers(backbone)[0]
    wv = layer.qkv.weight[2 * layer.inner_dim :].detach()
    assert all(wv[h * 32 : (h + 1) * 32].norm() > 0 for h in range(3))
    value = (layer.proj.weight @ wv).detach()
    assert value.diagonal().mean() == pytest.approx(-0.4, abs=0.05)


# ------------------------------------------------------------------------------------------------ QK-Opt
def _reference_loop(inputs, target, head_dim, steps, lr, renorm_every, seed):
    """The reference's loop written out in its own layout: Q (heads, dim, rank), K (heads, rank, dim), both
    renormalised over axis 1 to the initial mean norm of Q's columns, Adam on the MSE of the attention."""
    torch.manual_seed(seed)
    heads, dim = target.shape[0], inputs.shape[-1]
    bound = (1.0 / (head_dim * heads)) ** 0.5
    # Drawn in our (heads, head_dim, dim) order, so both loops start from the same numbers.
    q0 = (torch.rand(heads, head_dim, dim) * 2 - 1) * bound
    k0 = (torch.rand(heads, head_dim, dim) * 2 - 1) * bound
    q = nn.Parameter(q0.transpose(-2, -1).clone())  # (heads, dim, rank)
    k = nn.Parameter(k0.clone())  # (heads, rank, dim)
    nq = q.detach().norm(dim=1).mean()
    optimizer = torch.optim.Adam([q, k], lr=lr)
    for step in range(steps):
        if step % renorm_every == 0:
            with torch.no_grad():
                q.div_(q.detach().norm(dim=1, keepdim=True) / nq)
                k.div_(k.detach().norm(dim=1, keepdim=True) / nq)
        optimizer.zero_grad()
        logits = inputs @ q @ k @ inputs.T / head_dim**0.5
        F.mse_loss(logits.softmax(-1), target).backward()
        optimizer.step()
    return q.detach().transpose(-2, -1), k.detach()


def test_qk_opt_renormalises_like_its_reference():
    torch.manual_seed(0)
    inputs = F.layer_norm(torch.randn(8, 32), (32,))
    open = priors.cyclic_window(8, (0, 1)).layer(0)
    target = (open.float() / open.sum(-1, keepdim=True)).expand(2, -1, -1)
    want_q, want_k = _reference_loop(inputs, target, 4, steps=250, lr=1e-3, renorm_every=100, seed=5)
    torch.manual_seed(5)
    wq, wk, _ = fit_query_key(inputs, target, 4, steps=250, lr=1e-3, renorm_every=100)
    torch.testing.assert_close(wq, want_q, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(wk, want_k, atol=1e-4, rtol=1e-3)
    # What that renormalisation implies at a renorm step: |Wk|_F / |Wq|_F = sqrt(dim / head_dim).
    torch.manual_seed(5)
    wq, wk, _ = fit_query_key(inputs, target, 4, steps=1, lr=1e-12, renorm_every=1)
    assert (wk.norm() / wq.norm()).item() == pytest.approx(math.sqrt(32 / 4), rel=1e-3)


# ------------------------------------------------------------------------------------------------ bf16 prior
def test_bf16_gradient_of_the_prior_is_within_half_a_percent_of_fp32():
    torch.manual_seed(0)
    layer = PriorAttention(dim=64, num_heads=3, head_dim=64, kernel="explicit")
    open = (torch.rand(3, 15, 15) < 0.3) | torch.eye(15, dtype=torch.bool)
    layer.set_prior(torch.where(open, 10.0, -10.0) + torch.randn(3, 15, 15))
    x, target = torch.randn(256, 15, 64), torch.randn(256, 15, 64)

    def prior_grad(autocast: bool) -> torch.Tensor:
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x)
        ((out.float() - target) ** 2).mean().backward()
        return layer.prior_logits.grad.clone()

    reference, low = prior_grad(False), prior_grad(True)
    assert ((low - reference).norm() / reference.norm()).item() < 0.005


# ------------------------------------------------------------------------------------------------ settings
def test_boolean_qk_defaults_are_the_papers():
    defaults = BooleanGOTUDataModule("2parity", n=6).task_spec().init_defaults
    assert defaults["qk_opt"] == {"steps": 2000, "lr": 1e-4}  # positions as they are (pos_scale 1)
    assert defaults["qk_svd"].get("pos_scale", 18.0) == 18.0 and defaults["qk_svd"].get("qk_scale", 7.0) == 7.0


def test_arithmetic_qk_svd_maps_the_positions_unscaled():
    defaults = ArithmeticDataModule("add", num_digits=2, train_fraction=0.5).task_spec().init_defaults
    assert defaults["qk_svd"]["pos_scale"] == 1.0


def test_cyclic_window_opens_the_diagonal_only_when_asked():
    assert priors.cyclic_window(5, (1, 2)).layer(0)[0].diagonal().all()
    closed = priors.cyclic_window(5, (1, 2), open_diagonal=False).layer(0)[0]
    assert not closed.diagonal().any() and closed.sum() == 10


def test_impulse_fits_the_patch_positions_without_the_cls_row():
    """On a ViT the impulse pattern holds on the patch tokens exactly, whatever the CLS token's embedding."""
    from lightning_maskprior.datamodules import DigitsDataModule
    from lightning_maskprior.models import VisionTransformer

    torch.manual_seed(0)
    spec = DigitsDataModule(img_size=16, patch_size=4).task_spec()  # a 4x4 patch grid
    backbone = VisionTransformer(spec, "vit_tiny_patch16_224", {"embed_dim": 48, "depth": 1, "num_heads": 3})
    with torch.no_grad():
        backbone.model.cls_token.normal_(std=10.0)  # a CLS row unlike the positions: it must not bend the fit
    apply_init("impulse", backbone, None, closed_noise=0.0, value_alpha=0.0, value_beta=0.0)
    layer = attention_layers(backbone)[0]
    norm = backbone.attention_norms()[0]
    with torch.no_grad():
        x = norm(backbone.positional_embedding())[1:]
        wq, wk = layer.query_key_weights()
        probs = ((x @ wq.transpose(-2, -1)) @ (x @ wk.transpose(-2, -1)).transpose(-2, -1) / wq.shape[1] ** 0.5)
        probs = probs.softmax(-1)
    grid = priors.grid_impulse(*backbone.patch_grid(), priors.IMPULSE_OFFSETS[:3]).layer(0)
    mass = (probs * grid).sum(-1).mean().item()
    assert mass > 0.99


# ------------------------------------------------------------------------------------------------ DDP seeds
def test_training_loader_workers_are_seeded_per_rank(monkeypatch):
    from lightning_maskprior.datamodules import loaders as data

    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    assert train_loader(dataset, 2, seed=3).generator.initial_seed() == 3  # one process: unchanged
    monkeypatch.setattr(data, "_rank", lambda: 1)
    rank1 = train_loader(dataset, 2, seed=3).generator.initial_seed()
    assert rank1 == worker_seed(3, 1) != 3
    assert len({worker_seed(3, r) for r in range(8)}) == 8


# ------------------------------------------------------------------------------------------------ weight decay
def test_prior_weight_decay_none_takes_the_optimizers_own(tmp_path):
    from functools import partial

    from lightning_maskprior.module import MaskPriorModule

    spec = BooleanGOTUDataModule("2parity", n=6).task_spec()
    backbone = partial(TokenTransformer, dim=16, depth=1, num_heads=3, head_dim=8, mlp_dim=16)
    optimizer = partial(torch.optim.Adam, lr=1e-3, weight_decay=1e-3)
    groups = {}
    for decay in (0.0, None):
        module = MaskPriorModule(backbone, init="mask", optimizer=optimizer, prior_weight_decay=decay, task=spec)
        groups[decay] = {g["name"]: g["weight_decay"] for g in module.configure_optimizers()["optimizer"].param_groups}
    assert groups[0.0] == {"network": 1e-3, "prior": 0.0}
    assert groups[None] == {"network": 1e-3, "prior": 1e-3}
    with pytest.raises(ValueError, match="prior_weight_decay"):
        MaskPriorModule(backbone, init="mask", prior_weight_decay=-1.0, task=spec)

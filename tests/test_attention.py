"""PriorAttention against a hand-written softmax reference."""

import pytest
import torch
import torch.nn.functional as F

from conftest import denormals
from lightning_maskprior.attention import PriorAttention, attention_probabilities, kernel_for, softmax_rows


def reference_attention(layer: PriorAttention, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v, written out by hand."""
    b, n, _ = x.shape
    h, d = layer.num_heads, layer.head_dim
    q, k, v = layer.qkv(x).split(layer.inner_dim, dim=-1)
    q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in (q, k, v))
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / d**0.5
    if layer.prior_logits is not None:
        logits = logits + torch.log(torch.sigmoid(layer.prior_scale * layer.prior_logits))
    if causal:
        logits = logits.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    probs = torch.exp(logits - logits.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    out = (probs @ v).transpose(1, 2).reshape(b, n, h * d)
    return layer.proj(out)


@pytest.mark.parametrize("heads_in_prior", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_values_and_prior_gradient_match_reference(heads_in_prior, causal):
    torch.manual_seed(0)
    layer = PriorAttention(dim=12, num_heads=3, head_dim=5, causal=causal).double()
    layer.set_prior(torch.randn(heads_in_prior, 7, 7) * 3, trainable=True, scale=1.5)
    x = torch.randn(4, 7, 12, dtype=torch.float64)
    out = layer(x)
    ref = reference_attention(layer, x, causal)
    torch.testing.assert_close(out, ref)
    grad = torch.autograd.grad(out.square().sum(), layer.prior_logits)[0]
    grad_ref = torch.autograd.grad(ref.square().sum(), layer.prior_logits)[0]
    torch.testing.assert_close(grad, grad_ref)
    assert grad.abs().sum() > 0


def test_no_prior_is_plain_sdpa():
    torch.manual_seed(0)
    layer = PriorAttention(dim=8, num_heads=2)
    x = torch.randn(2, 5, 8)
    q, k, v = layer.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    plain = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 8)
    torch.testing.assert_close(layer(x), layer.proj(plain))
    assert not any("prior" in name for name, _ in layer.named_parameters())


def test_strong_prior_restricts_attention_to_open_entries():
    torch.manual_seed(0)
    layer = PriorAttention(dim=8, num_heads=1)
    open = torch.eye(5, dtype=torch.bool)
    layer.set_prior(torch.where(open, 10.0, -10.0))
    (probs,) = attention_probabilities(layer, torch.randn(3, 5, 8))
    assert probs.shape == (3, 1, 5, 5)
    assert probs.diagonal(dim1=-2, dim2=-1).min() > 0.99


def test_recorded_probabilities_match_reference_softmax():
    torch.manual_seed(1)
    layer = PriorAttention(dim=8, num_heads=2, causal=True)
    layer.set_prior(torch.randn(2, 6, 6))
    x = torch.randn(2, 6, 8)
    (probs,) = attention_probabilities(layer, x)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 6))
    assert torch.all(probs.triu(1) == 0)


def test_prior_size_mismatch_names_both_sizes():
    layer = PriorAttention(dim=8, num_heads=2)
    layer.set_prior(torch.zeros(16, 16))
    with pytest.raises(ValueError, match="prior is 16x16 but the sequence has 15 tokens"):
        layer(torch.randn(1, 15, 8))


def test_prior_head_count_must_match():
    layer = PriorAttention(dim=8, num_heads=2)
    with pytest.raises(ValueError, match="3 heads but the layer has 2"):
        layer.set_prior(torch.zeros(3, 4, 4))


def test_fixed_prior_is_not_trained():
    layer = PriorAttention(dim=8, num_heads=2)
    layer.set_prior(torch.zeros(4, 4), trainable=False)
    assert not layer.prior_logits.requires_grad
    layer(torch.randn(1, 4, 8)).sum().backward()
    assert layer.prior_logits.grad is None


@pytest.mark.parametrize("with_prior", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_explicit_kernel_matches_sdpa_kernel(causal, with_prior):
    torch.manual_seed(2)
    layer = PriorAttention(dim=12, num_heads=3, causal=causal).double()
    if with_prior:
        layer.set_prior(torch.randn(3, 6, 6) * 2)
    params = [p for p in layer.parameters() if p.requires_grad]
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    outputs, grads = [], []
    for kernel in ("explicit", "sdpa"):
        layer.kernel = kernel
        out = layer(x)
        outputs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), params))
    torch.testing.assert_close(outputs[0], outputs[1])
    for explicit, fused in zip(*grads, strict=True):
        torch.testing.assert_close(explicit, fused)


def test_auto_kernel_is_explicit_on_cpu_in_both_dtypes_and_bad_kernel_is_named():
    assert kernel_for("cpu") == "explicit"
    assert kernel_for("cuda") == "sdpa"
    layer = PriorAttention(dim=8, num_heads=2)
    assert layer.kernel == "auto"
    with pytest.raises(ValueError, match="one of auto, sdpa, explicit, flex; got 'flash'"):
        layer.kernel = "flash"


def test_bf16_autocast_explicit_kernel_is_close_to_fp32():
    torch.manual_seed(0)
    layer = PriorAttention(dim=16, num_heads=2)
    layer.set_prior(torch.randn(2, 5, 5))
    x = torch.randn(3, 5, 16)
    reference = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = layer(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 31, 32, 40])
def test_softmax_rows_matches_torch_softmax_in_value_and_gradient(n, dtype):
    torch.manual_seed(n)
    logits = (torch.randn(4, 3, n, n) * 4).to(dtype)
    logits = logits.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))  # causal rows, as in LMs
    ours_in, torch_in = logits.clone().requires_grad_(), logits.double().requires_grad_()
    ours = softmax_rows(ours_in)
    expected = torch_in.softmax(-1)
    short = n < 16 or (n < 32 and dtype == torch.bfloat16)
    assert ours.dtype == (torch.float32 if short else dtype)  # short rows come back in float32
    tol = {"atol": 1e-6, "rtol": 1e-5} if ours.dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(ours.double(), expected, **tol)
    assert torch.isfinite(ours).all() and (ours[..., 0, 1:] == 0).all()  # masked entries get exactly zero
    upstream = torch.randn(4, 3, n, n)
    ours.backward(upstream.to(ours.dtype))
    expected.backward(upstream.double())
    grad_tol = tol if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # the gradient is in the input dtype
    torch.testing.assert_close(ours_in.grad.double(), torch_in.grad, **grad_tol)


def test_softmax_rows_leaves_float64_to_torch():
    logits = torch.randn(2, 7, dtype=torch.float64)
    assert softmax_rows(logits).dtype == torch.float64
    torch.testing.assert_close(softmax_rows(logits), logits.softmax(-1), rtol=0, atol=0)


def test_the_language_prior_never_makes_denormal_probabilities_and_changes_nothing_above_the_floor():
    # log sigmoid(10 M) with M = -distance is -90 at distance 9: exp() of it is a denormal float, which a CPU
    # computes several times slower. The attention floors the prior term (PRIOR_FLOOR) so no probability is one.
    from lightning_maskprior import priors
    from lightning_maskprior.attention import PRIOR_FLOOR

    torch.manual_seed(0)
    n = 16
    layer = PriorAttention(dim=16, num_heads=2, head_dim=8, causal=True, kernel="explicit")
    layer.set_prior(priors.causal_relative_distance(n).layer_values(0), scale=10.0)
    layer.record_attention = True
    x = torch.randn(8, n, 16)
    out = layer(x)
    assert denormals(layer.last_attention) == 0
    assert layer.prior_bias().min() < -100 and layer.attention_bias().min() == PRIOR_FLOOR
    torch.testing.assert_close(out, reference_attention(layer, x, causal=True), atol=1e-6, rtol=1e-5)
    grad = torch.autograd.grad(out.square().sum(), layer.prior_logits)[0]
    assert denormals(grad) == 0 and grad[0, 5, 4].abs() > 0  # an entry above the floor still learns

"""inject_prior in Hugging Face causal language models (GPT-2, Llama): the model's own attention code runs, the
outputs equal the untouched model's while the prior is neutral, causal and padding masks are kept, the gradient
reaches M, remove_prior gives the model back, and models that attend both ways are refused."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import denormals  # noqa: E402
from lightning_maskprior import attention_layers, export_prior, inject_prior, remove_prior  # noqa: E402
from lightning_maskprior.inject import HFPrior  # noqa: E402
from lightning_maskprior.priors import Structure  # noqa: E402

N, VOCAB = 16, 50


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=N, attn_pdrop=0.0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama():  # grouped-query attention: 4 query heads over 2 key/value heads
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=32, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=N,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "llama": llama}


def tokens(batch=2, length=12, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def language_structure(heads=1):
    """Token i attends to i and i-1 only (the causal mask closes the future anyway)."""
    near = torch.eye(N, dtype=torch.bool) | torch.eye(N, dtype=torch.bool).roll(-1, 1)
    return Structure(near.expand(1, heads, N, N).clone(), name="previous token")


@pytest.mark.parametrize("name", MODELS)
def test_outputs_are_the_untouched_models(name):
    model = MODELS[name]()
    untouched = copy.deepcopy(model)
    inject_prior(model)
    assert model.config._attn_implementation == "maskprior"
    layers = attention_layers(model)
    assert len(layers) == 2 and all(isinstance(layer, HFPrior) for layer in layers)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, untouched(x).logits, atol=1e-5, rtol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, theirs = model(x).logits.float(), untouched(x).logits.float()
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()


@pytest.mark.parametrize("name", MODELS)
def test_padding_and_the_causal_mask_are_kept(name):
    model = MODELS[name]()
    untouched = copy.deepcopy(model)
    inject_prior(model, language_structure(), init="mask")
    x = tokens()
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding in the first sequence
    with torch.no_grad():
        # With every entry open (M large), the prior is neutral: padded batches match the untouched model.
        for layer in attention_layers(model):
            layer.prior_logits.fill_(20.0)
        torch.testing.assert_close(model(x, attention_mask=mask).logits[0, 4:],
                                   untouched(x, attention_mask=mask).logits[0, 4:], atol=1e-4, rtol=1e-4)
        # A closing prior changes the outputs, but never lets a token see its future.
        inject_prior(model, language_structure(), init="mask")
        changed = x.clone()
        changed[:, 8] = (x[:, 8] + 1) % VOCAB
        before, after = model(x).logits, model(changed).logits
        torch.testing.assert_close(before[:, :8], after[:, :8])
        assert not torch.allclose(before[:, 8:], after[:, 8:])
        assert not torch.allclose(before, untouched(x).logits, atol=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_the_gradient_reaches_m_and_remove_prior_gives_the_model_back(name):
    model = MODELS[name]()
    untouched = copy.deepcopy(model)
    inject_prior(model, language_structure(), init="mask")
    priors = export_prior(model)
    assert [tuple(m.shape) for m in priors] == [(1, N, N)] * 2 and priors[0][0, 3, 2] == 10.0  # open: i -> i-1
    model.train()
    x = tokens()
    model(x, labels=x).loss.backward()
    for layer in attention_layers(model):
        assert layer.prior_logits.grad is not None and layer.prior_logits.grad.abs().sum() > 0
    remove_prior(model)
    assert not attention_layers(model) and model.config._attn_implementation == untouched.config._attn_implementation
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, untouched(x).logits)


def test_attention_is_recorded_for_the_callbacks():
    from lightning_maskprior.attention import attention_probabilities

    model = inject_prior(gpt2(), language_structure(), init="mask")
    probs = attention_probabilities(model, tokens(length=N))
    assert [tuple(p.shape) for p in probs] == [(2, 2, N, N)] * 2
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(2, 2, N))
    assert probs[0][0, 0].triu(1).abs().max() == 0  # causal
    assert probs[0][0, 0, 5, 4] > 0.4  # the open previous token takes a large share at init


def test_a_model_that_attends_both_ways_is_refused():
    config = transformers.BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                                     vocab_size=VOCAB)
    with pytest.raises(ValueError, match="BertModel is not a decoder-only causal model"):
        inject_prior(transformers.BertModel(config))


# ------------------------------------------------------------------ the structure-free and query/key inits
def backbone(model_type="gpt2", **config):
    from lightning_maskprior import priors
    from lightning_maskprior.models.hf import HFCausalLM
    from lightning_maskprior.objectives import LanguageModelObjective
    from lightning_maskprior.task import TaskSpec

    torch.manual_seed(0)
    spec = TaskSpec("lm", N, VOCAB, VOCAB, LanguageModelObjective(), priors.causal_relative_distance(N))
    return HFCausalLM(spec, model_type=model_type, dim=32, depth=2, num_heads=4, config=config)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_mimetic_writes_every_head_of_the_models_own_projections(model_type):
    """Wproj Wv = alpha Z - beta I (alpha = beta = 0.4, full rank at inner = dim) and every head's Wq, Wk, Wv
    and Wproj columns are live and get a gradient, written into GPT-2's Conv1D / Llama's q/k/v/o_proj."""
    from lightning_maskprior.inits import apply_init

    model = backbone(model_type)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    apply_init("mimetic", model, None)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert any("c_attn" in n or "q_proj" in n for n in changed) and any("c_proj" in n or "o_proj" in n for n in changed)
    model.model.train()
    model(tokens(batch=4, length=N)).logsumexp(-1).mean().backward()
    for layer in attention_layers(model):
        value, output = (w.detach() for w in layer.value_output_weights())
        product = output @ value
        assert product.diagonal().mean() == pytest.approx(-0.4, abs=0.05)
        assert (product - torch.diag(product.diagonal())).std() == pytest.approx(0.4 / 32**0.5, rel=0.2)
        per_head = [value.unflatten(0, (4, -1)).flatten(1), output.T.unflatten(0, (4, -1)).flatten(1),
                    *(w.flatten(1) for w in layer.query_key_weights()),
                    *(g.flatten(1) for g in layer.query_key_weights(grad=True))]
        assert all((w.norm(dim=1) > 0).all() for w in per_head)


def test_qk_svd_and_qk_opt_put_the_structure_into_gpt2s_query_key_weights():
    from lightning_maskprior.inits import apply_init, open_attention_mass

    structure = language_structure()
    x = tokens(batch=8, length=N)
    mass = {"default": open_attention_mass(backbone(), x, structure).mean()}
    for init, options in {"qk_svd": {}, "qk_opt": {"steps": 200, "lr": 1e-2, "fit_on": "inputs"}}.items():
        model = backbone()
        apply_init(init, model, structure, **options)
        mass[init] = open_attention_mass(model, x, structure).mean()
        assert all(layer.prior_logits is None for layer in attention_layers(model))  # the structure is in Wq, Wk
    assert mass["default"] < 0.5 < 0.8 < mass["qk_opt"] <= mass["qk_svd"]


def test_inits_that_the_model_cannot_carry_are_refused_by_name():
    from lightning_maskprior.inits import apply_init

    with pytest.raises(ValueError, match="LlamaForCausalLM does not have .*rotary"):
        apply_init("qk_svd", backbone("llama"), language_structure())
    with pytest.raises(ValueError, match="grouped-query attention .*2 key/value heads for 4 query heads"):
        apply_init("mimetic", backbone("llama", num_key_value_heads=2), None)


# ------------------------------------------------------------------ the backbone, through the command line
def hf_language(tmp_path):
    """The tiny pydoc run of the resume tests, with an HF decoder of two blocks as the backbone."""
    from test_resume import language

    return [*language(tmp_path), "--model.backbone", "lightning_maskprior.models.HFCausalLM",
            "--model.backbone.init_args.depth", "2"]


def pydoc_args(tmp_path, *extra):
    return ["fit", *hf_language(tmp_path), "--trainer.default_root_dir", str(tmp_path / "runs"), *extra]


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_maskprior_fit_trains_an_hf_decoder_with_the_language_prior(tmp_path, model_type):
    from lightning_maskprior import load_run
    from lightning_maskprior.cli import main
    from lightning_maskprior.run.tensorboard import read_scalars

    main(pydoc_args(tmp_path, "--model.backbone.init_args.model_type", model_type,
                    "--trainer.callbacks+=lightning_maskprior.callbacks.PriorPersistence",
                    "--trainer.callbacks.every_n_steps", "4", "--trainer.callbacks.probe_split", "val"))
    run = next((tmp_path / "runs").glob("*/version_0"))
    scalars = read_scalars(run)
    assert {"val/ppl", "val/loss"} <= set(scalars)
    # PriorPersistence reads the injected layers through the same interface as the project's own backbones
    for tag in ("open_mass", "prior_drift", "qk_drift", "grad_q", "grad_prior"):
        assert [step for step, _ in scalars[f"persistence/{tag}"]] == ([0, 4, 8] if tag[:4] != "grad" else [4, 8])
    assert scalars["persistence/qk_drift"][-1][1] > 0 and scalars["persistence/grad_q"][-1][1] > 0
    module, _ = load_run(run)
    layers = attention_layers(module)
    assert len(layers) == 2 and all(isinstance(layer, HFPrior) for layer in layers)
    assert layers[0].prior_scale == 10.0  # the language prior: log sigmoid(10 M), M_ij = -max(i - j, 0)
    torch.testing.assert_close(layers[0].prior_logits.detach()[0, 5, 3], torch.tensor(-2.0), atol=0.05, rtol=0)


def test_an_hf_decoder_fine_tunes_from_a_save_pretrained_directory(tmp_path, capsys):
    from lightning_maskprior import load_run
    from lightning_maskprior.cli import main

    source = gpt2()  # vocabulary 50: resized to the task's 300
    source.save_pretrained(tmp_path / "pretrained")
    main(pydoc_args(tmp_path, "--model.backbone.init_args.pretrained_path", str(tmp_path / "pretrained")))
    module, _ = load_run(next((tmp_path / "runs").glob("*/version_0")))
    model = module.backbone.model
    assert model.get_input_embeddings().num_embeddings == 300 and model.config.n_embd == 32  # the file's model
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(pydoc_args(tmp_path, "--model.backbone.init_args.pretrained_path", str(tmp_path / "nowhere")))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: pretrained_path") and err.endswith("(nothing is downloaded)")


def test_two_ddp_processes_validate_an_injected_hf_decoder_as_one_does(tmp_path):
    """The same seeded, mask-initialised HF decoder validated on the same split by one process and by two gloo
    processes (each half of the blocks): the logged validation loss is the same."""
    import subprocess
    import sys

    from conftest import CONFIGS, ROOT
    from lightning_maskprior.run.tensorboard import read_scalars

    losses = {}
    for name, extra in {"single": [], "ddp": ["-c", str(CONFIGS / "trainer/ddp.yaml")]}.items():
        args = pydoc_args(tmp_path / name, *extra, "--trainer.limit_val_batches", "1.0")  # every block, once
        args[0] = "validate"
        proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = read_scalars(next((tmp_path / name / "runs").glob("*/version_*")))["val/loss"][-1][1]
    assert losses["ddp"] == pytest.approx(losses["single"], rel=1e-5)


def test_an_injected_hf_decoder_resumes_exactly(tmp_path):
    """Stopped by SIGTERM mid-run and resumed with --ckpt_path last: every logged scalar is the uninterrupted run's
    (GPT-2's dropout draws from the restored RNG states)."""
    from test_resume import _signal_at, check_resume

    from lightning_maskprior.run import status

    check_resume(tmp_path, hf_language(tmp_path), _signal_at(4), status.EXIT_SIGTERM)


def test_the_overhead_benchmark_runs_on_an_hf_decoder():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("inject_overhead", ROOT / "benchmarks" / "inject_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ratios = module.main(["--family", "hf", "--depth", "1", "--block", "16", "--batch", "2", "--rounds", "2",
                          "--dtypes", "fp32"])
    assert set(ratios) == {("injected", "fp32"), ("injected + mask", "fp32")} and all(r > 0 for r in ratios.values())


def _language_gpt2():
    from lightning_maskprior import priors

    return inject_prior(gpt2(), priors.causal_relative_distance(N), init="mask", scale=10.0)


def test_on_a_cpu_the_prior_runs_the_explicit_kernel_like_the_projects_own_layers(monkeypatch):
    import lightning_maskprior.inject as inject

    x = tokens(length=N)

    def logits_and_grad(kernel: str, autocast: bool = False):
        monkeypatch.setattr(inject, "kernel_for", lambda device, dtype: kernel)
        model = _language_gpt2()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, labels=x)
        out.loss.backward()
        return out.logits.float(), attention_layers(model)[0].prior_logits.grad.clone()

    explicit, grad = logits_and_grad("explicit")
    sdpa, sdpa_grad = logits_and_grad("sdpa")
    torch.testing.assert_close(explicit, sdpa, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad, sdpa_grad, atol=1e-7, rtol=1e-4)
    # Under bf16 autocast the prior is summed with the logits in float32. What error is left in M's gradient comes
    # from the rest of the model running in bf16: 0.76% here, and 0.69% through SDPA, which adds the prior in bf16.
    _, low = logits_and_grad("explicit", autocast=True)
    assert ((low - grad).norm() / grad.norm()).item() < 0.015


def test_the_language_prior_in_an_hf_decoder_makes_no_denormal_probabilities():
    model = _language_gpt2()
    for layer in attention_layers(model):
        layer.record_attention = True
    model(tokens(length=N))
    for layer in attention_layers(model):
        probs = layer.last_attention.float()
        assert probs.max() > 0.5 and denormals(probs) == 0

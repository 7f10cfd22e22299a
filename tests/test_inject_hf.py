"""inject_prior in Hugging Face causal language models (GPT-2, Llama): the model's own attention code runs, the
outputs equal the untouched model's while the prior is neutral, causal and padding masks are kept, the gradient
reaches M, remove_prior gives the model back. The prior follows the tokens' positions through every KV cache, left
padding and generate, each tested family computes its own attention terms, unsupported ones are refused by name,
and save_pretrained / load_injected bring the prior back bit for bit."""

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
    priors = [prior.logits for prior in export_prior(model)]
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
    # every weight, the trained M included, is the checkpoint's
    from lightning_maskprior.run.rundir import find_checkpoint

    saved = torch.load(find_checkpoint(run), map_location="cpu", weights_only=False)["state_dict"]
    assert saved.keys() == module.state_dict().keys()
    assert all(torch.equal(value, saved[key]) for key, value in module.state_dict().items())


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


def test_a_pretrained_directory_with_a_weights_file_cut_short_is_one_line_naming_it(tmp_path, capsys):
    """transformers' loader raised a SafetensorError traceback ("incomplete metadata, file not fully covered")."""
    from lightning_maskprior.cli import main

    gpt2().save_pretrained(tmp_path / "pretrained")
    weights = tmp_path / "pretrained" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SystemExit) as exit_info:
        main(pydoc_args(tmp_path, "--model.backbone.init_args.pretrained_path", str(tmp_path / "pretrained")))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "SafetensorError" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: pretrained_path {weights} is incomplete: {len(whole) // 2} of the {len(whole)} "
                           "bytes its header describes"), last
    assert not (tmp_path / "runs").exists()


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
        monkeypatch.setattr(inject, "kernel_for", lambda device: kernel)
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


# ------------------------------------------------------------------ the prior at the tokens' positions
def random_prior(model, seed=0):
    """A different M for every layer, head and pair of positions (scale 2): a prior that no shift, slot order or
    dropped term leaves as it is, unlike the language prior, which depends on i - j alone."""
    generator = torch.Generator().manual_seed(seed)
    for layer in attention_layers(inject_prior(model)):
        layer.set_prior(2 * torch.randn(layer.num_heads, N, N, generator=generator), scale=2.0)
    return model


def mistral(**overrides):  # a sliding window of 4 tokens, grouped-query attention
    torch.manual_seed(0)
    config = transformers.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                        max_position_embeddings=N, sliding_window=4, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=0, **overrides)
    return transformers.MistralForCausalLM(config).eval()


CACHED = {"gpt2": gpt2, "llama": llama, "mistral": mistral}


def make_cache(model, kind):
    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=N)
    return transformers.DynamicCache(config=model.config)


def step_by_step(model, x, cache, prompt=4, step=1):
    """The logits of ``x`` decoded with ``cache``: the first ``prompt`` tokens at once, then ``step`` at a time."""
    with torch.no_grad():
        out = [model(x[:, :prompt], cache=cache, use_cache=True).logits]
        for start in range(prompt, x.shape[1], step):
            out.append(model(x[:, start:start + step], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.fixture(params=["explicit", "sdpa"])
def kernel(request, monkeypatch):
    """Both paths of the attention function: the explicit one (a CPU) and SDPA (elsewhere)."""
    import lightning_maskprior.inject as inject

    monkeypatch.setattr(inject, "kernel_for", lambda device: request.param)
    return request.param


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", CACHED)
def test_decoding_step_by_step_equals_one_forward_pass(name, cache, kernel):
    """A KV cache (dynamic, static; Mistral's sliding window of 4, so evicted slots too) gives every token the rows
    and columns of the prior a full forward pass gives it: the prior follows positions, not cache slots."""
    model = random_prior(CACHED[name]())
    x = tokens(length=N - 2)
    with torch.no_grad():
        full = model(x).logits
    for prompt, step in ((4, 1), (5, 3)):  # single tokens, and chunks of several after the prompt
        torch.testing.assert_close(step_by_step(model, x, make_cache(model, cache), prompt, step), full,
                                   atol=1e-5, rtol=1e-4)


def left_padded(lengths, seed=2):
    """Sequences of ``lengths``, left-padded to the longest; the mask, and the positions generate gives them."""
    rows = [tokens(1, n, seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    x = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, row in enumerate(rows):
        x[i, width - len(row):], mask[i, width - len(row):] = row, 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return rows, x, mask, positions


@pytest.mark.parametrize("name", CACHED)
def test_a_left_padded_batch_equals_its_sequences_unpadded(name, kernel):
    """Left padding shifts a sequence's slots, not its positions: each row's logits are those of the row alone,
    in one forward pass and decoded step by step with a cache."""
    model = random_prior(CACHED[name]())
    rows, x, mask, positions = left_padded([12, 7])
    with torch.no_grad():
        padded = model(x, attention_mask=mask, position_ids=positions).logits
        alone = [model(row[None]).logits[0] for row in rows]
    for i, row in enumerate(rows):
        torch.testing.assert_close(padded[i, x.shape[1] - len(row):], alone[i], atol=1e-5, rtol=1e-4)
    cache, decoded = make_cache(model, "dynamic"), []
    with torch.no_grad():
        for t in range(x.shape[1]):
            decoded.append(model(x[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                                 cache=cache, use_cache=True).logits)
    decoded = torch.cat(decoded, 1)
    torch.testing.assert_close(decoded[1, x.shape[1] - len(rows[1]):], alone[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_picks_the_same_tokens_with_any_cache_and_padding(name):
    """Greedy generate: no cache, a dynamic cache and a static one give the same tokens and the same scores, and a
    left-padded batch generates for each sequence what it generates alone."""
    model = random_prior(CACHED[name]())
    rows, x, mask, _ = left_padded([6, 3])
    options = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True,
               "pad_token_id": 0, "eos_token_id": None}
    runs = {"no cache": model.generate(x, attention_mask=mask, use_cache=False, **options),
            "dynamic": model.generate(x, attention_mask=mask, **options),
            "static": model.generate(x, attention_mask=mask, cache_implementation="static", **options)}
    for kind in ("dynamic", "static"):
        assert torch.equal(runs[kind].sequences, runs["no cache"].sequences), kind
        torch.testing.assert_close(torch.stack(runs[kind].logits), torch.stack(runs["no cache"].logits),
                                   atol=1e-5, rtol=1e-4)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **options)
        assert torch.equal(runs["dynamic"].sequences[i, x.shape[1]:], alone.sequences[0, len(row):])


def test_a_position_past_the_prior_is_refused_and_a_longer_cache_is_not():
    model = random_prior(llama())
    with pytest.raises(ValueError, match="prior is 16x16 but the attention sees a token at position 16 "):
        model(tokens(length=N + 1))
    x = tokens(length=8)
    with torch.no_grad():
        full = model(x).logits
        cache = transformers.StaticCache(config=model.config, max_cache_len=2 * N)  # more slots than the prior
        torch.testing.assert_close(step_by_step(model, x, cache), full, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ the tested families, and what is refused
def family(name):
    """A tiny model of each family inject_prior is tested on (the docs list them)."""
    torch.manual_seed(0)
    common = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
              "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": N, "bos_token_id": None,
              "eos_token_id": None, "pad_token_id": 0}
    configs = {
        "gpt2": lambda: gpt2().config,
        "llama": lambda: llama().config,
        "mistral": lambda: mistral().config,
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=8),
        "phi3": lambda: transformers.Phi3Config(**common),
        # a cap of 1 on logits of about 1: soft-capping changes the attention
        "gemma2": lambda: transformers.Gemma2Config(**common, head_dim=8, sliding_window=4, attn_logit_softcapping=1.0),
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, head_dim=8, sliding_window=4),
        "gpt_oss": lambda: transformers.GptOssConfig(**common, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                                                     sliding_window=4),
    }
    config = configs[name]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):  # GPT-OSS: sinks that take a share
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=torch.Generator().manual_seed(3)))
    return model


FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt_oss"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_tested_family_computes_its_own_attention_and_decodes_as_it_forwards(name, kernel):
    """Without a prior the injected model's logits are its own eager attention's (Gemma2's soft-capping, GPT-OSS's
    sinks included); with a random per-head prior, decoding step by step with a cache equals one forward pass."""
    untouched = family(name)
    model = inject_prior(copy.deepcopy(untouched))
    x = tokens(length=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, untouched(x).logits, atol=1e-5, rtol=1e-4)
    random_prior(model)
    with torch.no_grad():
        full = model(x).logits
    torch.testing.assert_close(step_by_step(model, x, make_cache(model, "dynamic")), full, atol=1e-5, rtol=1e-4)


def test_soft_capping_comes_before_the_prior():
    """Gemma2 with a prior: softmax(cap * tanh(q k^T s / cap) + mask + log sigmoid(s M)), recomputed here from the
    recorded inputs of the first layer."""
    model = random_prior(family("gemma2"))
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        attention.q_proj.weight.mul_(30)  # logits of several units, which a cap of 1 bends
    seen = {}
    hook = attention.register_forward_hook(lambda module, args, kwargs, out: seen.update(kwargs), with_kwargs=True)
    for layer in attention_layers(model):
        layer.record_attention = True
    x = tokens(batch=1, length=8)
    with torch.no_grad():
        model(x)
    hook.remove()
    hidden, (cos, sin) = seen["hidden_states"], seen["position_embeddings"]
    from transformers.models.gemma2.modeling_gemma2 import apply_rotary_pos_emb, repeat_kv

    shape = (1, 8, -1, 8)
    q = attention.q_proj(hidden).view(shape).transpose(1, 2)
    k = attention.k_proj(hidden).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = q @ repeat_kv(k, 2).transpose(-2, -1) * attention.scaling
    capped = torch.tanh(logits) * 1.0 + attention.maskprior.attention_bias()[:, :8, :8]
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    closed = (j > i) | (j <= i - 4)  # layer 0 is one of Gemma2's sliding-window layers (4 tokens)
    capped = capped.masked_fill(closed, float("-inf"))
    torch.testing.assert_close(attention.maskprior.last_attention, capped.softmax(-1), atol=1e-6, rtol=1e-5)


REFUSED = {
    "an encoder-decoder architecture": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2, vocab_size=VOCAB)),
    "an encoder-decoder architecture (BART)": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=VOCAB)),
    "cross-attention": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=N, add_cross_attention=True)),
    "ALiBi position biases": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        n_layer=1, n_head=2, hidden_size=16, vocab_size=VOCAB)),
    "ALiBi position biases (MPT)": lambda: transformers.MptForCausalLM(transformers.MptConfig(
        n_layers=1, n_heads=2, d_model=16, vocab_size=VOCAB, max_seq_len=N)),
    "ALiBi position biases (Falcon)": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, vocab_size=VOCAB, alibi=True)),
    "relative position biases of its own": lambda: transformers.CpmAntForCausalLM(transformers.CpmAntConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, dim_head=8, dim_ff=32, vocab_size=VOCAB,
        prompt_types=2, prompt_length=2, segment_types=2)),
    "attention both ways": lambda: transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=VOCAB)),
    "an attention it computes in its own code": lambda: transformers.BioGptForCausalLM(transformers.BioGptConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=VOCAB)),
}


@pytest.mark.parametrize("feature", REFUSED)
def test_an_attention_term_the_injected_attention_does_not_compute_is_refused_naming_model_and_term(feature):
    model = REFUSED[feature]()
    name = type(model).__name__
    with pytest.raises(ValueError, match=rf"^{name} uses {feature.split(' (')[0]}.*tested: GPT-2, Llama"):
        inject_prior(model)


def test_an_attention_argument_it_does_not_know_is_refused_by_name():
    """A model passing a term the attention function has never seen (T5-style relative biases) stops at the
    first forward pass instead of training without it."""
    from lightning_maskprior.inject import maskprior_attention

    model = inject_prior(llama())
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"LlamaAttention passes \['position_bias'\] to its attention function"):
        maskprior_attention(model.model.layers[0].self_attn, q, q, q, None, position_bias=torch.zeros(1, 4, 3, 3))


# ------------------------------------------------------------------ save_pretrained, load_injected
def test_save_pretrained_and_load_injected_give_the_same_model_in_a_fresh_process(tmp_path):
    """M (per head), its scale and its trainability come back from a save_pretrained directory in a new Python
    process, with bit-identical logits; from_pretrained alone gives the model without its prior."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    x = tokens(length=N)
    expected = {}
    for name in ("gpt2", "llama", "gemma2"):
        model = random_prior(family(name) if name == "gemma2" else MODELS[name]())
        first, second = attention_layers(model)
        first.set_prior(first.prior_logits, trainable=False, scale=10.0)
        model.save_pretrained(tmp_path / name)
        with torch.no_grad():
            expected[name] = model(x).logits
        assert json.loads((tmp_path / name / "config.json").read_text())["maskprior"] == {
            "0": {"scale": 10.0, "trainable": False}, "1": {"scale": 2.0, "trainable": True}}
    torch.save(x, tmp_path / "tokens.pt")
    script = (
        "import sys, torch\n"
        "from lightning_maskprior import export_prior\n"
        "from lightning_maskprior.inject import load_injected\n"
        "x = torch.load(sys.argv[1] + '/tokens.pt')\n"
        "for name in ('gpt2', 'llama', 'gemma2'):\n"
        "    model = load_injected(sys.argv[1] + '/' + name).eval()\n"
        "    priors = export_prior(model)\n"
        "    assert [(p.scale, p.trainable) for p in priors] == [(10.0, False), (2.0, True)], priors\n"
        "    with torch.no_grad():\n"
        "        torch.save(model(x).logits, sys.argv[1] + '/' + name + '.pt')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOAD REPORT" not in proc.stderr  # the saved priors are not reported as unexpected weights
    for name, logits in expected.items():
        assert torch.equal(torch.load(tmp_path / f"{name}.pt"), logits), name
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    with torch.no_grad():
        assert not torch.allclose(plain(x).logits, expected["llama"], atol=1e-3)


def test_load_injected_of_a_model_saved_without_a_prior_and_a_wrong_directory(tmp_path):
    from lightning_maskprior.inject import load_injected

    model = inject_prior(gpt2())
    model.save_pretrained(tmp_path / "plain")
    loaded = load_injected(tmp_path / "plain")
    assert [layer.prior_logits for layer in attention_layers(loaded)] == [None, None]
    assert loaded.config._attn_implementation == "maskprior"
    with pytest.raises(FileNotFoundError, match="nowhere is not a directory; load_injected expects one"):
        load_injected(tmp_path / "nowhere")
    weights = tmp_path / "plain" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # copied in part: a CheckpointError, not a SafetensorError
    with pytest.raises(ValueError, match=r"load_injected \S*model.safetensors is incomplete: \d+ of the \d+ bytes"):
        load_injected(tmp_path / "plain")


def test_load_injected_refuses_a_prior_that_is_not_finite_or_whose_scale_config_json_lacks(tmp_path):
    """A saved M holding NaN, or a config.json without the prior's scale, is refused naming the module: it would
    otherwise load and generate tokens (NaN), or run with scale 1 instead of the one it was saved with."""
    import json

    from lightning_maskprior.inject import load_injected

    model = random_prior(gpt2())
    model.save_pretrained(tmp_path / "no_scale")
    config = json.loads((tmp_path / "no_scale" / "config.json").read_text())
    del config["maskprior"]["1"]
    (tmp_path / "no_scale" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"records no scale for the prior of attention module 1 \(maskprior.1: None\)"):
        load_injected(tmp_path / "no_scale")
    with torch.no_grad():
        attention_layers(model)[0].prior_logits[0, 0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    with pytest.raises(ValueError, match=r"holds a prior that is not finite: .*prior_logits \(1 NaN, 0 infinite\)"):
        load_injected(tmp_path / "nan")

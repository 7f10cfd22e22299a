"""The batches users' own code builds, on an injected Hugging Face model: padding on either side with or without
position_ids and with any cache, packed sequences, PEFT (LoRA beside the prior, the adapter saved and loaded),
the state dict, refusals at injection, bookkeeping arguments, and compilation."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_inject_hf import VOCAB, N, gpt2, llama, mistral, random_prior, tokens  # noqa: E402

from lightning_maskprior import attention_layers, export_prior, inject_prior, remove_prior  # noqa: E402


def qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                      max_position_embeddings=N, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return transformers.Qwen2ForCausalLM(config).eval()


FOUR = {"gpt2": gpt2, "llama": llama, "mistral": mistral, "qwen2": qwen2}


def padded(lengths, side, seed=2):
    """Sequences of ``lengths`` padded on ``side`` to the longest, and their mask."""
    rows = [tokens(1, n, seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    x, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        x[i, where], mask[i, where] = row, 1
    return rows, x, mask


def real(logits, row, width, side):
    return logits[width - len(row):] if side == "left" else logits[:len(row)]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_left_padding_without_position_ids_gives_each_sequence_the_prior_it_gets_alone(name):
    """What evaluation harnesses do with rotary models: a left-padded batch and its mask, no position_ids (the
    model numbers the slots, which rotary positions do not see; the prior must not see them either). GPT-2's own
    learned positions need generate's position_ids (tests/test_inject_hf.py)."""
    model = random_prior(FOUR[name]())
    rows, x, mask = padded([12, 7], "left")
    with torch.no_grad():
        batch = model(x, attention_mask=mask).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(real(batch[i], row, x.shape[1], "left"), model(row[None]).logits[0],
                                       atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", FOUR)
def test_right_padding_with_a_static_cache_equals_the_same_call_without(name):
    """The last query of a right-padded row is a pad: the prior's columns must not shift with it."""
    model = random_prior(FOUR[name]())
    rows, x, mask = padded([12, 7], "right")
    with torch.no_grad():
        plain = model(x, attention_mask=mask).logits
        cache = transformers.StaticCache(config=model.config, max_cache_len=N)
        cached = model(x, attention_mask=mask, cache=cache, use_cache=True).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(cached[i, :len(row)], plain[i, :len(row)], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(plain[i, :len(row)], model(row[None]).logits[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_get_the_prior_each_gets_alone(name):
    """Packed sequences (position_ids that restart, no attention mask, no cache: a training batch), which
    transformers keeps apart in its mask: each gets the prior's rows and columns from its own first token."""
    model = random_prior(FOUR[name]())
    first, second = tokens(1, 9, 3)[0], tokens(1, 6, 4)[0]
    packed = torch.cat([first, second])[None]
    position_ids = torch.cat([torch.arange(9), torch.arange(6)])[None]
    with torch.no_grad():
        out = model(packed, position_ids=position_ids, use_cache=False).logits[0]
        torch.testing.assert_close(out[:9], model(first[None]).logits[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out[9:], model(second[None]).logits[0], atol=1e-5, rtol=1e-4)


def test_an_explicit_cache_position_is_accepted():
    """Bookkeeping arguments carry no term of attention: an explicit cache_position reaches the attention function
    (transformers 5.25 passes it through) and gives the logits of the call without it."""
    model = random_prior(llama())
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x, cache_position=torch.arange(x.shape[1])).logits, model(x).logits)


# ------------------------------------------------------------------ the state dict
@pytest.mark.parametrize("name", FOUR)
def test_the_state_dict_carries_scale_and_trainability_into_a_fresh_injected_model(name):
    model = random_prior(FOUR[name]())
    first = attention_layers(model)[0]
    first.set_prior(first.prior_logits, trainable=False, scale=7.0)
    fresh = inject_prior(FOUR[name]())
    fresh.load_state_dict(model.state_dict())  # strict: the scale and trainability keys are the layers'
    assert [(p.scale, p.trainable) for p in export_prior(fresh)] == [(7.0, False), (2.0, True)]
    x = tokens()
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)
    assert fresh.config.maskprior == {"0": {"scale": 7.0, "trainable": False}, "1": {"scale": 2.0, "trainable": True}}


# ------------------------------------------------------------------ PEFT
peft_cases = pytest.mark.parametrize("name", ["gpt2", "llama"])
TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}


def lora(model, name):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[name], modules_to_save=["maskprior"],
                             init_lora_weights=False)  # LoRA weights that change the logits
    return peft.get_peft_model(model, config)


@peft_cases
def test_under_peft_the_prior_acts_and_trains_beside_lora(name):
    model = random_prior(FOUR[name]())
    x = tokens()
    with torch.no_grad():
        before = model(x).logits
        without_prior = remove_prior(copy.deepcopy(model))(x).logits
    layers = len(attention_layers(model))
    peft_model = lora(model, name)
    with peft_model.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, before)  # the prior still acts inside PEFT's wrappers
        originals = [n for n, p in peft_model.named_parameters() if "original_module.prior_logits" in n]
        off = attention_layers(peft_model)  # the layers run with the adapter off: the originals
        assert all(layer.prior_logits is peft_model.get_parameter(n) for layer, n in zip(off, originals, strict=True))
    # what callbacks read: one prior a layer, the copy the adapter trains (not it and the original beside it)
    trained = [n for n, p in peft_model.named_parameters() if "modules_to_save.default.prior_logits" in n]
    running = attention_layers(peft_model)
    assert len(running) == len(trained) == layers
    assert all(layer.prior_logits is peft_model.get_parameter(n) for layer, n in zip(running, trained, strict=True))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable)
    assert any(n.endswith("maskprior.modules_to_save.default.prior_logits") for n in trainable)
    peft_model.train()
    peft_model(x, labels=x).loss.backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "prior_logits" in n)
    with torch.no_grad():
        assert not torch.allclose(peft_model(x).logits, without_prior, atol=1e-3)


@peft_cases
def test_a_peft_adapter_with_its_prior_loads_onto_a_freshly_injected_base(name, tmp_path):
    peft = pytest.importorskip("peft")
    peft_model = lora(random_prior(FOUR[name]()), name)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "modules_to_save" in n and "prior_logits" in n:
                p.add_(torch.randn_like(p))  # a trained M, other than the base's
    peft_model.save_pretrained(tmp_path)
    x = tokens()
    with torch.no_grad():
        expected = peft_model(x).logits
    base = inject_prior(FOUR[name]())
    for layer in attention_layers(base):  # the recipe: a base with a prior of the same size (any values, any scale)
        layer.set_prior(torch.zeros(1, N, N))
    loaded = peft.PeftModel.from_pretrained(base, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, expected)


def test_a_deep_copy_of_a_prior_serves_the_same_attention_module_and_a_copied_model_its_own():
    model = random_prior(llama())
    prior = model.model.layers[0].self_attn.maskprior
    assert copy.deepcopy(prior).attention_module() is prior.attention_module()
    copied = copy.deepcopy(model)
    assert copied.model.layers[0].self_attn.maskprior.attention_module() is copied.model.layers[0].self_attn


# ------------------------------------------------------------------ refused at injection, and remove_prior
def test_gpt_bigcode_multi_query_attention_carries_a_prior_through_its_cache():
    from test_inject_hf import make_cache, step_by_step

    untouched = transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
        n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=N, bos_token_id=0, eos_token_id=0)).eval()
    model = inject_prior(copy.deepcopy(untouched))
    x = tokens(length=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, untouched(x).logits, atol=1e-5, rtol=1e-4)
        random_prior(model)
        full = model(x).logits
    assert not torch.allclose(full, untouched(x).logits, atol=1e-3)
    torch.testing.assert_close(step_by_step(model, x, make_cache(model, "dynamic")), full, atol=1e-5, rtol=1e-4)


LATE = {
    "BertLMHeadModel": lambda: transformers.BertLMHeadModel(transformers.BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=VOCAB,
        is_decoder=True)),
}


@pytest.mark.parametrize("name", LATE)
def test_a_model_whose_forward_cannot_run_the_injected_attention_is_refused_at_injection(name):
    model = LATE[name]()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=rf"^{name} cannot run the injected prior's attention"):
        inject_prior(model)
    assert model.config._attn_implementation == before and not attention_layers(model)


def test_flash_attention_is_switched_with_one_warning_and_remove_prior_is_all_or_nothing():
    model = llama()
    model.config._attn_implementation = "flash_attention_2"  # flash-attn itself need not be installed
    with pytest.warns(UserWarning, match="was set to flash_attention_2, which cannot add a prior"):
        random_prior(model)
    assert model.config._attn_implementation == "maskprior"
    x = tokens()
    with torch.no_grad():
        expected = model(x).logits
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="remove_prior cannot set LlamaForCausalLM's attention back to flash"):
            remove_prior(model)
        assert len(attention_layers(model)) == 2 and model.config._attn_implementation == "maskprior"
        with torch.no_grad():
            assert torch.equal(model(x).logits, expected)  # nothing was taken out


# ------------------------------------------------------------------ compilation
def test_the_positions_need_no_host_synchronisation_and_never_leave_the_prior():
    """The prior's rows and columns compile into one graph (no value read back to the host), and a position past
    the prior is clamped inside it: no out-of-range read, whatever the caller passes."""
    from lightning_maskprior.inject import _prior_at_positions

    bias = torch.randn(2, N, N)
    q = torch.randn(1, 2, 3, 8)
    k = torch.randn(1, 2, 5, 8)
    compiled = torch.compile(_prior_at_positions, fullgraph=True, backend="eager")
    positions = torch.tensor([[N + 5, N + 6, N + 7]])
    out = compiled(bias, q, k, None, positions)
    assert out.shape == (1, 2, 3, 5) and torch.equal(out[0, :, -1, -1], bias[:, N - 1, N - 1])


def test_a_compiled_injected_model_gives_the_eager_logits_and_refuses_a_position_past_the_prior():
    model = random_prior(llama())
    x = tokens()
    with torch.no_grad():
        expected = model(x).logits
        compiled = torch.compile(model, backend="aot_eager")
        torch.testing.assert_close(compiled(x).logits, expected, atol=1e-5, rtol=1e-4)
        with pytest.raises(ValueError, match="prior is 16x16 but the attention sees a token at position 16 "):
            compiled(tokens(length=N + 1))


@pytest.mark.slow
def test_inductor_compiles_an_injected_model_for_inference():
    model = random_prior(llama())
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(x).logits, model(x).logits, atol=1e-4, rtol=1e-4)

"""inject_prior: a learnable prior in a timm model that already exists, its outputs unchanged while the prior is
neutral, the gradient reaching M, the inverse, refusals naming the class, and fine-tuning from a file on disk."""

import copy

import pytest
import timm
import torch
from torch import nn

from lightning_maskprior import Structure, attention_layers, export_prior, inject_prior, remove_prior
from lightning_maskprior.attention import PriorAttention
from lightning_maskprior.inject import InjectedAttention

SMALL = {"img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 5}  # 16 patches


def build(name="vit_tiny_patch16_224", **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**SMALL, **kwargs}).eval()


MODELS = {
    "vit": lambda: build(),
    "deit": lambda: build("deit_tiny_patch16_224"),
    "registers, avg pool": lambda: build(reg_tokens=4, class_token=False, global_pool="avg", no_embed_class=True),
    "qkv bias off": lambda: build(qkv_bias=False),
}


def images(n=3):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", MODELS)
def test_outputs_are_the_untouched_models(name):
    model = MODELS[name]()
    untouched = copy.deepcopy(model)
    inject_prior(model)
    layers = attention_layers(model)
    assert len(layers) == 2 and all(isinstance(layer, InjectedAttention) for layer in layers)
    assert all(layer.prior_logits is None for layer in layers)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x), atol=1e-5, rtol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, theirs = model(x).float(), untouched(x).float()
    # bf16: both round to 8 bits of mantissa (ours keeps the softmax in float32), so they agree to bf16's precision
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()


def test_an_open_prior_changes_nothing_and_the_gradient_reaches_m():
    model = build()
    untouched = copy.deepcopy(model)
    tokens = 1 + 16  # CLS + patches
    everything = Structure(torch.ones(1, 1, tokens, tokens, dtype=torch.bool), name="all open")
    inject_prior(model, everything, init="mask", open_value=10.0, closed_value=-10.0)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x), atol=1e-5, rtol=1e-5)  # a constant per row: no change

    model = build()
    tokens_open = torch.eye(tokens, dtype=torch.bool) | torch.eye(tokens, dtype=torch.bool).roll(1, 1)
    tokens_open[0] = True  # the CLS row attends to everything
    inject_prior(model, Structure(tokens_open[None, None], name="neighbours"), init="mask")
    priors = [prior.logits for prior in export_prior(model)]
    assert [tuple(m.shape) for m in priors] == [(1, tokens, tokens)] * 2
    assert priors[0][0, 1, 2] == 10.0 and priors[0][0, 1, 5] == -10.0  # the task's open and closed values
    model.train()
    model(x).square().mean().backward()
    for layer in attention_layers(model):
        assert layer.prior_logits.grad is not None and layer.prior_logits.grad.abs().sum() > 0


def test_remove_prior_gives_back_the_models_own_attention():
    model = build()
    untouched = copy.deepcopy(model)
    inject_prior(model)
    with torch.no_grad():
        attention_layers(model)[0].proj.bias.add_(0.5)  # a fine-tuned weight travels back
        untouched.blocks[0].attn.proj.bias.add_(0.5)
    remove_prior(model)
    assert not attention_layers(model)
    assert all(type(block.attn) is timm.layers.Attention for block in model.blocks)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x))
    assert sorted(model.state_dict()) == sorted(untouched.state_dict())


def test_injecting_twice_is_harmless():
    model = inject_prior(build())
    first = [id(layer) for layer in attention_layers(model)]
    inject_prior(model)
    assert [id(layer) for layer in attention_layers(model)] == first


def test_a_structure_of_the_wrong_size_is_refused_when_installed():
    model = build()  # 1 class token + 16 patches
    before = copy.deepcopy(model.state_dict())
    message = r"is 16x16 but VisionTransformer attends over 17 tokens \(1 prefix \+ 16 patches\)"
    with pytest.raises(ValueError, match=message):
        inject_prior(model, Structure(torch.eye(16, dtype=torch.bool)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
    inject_prior(build(), Structure(torch.eye(16, dtype=torch.bool)).pad(1))  # the right size installs


def test_unsupported_attention_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"blocks\.0\.attn \(timm\.layers\.attention\.Attention\) uses \['qk_norm'\]"):
        inject_prior(build(qk_norm=True))

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = nn.MultiheadAttention(8, 2, batch_first=True)

    with pytest.raises(ValueError, match=r"mixer is a torch\.nn\.modules\.activation\.MultiheadAttention, an "
                                         r"attention module inject_prior cannot carry a prior in"):
        inject_prior(Custom())
    with pytest.raises(ValueError, match="Sequential has no attention layer inject_prior can carry a prior in"):
        inject_prior(nn.Sequential(nn.Linear(4, 4)))


def test_prior_attention_layers_are_kept():
    layer = PriorAttention(8, 2)
    holder = nn.Sequential(layer)
    inject_prior(holder)
    assert holder[0] is layer


# ------------------------------------------------------------------ the backbone: from a checkpoint on disk
def test_vision_transformer_fine_tunes_from_a_checkpoint_file(tmp_path):
    from lightning_maskprior.datamodules import DigitsDataModule
    from lightning_maskprior.models import VisionTransformer

    task = DigitsDataModule(img_size=32, patch_size=8).task_spec()
    kwargs = {"depth": 2}
    torch.manual_seed(1)
    source = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, in_chans=1, num_classes=7, **kwargs)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    backbone = VisionTransformer(task, model_kwargs=kwargs, checkpoint_path=str(path))
    ours, theirs = backbone.model.state_dict(), source.state_dict()
    assert all(isinstance(layer, InjectedAttention) for layer in attention_layers(backbone))
    for key in ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.1.attn.proj.bias", "pos_embed"):
        torch.testing.assert_close(ours[key], theirs[key])
    assert ours["head.weight"].shape[0] == 10  # digits has 10 classes: the classifier is new
    with pytest.raises(FileNotFoundError, match="checkpoint_path .*nowhere.pth does not exist"):
        VisionTransformer(task, model_kwargs=kwargs, checkpoint_path=str(tmp_path / "nowhere.pth"))


def test_the_cli_fine_tunes_a_timm_checkpoint_with_a_mask_prior(tmp_path, capsys):
    """maskprior fit -c vision/digits.yaml --model.backbone.init_args.checkpoint_path FILE: trains, logs the prior's
    persistence, reopens with load_run; a missing file is one line and exit 2."""
    from conftest import CONFIGS
    from lightning_maskprior import load_run
    from lightning_maskprior.cli import main

    kwargs = {"embed_dim": 24, "depth": 1, "num_heads": 3}
    source = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=1, num_classes=10,
                               **kwargs)
    path = tmp_path / "pretrained.pth"
    torch.save(source.state_dict(), path)
    args = ["fit", "-c", str(CONFIGS / "vision" / "digits.yaml"), "-c", str(CONFIGS / "init" / "mask.yaml"),
            "--data.init_args.max_train_size", "16", "--data.init_args.test_size", "16",
            "--data.init_args.img_size", "16", "--data.init_args.batch_size", "8",
            "--model.backbone.init_args.model_kwargs", str(kwargs).replace("'", '"'),
            "--trainer.max_epochs", "1", "--trainer.check_val_every_n_epoch", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.default_root_dir", str(tmp_path / "runs")]
    main([*args, "--model.backbone.init_args.checkpoint_path", str(path)])
    run_dir = next((tmp_path / "runs").rglob("version_0"))
    from lightning_maskprior.run.tensorboard import read_scalars

    assert {"val/top1", "persistence/score", "persistence/prior_drift"} <= set(read_scalars(run_dir))  # callbacks
    path.rename(tmp_path / "moved.pth")  # reopening needs only the run's own checkpoint
    module, _ = load_run(run_dir)
    layers = attention_layers(module)
    assert len(layers) == 1 and isinstance(layers[0], InjectedAttention) and layers[0].prior_logits is not None
    torch.testing.assert_close(module.backbone.model.patch_embed.proj.weight, source.patch_embed.proj.weight,
                               atol=0.05, rtol=0)  # started from the file; one epoch of fine-tuning moved it a bit
    assert not torch.equal(module.backbone.model.patch_embed.proj.weight, source.patch_embed.proj.weight)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--model.backbone.init_args.checkpoint_path", str(tmp_path / "missing.pth")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: checkpoint_path") and "missing.pth does not exist" in err[-1]


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_checkpoint_path_cut_short_is_one_line_naming_it(tmp_path, capsys, suffix):
    """A pretrained file copied in part: one line naming it as incomplete, exit 2 (timm's loader raised a
    traceback: a zip's central directory or a safetensors header it cannot read)."""
    from safetensors.torch import save_file

    from conftest import CONFIGS
    from lightning_maskprior.cli import main

    source = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=1, num_classes=10,
                               embed_dim=24, depth=1, num_heads=3)
    path = tmp_path / f"pretrained{suffix}"
    if suffix == ".pth":
        torch.save(source.state_dict(), path)
    else:
        save_file(source.state_dict(), str(path))
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) * 3 // 4])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "vision" / "digits.yaml"), "--data.init_args.img_size", "16",
              "--model.backbone.init_args.model_kwargs", '{"embed_dim": 24, "depth": 1, "num_heads": 3}',
              "--model.backbone.init_args.checkpoint_path", str(path),
              "--trainer.default_root_dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "zipfile" not in err and "SafetensorError" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: checkpoint_path {path} is incomplete: ")
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ the prior through a state dict
def random_prior(heads, tokens, seed=0):
    """A different M for every head and pair of positions: a prior no shift or reindexing leaves as it is."""
    return 4 * torch.randn(heads, tokens, tokens, generator=torch.Generator().manual_seed(seed))


def test_a_state_dict_brings_m_and_its_scale_back_into_a_fresh_model():
    """timm.create_model + inject_prior + load_state_dict: the prior a trained model had (per head, scaled), with
    the same outputs; a model whose prior is unscaled keeps the state dict's keys it always had."""
    model = inject_prior(build())
    for layer in attention_layers(model):
        layer.set_prior(random_prior(3, 17), scale=2.5)
    state = model.state_dict()
    assert state["blocks.0.attn.prior_scale"] == 2.5 and state["blocks.0.attn.prior_logits"].shape == (3, 17, 17)
    fresh = inject_prior(build())
    fresh.load_state_dict(state)  # strict: every key is taken
    for ours, theirs in zip(export_prior(fresh), export_prior(model), strict=True):
        assert torch.equal(ours.logits, theirs.logits) and ours.scale == 2.5 and ours.trainable
    x = images()
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    unscaled = inject_prior(build(), Structure(torch.ones(1, 1, 17, 17, dtype=torch.bool), name="all open"))
    assert not any(key.endswith("prior_scale") for key in unscaled.state_dict())


def test_export_prior_and_set_prior_round_trip_m_its_scale_and_trainability():
    from lightning_maskprior.inject import set_prior

    model = inject_prior(build())
    first, second = attention_layers(model)
    first.set_prior(random_prior(3, 17), trainable=False, scale=10.0)
    exported = export_prior(model)
    assert exported[1] is None and exported[0].scale == 10.0 and not exported[0].trainable
    other = inject_prior(build())
    set_prior(other, exported)
    again = export_prior(other)
    assert again[1] is None and torch.equal(again[0].logits, exported[0].logits)
    assert again[0].scale == 10.0 and not again[0].trainable
    second.set_prior(*exported[0])  # one layer's prior, as a layer takes it
    assert second.prior_scale == 10.0 and torch.equal(second.prior_logits, first.prior_logits)
    with pytest.raises(ValueError, match="1 priors for the 2 attention layers of VisionTransformer"):
        set_prior(other, exported[:1])

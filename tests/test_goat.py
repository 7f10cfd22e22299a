"""GOAT attention (goat-attention) as the token transformer's attention: it trains through the CLI, the callbacks
record and measure it like any other layer, and the init methods that write a prior or Wq/Wk refuse it."""

import pytest

pytest.importorskip("goat")

import torch  # noqa: E402

from conftest import CONFIGS, TINY_BOOLEAN  # noqa: E402
from lightning_maskprior.cli import main  # noqa: E402

GOAT = ["--model.backbone.init_args.attention", "goat", "--model.backbone.init_args.num_heads", "1",
        "--model.backbone.init_args.dim", "32"]


def test_a_goat_token_transformer_trains_and_the_callbacks_measure_it(tmp_path):
    from lightning_maskprior import attention_layers, load_run
    from lightning_maskprior.models.goat import GoatLayer
    from lightning_maskprior.run.tensorboard import read_scalars

    main(["fit", "-c", str(CONFIGS / "boolean/majority3.yaml"), *TINY_BOOLEAN, *GOAT, "--trainer.max_epochs", "2",
          "--trainer.check_val_every_n_epoch", "1", "--trainer.callbacks.every_n_steps", "2",
          "--trainer.default_root_dir", str(tmp_path)])
    run = next(tmp_path.glob("*/version_0"))
    scalars = read_scalars(run)
    assert "val/acc" in scalars and scalars["persistence/open_mass"][0][0] == 0
    assert "persistence/qk_drift" not in scalars and "persistence/prior_drift" not in scalars
    module, _ = load_run(run)
    layers = attention_layers(module)
    assert len(layers) == 2 and all(isinstance(layer, GoatLayer) for layer in layers)


@pytest.mark.parametrize("extra, message", [
    (["--model.init", "mask"], "a GOAT attention layer learns its own prior from scratch and carries no M"),
    (["--model.backbone.init_args.num_heads", "3"], "attention goat: dim 32 is not divisible by num_heads 3"),
    (["--model.backbone.init_args.num_heads", "2"], r"head_dim=16 too small for pos_dim=17"),
])
def test_what_goat_cannot_do_fails_naming_it(tmp_path, capsys, extra, message):
    import re

    with pytest.raises(SystemExit) as info:
        main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), *TINY_BOOLEAN, *GOAT, *extra,
              "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and re.search(message, err) and "Traceback" not in err


def test_a_goat_run_is_measured_against_the_union_of_a_structure_with_other_heads():
    """ThreeSym's structure has one pair in each of 3 heads; GOAT needs a head count that divides the width. A run
    that does not place the structure only measures against it: the union over its heads. An init that places it
    still refuses the mismatch."""
    from functools import partial

    from lightning_maskprior.datamodules import BooleanGOTUDataModule
    from lightning_maskprior.models import TokenTransformer
    from lightning_maskprior.module import MaskPriorModule

    task = BooleanGOTUDataModule("threesym", n=6).task_spec()
    goat = partial(TokenTransformer, dim=32, depth=1, num_heads=1, head_dim=32, mlp_dim=32, attention="goat")
    module = MaskPriorModule(goat, init="default", task=task)
    union = module.structure.layer(0)
    assert union.shape[0] == 1 and all(union[0, i, j] for i, j in [(0, 1), (1, 2), (0, 2)])
    assert torch.equal(union[0], task.structure.open.any(dim=1)[0])
    plain = partial(TokenTransformer, dim=32, depth=1, num_heads=2, head_dim=16, mlp_dim=32)
    with pytest.raises(ValueError, match="has 3 heads but the model has 2"):
        MaskPriorModule(plain, init="mask", task=task)

"""GOAT attention (goat-attention) as the token transformer's attention: it trains through the CLI, the callbacks
record and measure it like any other layer, and the init methods that write a prior or Wq/Wk refuse it."""

import pytest

pytest.importorskip("goat")

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

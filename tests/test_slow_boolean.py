"""The paper's Table 1 pattern at CPU scale (slow: minutes each; run with ``pytest -m slow``)."""

import pytest

from conftest import CONFIGS
from lightning_maskprior.cli import main
from lightning_maskprior.run.tensorboard import last_scalars

pytestmark = pytest.mark.slow

# task -> (mask accuracy at least, the MDI's accuracy that the default should end at)
EXPECTED = {"2parity": (1.0, 0.75), "majority3": (1.0, 0.875)}


@pytest.mark.parametrize("task", sorted(EXPECTED))
def test_mask_extrapolates_and_default_stays_at_the_mdi(task, tmp_path):
    results = {}
    for init in ("mask", "default"):
        root = tmp_path / init
        main(["fit", "-c", str(CONFIGS / f"boolean/{task}.yaml"), "-c", str(CONFIGS / f"init/{init}.yaml"),
              "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root)])
        results[init] = last_scalars(next(root.glob("*/version_*")), "val/")
    mask_acc, mdi_acc = EXPECTED[task]
    assert results["mask"]["val/acc"] >= mask_acc
    assert results["mask"]["val/mse"] < 0.05
    assert results["default"]["val/mdi_acc"] == pytest.approx(mdi_acc)
    assert results["default"]["val/acc"] == pytest.approx(mdi_acc, abs=0.01)

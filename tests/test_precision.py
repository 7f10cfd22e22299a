"""bf16 on CPUs with native bf16, fp32 elsewhere, and the run's config says which."""

from __future__ import annotations

import pytest
import yaml

from conftest import TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.run import precision


@pytest.mark.parametrize(("accelerator", "asked", "support", "expected"), [
    ("cpu", "bf16-mixed", "AVX512-BF16", "bf16-mixed"),
    ("cpu", "bf16-mixed", None, "32-true"),
    ("cpu", "bf16-true", None, "32-true"),
    ("cpu", "32-true", None, "32-true"),
    ("cpu", "16-mixed", None, "16-mixed"),
    ("gpu", "bf16-mixed", None, "bf16-mixed"),
    ("cuda", "bf16-mixed", None, "bf16-mixed"),
])
def test_resolve_falls_back_only_for_bf16_on_a_cpu_without_it(monkeypatch, accelerator, asked, support, expected):
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: support)
    chosen, line = precision.resolve(accelerator, asked)
    assert chosen == expected
    if asked.startswith("bf16") and accelerator == "cpu":
        assert (support or "no native bf16") in line
        assert "32-true" in line
    else:
        assert line is None


def test_this_cpu_is_detected_as_the_kernel_reports_it():
    flags = open("/proc/cpuinfo", encoding="utf-8").read().split()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert (precision.cpu_bf16_support() is not None) >= native  # oneDNN may know more than the x86 flags


@pytest.mark.parametrize("support", ["AVX512-BF16", None])
def test_fit_logs_and_records_the_precision_it_used(tmp_path, monkeypatch, caplog, support):
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: support)
    main(["fit", "-c", "boolean/2parity.yaml", "-c", "init/mask.yaml", *TINY_BOOLEAN,
          "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path)])
    (config,) = tmp_path.glob("*/*/config.yaml")
    used = yaml.safe_load(config.read_text())["trainer"]["precision"]
    assert used == ("bf16-mixed" if support else "32-true")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision bf16-mixed")]
    assert len(said) == 1 and ("native bf16 (AVX512-BF16)" if support else "running in 32-true") in said[0]

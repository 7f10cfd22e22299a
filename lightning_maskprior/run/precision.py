"""bf16 on the CPU when it has native bf16, fp32 when it does not, and a line in the log saying which.

The CPU configs ask for ``trainer.precision: bf16-mixed``: bfloat16 autocast, fp32 weights, optimizer and
metrics. On a CPU with native bf16 instructions (x86 AVX512-BF16 or AMX, Arm with bf16 in oneDNN) that runs a
training step about 2x faster than fp32 (``benchmarks/step_speed.py``). Elsewhere bf16 is emulated and slower
than fp32, so such a run falls back to ``32-true``. ``--trainer.precision 32-true`` asks for fp32 explicitly.
"""

from __future__ import annotations

import functools
import warnings

import torch

# Lightning's model summary cannot size bf16-mixed parameters and warns on every fit; the sizes it prints
# (fp32 weights) are right for mixed precision anyway.
warnings.filterwarnings("ignore", message=r"Precision bf16-mixed is not supported by the model summary")

BF16_PRECISIONS = ("bf16-mixed", "bf16", "bf16-true")
FALLBACK = "32-true"


@functools.cache
def cpu_bf16_support() -> str | None:
    """The name of this CPU's native bf16 support (``AVX512-BF16``, ``AMX``, ``oneDNN bf16``), or None."""
    checks = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    for name, probe in checks:
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return name
        except RuntimeError:  # a build without the probe's backend
            pass
    try:  # oneDNN knows about Arm (and other) bf16 units the x86 probes do not
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "oneDNN bf16"
    except (AttributeError, RuntimeError):
        pass
    return None


def runs_on_cpu(accelerator: object) -> bool:
    """Whether a Trainer with this ``accelerator`` setting (``cpu``, ``auto``, ``gpu``...) computes on the CPU."""
    name = "auto" if accelerator is None else str(accelerator).lower()
    if name == "auto":
        mps = getattr(torch.backends, "mps", None)
        return not torch.cuda.is_available() and not (mps is not None and mps.is_available())
    return "cpu" in name  # "cpu", or a CPUAccelerator instance / class path


def resolve(accelerator: object, precision: object) -> tuple[object, str | None]:
    """``(precision to use, a line for the log)``: bf16 on a CPU without native bf16 becomes ``32-true``."""
    if str(precision) not in BF16_PRECISIONS or not runs_on_cpu(accelerator):
        return precision, None
    support = cpu_bf16_support()
    if support is not None:
        return precision, (f"precision {precision}: this CPU has native bf16 ({support}); "
                           f"--trainer.precision {FALLBACK} runs in fp32")
    return FALLBACK, (f"precision {precision} asked for, but this CPU has no native bf16 (neither AVX512-BF16, "
                      f"AMX nor oneDNN bf16): running in {FALLBACK}, which is faster here than emulated bf16")

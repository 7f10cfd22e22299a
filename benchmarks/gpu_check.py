"""A GPU check of the paper-scale configs, in one command and under 10 minutes: does the prior's gradient path run
where it should, how fast is a step, how much memory does it take?

    python benchmarks/gpu_check.py                          # on CUDA: every paper-scale config whose data is here
    python benchmarks/gpu_check.py --steps 100 --json out.json
    python benchmarks/gpu_check.py --cifar_root data/cifar --wikitext_dir data/wikitext-2-raw
    python benchmarks/gpu_check.py --tiny                   # on the CPU, tiny models (what the tests run)

It reports, in this order:

1. **The prior's gradient path.** A ``PriorAttention`` layer with a grad-requiring prior under bf16 autocast: the
   fused SDPA kernel restricted to the memory-efficient backend (the fused kernel that can return the gradient of
   an additive mask, which must then be in the query's dtype; flash and cuDNN cannot) must run, and agree with the
   explicit kernel (float32 logits + prior) in the output and in the gradient of M. ``--tiny`` checks the same
   pair on the CPU with SDPA's math backend.
2. **The relative prior through FlexAttention.** A causal ``PriorAttention`` layer with a ``relative`` prior (the
   language prior, one value per head and offset) through the ``flex`` kernel (``score_mod`` reading the offsets'
   table, compiled) against the explicit kernel, in the output and in the gradient of the table, in float32 and
   under bf16 autocast. ``--tiny`` checks the output only: FlexAttention has no backward on a CPU.
3. **Each config, a few hundred optimizer steps in bf16** with the mask init, as ``maskprior fit`` builds it: ms per
   step (after warm-up, synchronised), the FLOPs of one step (counted by ``torch.utils.flop_counter``), the achieved
   TFLOP/s against this device's measured bf16 matmul peak (and the nominal dense bf16 peak of known GPUs), and the
   peak memory allocated.
4. **A 2-GPU DDP step** when more than one CUDA device is visible: ``maskprior fit`` of the Boolean paper config on
   two GPUs for a few steps, its exit code and wall time.

Configs whose data is not on this machine (CIFAR-10, WikiText-2) are skipped and named. The exit code is 0 when
every check passed, 1 when one failed (the failing line says which and by how much).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_maskprior.attention import PriorAttention
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import config_files
from lightning_maskprior.run.cli import MaskPriorCLI

# Nominal dense bf16 tensor-core peaks (TFLOP/s, no sparsity), by a substring of torch.cuda.get_device_name().
NOMINAL_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                       "RTX 4090": 165.0, "RTX 6000 Ada": 364.0, "A6000": 155.0}


@dataclass
class Config:
    name: str
    config: str
    extra: list[str] = field(default_factory=list)  # e.g. the data path
    needs: str | None = None  # a path that must exist, or the config is skipped


def paper_configs(args: argparse.Namespace) -> list[Config]:
    return [
        Config("Boolean 2parity (paper)", "boolean/paper/2parity.yaml"),
        Config("addition 0.4% (paper)", "arithmetic/paper/addition.yaml"),
        Config("multiplication 3% (paper)", "arithmetic/paper/multiplication.yaml"),
        Config("CIFAR-10 ViT-Tiny (paper)", "vision/paper/cifar10.yaml", ["--data.init_args.root", args.cifar_root],
               needs=args.cifar_root),
        Config("WikiText-2 GPT (paper)", "language/paper/wikitext2.yaml",
               ["--data.init_args.data_dir", args.wikitext_dir], needs=args.wikitext_dir),
    ]


# Tiny versions that run offline on a CPU in seconds: the same code paths, small shapes.
TINY_CONFIGS = [
    Config("Boolean 2parity (tiny)", "boolean/paper/2parity.yaml",
           ["--data.init_args.n", "8", "--model.backbone.init_args.dim", "32", "--model.backbone.init_args.depth",
            "2", "--model.backbone.init_args.head_dim", "16", "--model.backbone.init_args.mlp_dim", "32",
            "--data.init_args.batch_size", "32"]),
    Config("addition (tiny)", "arithmetic/paper/addition.yaml",
           ["--data.init_args.num_digits", "2", "--data.init_args.train_fraction", "0.2",
            "--model.backbone.init_args.dim", "32", "--model.backbone.init_args.depth", "2",
            "--model.backbone.init_args.head_dim", "8", "--model.backbone.init_args.mlp_dim", "32",
            "--data.init_args.batch_size", "32"]),
    Config("digits ViT (tiny)", "vision/digits.yaml",
           ["--data.init_args.img_size", "16", "--data.init_args.max_train_size", "64",
            "--data.init_args.batch_size", "16"]),
    Config("pydoc GPT (tiny)", "language/pydoc.yaml",
           ["--model.backbone.init_args.dim", "32", "--model.backbone.init_args.depth", "2",
            "--model.backbone.init_args.head_dim", "16", "--data.init_args.batch_size", "8"]),
]


@dataclass
class Row:
    name: str
    status: str  # ok, skipped, failed
    detail: str = ""
    ms_per_step: float | None = None
    gflop_per_step: float | None = None
    tflops: float | None = None
    of_peak: float | None = None
    peak_memory_gib: float | None = None


# ---------------------------------------------------------------------------------------------- the kernels
def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_prior_gradient(device: torch.device, tolerance: float = 0.05) -> Row:
    """The fused kernel carries a grad-requiring prior (memory-efficient SDPA on CUDA, math on the CPU), in the
    query's dtype under bf16 autocast, and agrees with the explicit kernel in value and in the gradient of M."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    layer = PriorAttention(dim=256, num_heads=4, head_dim=64).to(device)
    n = 64
    open_ = (torch.rand(4, n, n) < 0.2) | torch.eye(n, dtype=torch.bool)
    layer.set_prior((torch.where(open_, 5.0, -5.0) + torch.randn(4, n, n)).to(device))
    x = torch.randn(16, n, 256, device=device)
    target = torch.randn(16, n, 256, device=device)
    backend = SDPBackend.EFFICIENT_ATTENTION if device.type == "cuda" else SDPBackend.MATH

    def run(kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
        layer.kernel = kernel
        layer.zero_grad()
        context = sdpa_kernel([backend]) if kernel == "sdpa" else contextlib.nullcontext()
        with context, torch.autocast(device.type, dtype=torch.bfloat16):
            out = layer(x)
        ((out.float() - target) ** 2).mean().backward()
        return out.detach(), layer.prior_logits.grad.detach().clone()

    try:
        fused_out, fused_grad = run("sdpa")
    except RuntimeError as err:
        return Row("prior gradient path", "failed", f"the fused kernel ({backend.name}) refused the prior: {err}")
    explicit_out, explicit_grad = run("explicit")
    value, grad = relative_error(fused_out, explicit_out), relative_error(fused_grad, explicit_grad)
    detail = (f"SDPA {backend.name} with a grad-requiring bf16 prior ran; against the explicit kernel: output "
              f"{value:.2%}, grad of M {grad:.2%} relative error (tolerance {tolerance:.0%})")
    ok = value < tolerance and grad < tolerance and torch.isfinite(fused_grad).all()
    return Row("prior gradient path", "ok" if ok else "failed", detail)


def check_flex_relative(device: torch.device, tolerance: float = 0.05) -> Row:
    """A relative prior through FlexAttention's score_mod agrees with the explicit kernel in value and (on CUDA) in
    the gradient of its offsets' table, in float32 (tolerance / 10) and under bf16 autocast (tolerance)."""
    from lightning_maskprior.priors import causal_relative_distance

    torch.manual_seed(0)
    n, heads = 128, 4
    layer = PriorAttention(dim=256, num_heads=heads, head_dim=64, causal=True).to(device)
    layer.set_parameterisation("relative")
    # the language prior at scale 1 (its scale 10 leaves most offsets on the floor), a little different per head
    per_head = torch.arange(1.0, heads + 1)[:, None, None]
    layer.set_prior((causal_relative_distance(n).layer_values(0) / per_head).to(device))
    x = torch.randn(8, n, 256, device=device)
    target = torch.randn(8, n, 256, device=device)
    gradient = device.type == "cuda"  # FlexAttention has no backward on a CPU

    def run(kernel: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer.kernel = kernel
        layer.zero_grad()
        with (torch.set_grad_enabled(gradient), warnings.catch_warnings(),
              torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)):
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # the CPU's, unfused
            out = layer(x)
        if not gradient:
            return out.detach(), None
        ((out.float() - target) ** 2).mean().backward()
        return out.detach(), layer.prior_offsets.grad.detach().clone()

    details, ok = [], True
    for dtype, bound in ((torch.float32, tolerance / 10), (torch.bfloat16, tolerance)):
        try:
            flex_out, flex_grad = run("flex", dtype)
        except Exception as err:  # a missing or failing compiler is what this check is for
            return Row("relative prior through FlexAttention", "failed", f"{dtype}: the flex kernel failed: {err}")
        explicit_out, explicit_grad = run("explicit", dtype)
        value = relative_error(flex_out, explicit_out)
        shown = f"{str(dtype).removeprefix('torch.')}: output {value:.2%}"
        ok &= value < bound
        if gradient:
            grad = relative_error(flex_grad, explicit_grad)
            shown += f", grad of the offsets {grad:.2%}"
            ok &= grad < bound and bool(torch.isfinite(flex_grad).all())
        details.append(f"{shown} (tolerance {bound:.1%})")
    if not gradient:
        details.append("gradient not checked (no FlexAttention backward on a CPU)")
    return Row("relative prior through FlexAttention", "ok" if ok else "failed",
               "against the explicit kernel: " + "; ".join(details))


# ---------------------------------------------------------------------------------------------- one config
def build(config: Config, device: torch.device, root: str) -> MaskPriorCLI:
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    args = ["-c", config.config, "-c", "init/mask.yaml", "--trainer.accelerator", accelerator,
            "--trainer.devices", "1", "--trainer.precision", "bf16-mixed", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", *config.extra]
    args = config_files.resolve_argv(["fit", *args])[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MaskPriorCLI(MaskPriorModule, L.LightningDataModule, subclass_mode_data=True, run=False, args=args,
                            auto_configure_optimizers=False, save_config_callback=None,
                            trainer_defaults={"default_root_dir": root})


def matmul_peak_tflops(device: torch.device, size: int) -> float:
    """The fastest bf16 matmul this device runs at ``size`` x ``size`` (TFLOP/s): the yardstick for a step."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize(device)
    repeats, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5 or repeats < 3:
        a @ b
        repeats += 1
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_config(config: Config, device: torch.device, steps: int, peak: float) -> Row:
    if config.needs is not None and not Path(config.needs).exists():
        return Row(config.name, "skipped", f"no data at {config.needs} (give its path: see --help)")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as root:
        try:
            cli = build(config, device, root)
        except (SystemExit, Exception) as err:  # noqa: BLE001 - a config that cannot be built is this row's failure
            return Row(config.name, "failed", f"could not build it: {err}")
        module, datamodule = cli.model.to(device), cli.datamodule
        datamodule.setup("fit")
        optimizer = module.configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        loader = iter(datamodule.train_dataloader())

        def batch() -> dict[str, torch.Tensor]:
            nonlocal loader
            try:
                data = next(loader)
            except StopIteration:
                loader = iter(datamodule.train_dataloader())
                data = next(loader)
            return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in data.items()}

        def step(data: dict[str, torch.Tensor]) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = module.objective.loss(module(data["inputs"]), data)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        module.train()
        data = batch()
        with FlopCounterMode(display=False) as counter:
            step(data)
        flops = counter.get_total_flops()
        for _ in range(min(5, steps)):
            step(batch())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        batches = [batch() for _ in range(min(steps, 16))]  # a few batches on the device, cycled: times the step
        synchronize(device)
        start = time.perf_counter()
        for i in range(steps):
            step(batches[i % len(batches)])
        synchronize(device)
        seconds = (time.perf_counter() - start) / steps
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    tflops = flops / seconds / 1e12
    return Row(config.name, "ok", f"{steps} steps, batch {len(data['inputs'])}", ms_per_step=seconds * 1e3,
               gflop_per_step=flops / 1e9, tflops=tflops, of_peak=tflops / peak if peak else None,
               peak_memory_gib=memory)


def ddp_step(steps: int, timeout: int) -> Row:
    """``maskprior fit`` of the Boolean paper config on two GPUs (DDP) for ``steps`` optimizer steps."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_ddp_") as root:
        command = [sys.executable, "-m", "lightning_maskprior.cli", "fit", "-c", "boolean/paper/2parity.yaml", "-c",
                   "init/mask.yaml", "-c", "trainer/gpu_ddp.yaml", "--trainer.devices", "2", "--trainer.max_steps",
                   str(steps), "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", root]
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Row("2-GPU DDP fit", "failed", f"did not finish in {timeout} s")
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return Row("2-GPU DDP fit", "failed", f"exit code {proc.returncode}: {tail}")
    return Row("2-GPU DDP fit", "ok", f"{steps} steps on 2 GPUs in {seconds:.0f} s (start-up included)")


# ---------------------------------------------------------------------------------------------- report
def table(rows: list[Row]) -> str:
    def number(value: float | None, fmt: str) -> str:
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    lines = ["| check | status | ms/step | GFLOP/step | TFLOP/s | of bf16 peak | peak memory GiB | detail |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.status} | {number(r.ms_per_step, '.1f')} | {number(r.gflop_per_step, '.1f')} | "
                     f"{number(r.tflops, '.3g')} | {number(r.of_peak, '.1%')} | {number(r.peak_memory_gib, '.2f')} "
                     f"| {r.detail} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="Tiny models on the CPU (no GPU needed): checks the script and the code paths.")
    parser.add_argument("--steps", type=int, default=None,
                        help="Timed optimizer steps per config (default 300 on a GPU, 3 with --tiny).")
    parser.add_argument("--cifar_root", default="data/cifar", help="CIFAR-10's folder (cifar-10-batches-py inside).")
    parser.add_argument("--wikitext_dir", default="data/wikitext-2-raw", help="WikiText-2 raw's folder.")
    parser.add_argument("--ddp_steps", type=int, default=50, help="Steps of the 2-GPU DDP fit (0: skip it).")
    parser.add_argument("--json", type=Path, default=None, help="Also write every row to this JSON file.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps is not None and args.steps < 1:
        build_parser().error(f"--steps must be >= 1, got {args.steps}")
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("error: no CUDA device is visible; run on a GPU machine, or with --tiny to check on the CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    steps = args.steps or (300 if cuda else 3)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    peak = matmul_peak_tflops(device, 8192 if cuda else 512)
    nominal = next((v for k, v in NOMINAL_BF16_TFLOPS.items() if cuda and k in name), None)
    print(f"device: {name}; bf16 matmul peak measured {peak:.1f} TFLOP/s"
          + (f" (nominal dense bf16: {nominal:.0f})" if nominal else "") + f"; torch {torch.__version__}", flush=True)
    rows = [check_prior_gradient(device)]
    print(f"{rows[-1].name}: {rows[-1].status}: {rows[-1].detail}", flush=True)
    rows.append(check_flex_relative(device))
    print(f"{rows[-1].name}: {rows[-1].status}: {rows[-1].detail}", flush=True)
    for config in (TINY_CONFIGS if args.tiny else paper_configs(args)):
        rows.append(time_config(config, device, steps, peak))
        r = rows[-1]
        shown = f"{r.ms_per_step:.1f} ms/step, {r.tflops:.3g} TFLOP/s" if r.status == "ok" else r.detail
        print(f"{r.name}: {r.status}: {shown}", flush=True)
    if cuda and torch.cuda.device_count() > 1 and args.ddp_steps:
        rows.append(ddp_step(args.ddp_steps, timeout=300))
        print(f"{rows[-1].name}: {rows[-1].status}: {rows[-1].detail}", flush=True)
    elif cuda:
        rows.append(Row("2-GPU DDP fit", "skipped", f"{torch.cuda.device_count()} CUDA device visible"))
    print()
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"device": name, "matmul_peak_tflops": peak, "nominal_bf16_tflops": nominal,
                                         "rows": [asdict(r) for r in rows]}, indent=2))
    failed = [r.name for r in rows if r.status == "failed"]
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

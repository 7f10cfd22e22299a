"""How fast is a training step, in fp32 and bf16, with and without the prior, inside and outside Lightning?

    python benchmarks/step_speed.py                     # the 2parity CPU config, 1 and 2 threads (~8 min)
    python benchmarks/step_speed.py --threads 2 --rounds 3
    python benchmarks/step_speed.py --config boolean/cyclic3.yaml

Everything is measured in one process, side by side, so the ratios do not depend on what else the machine
is doing. For each thread count it reports:

1. the peak of a large matmul in fp32 and bf16 (GFLOP/s), the yardstick for the rest;
2. one optimizer step of the config's model (forward, backward, Adam) for the default init and the mask
   prior, in fp32 and under bf16 autocast, with each attention kernel (``auto`` is what runs use):
   ms/step, GFLOP/s (FLOPs counted by torch.utils.flop_counter) and the fraction of the matmul peak;
   the models take one step each in turn, round after round, and the median round counts;
3. a validation pass over the full cube (2^n points, the eval batch size), fp32 against bf16;
4. Lightning against a raw loop: the same model, data, optimizer and precision, trained by
   ``Trainer.fit`` with the config's callbacks (plus the CLI's StopOnSignal, RNGStates, StopOnDivergence,
   ModelCheckpoint and a TensorBoard logger) and by a plain PyTorch loop; the time per step after the first few.

Targets, checked at the end: a bf16 step (default and mask) <= 0.5x the fp32 step of the same
init; mask/default <= 1.10 in both dtypes at every thread count; Lightning <= 1.10x the raw loop.

The bf16 target depends on the CPU as much as on the code. If a bf16 step ran at the same fraction of the
bf16 matmul peak as the fp32 step does of the fp32 peak, the bf16/fp32 step ratio would be fp32 peak / bf16
peak; the script prints that "matmul floor" beside the target. A ratio below it means bf16 runs the step more
efficiently than fp32 (it happens: the validation pass does), one above it that bf16 pays costs fp32 does not
(autocast's casts, per-call overhead of small bf16 GEMMs). Where the bf16 units run at twice the fp32 rate
(AVX512-BF16 without AMX, as on AMD Zen 4) the floor is 0.43-0.48, so 0.5 asks for bf16 to be within a few
percent of fp32's efficiency; with AMX tiles (Intel Sapphire Rapids and later) the floor is far lower.

A ratio is the median over rounds of the two steps' ratio within a round, printed with its interquartile
range: steps a few hundred milliseconds apart see the same machine, so a slow spell (another process, a
frequency change) moves both and cancels, where a ratio of two separately timed medians would carry it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import lightning as L
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_maskprior.attention import set_attention_kernel
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import allocator, config_files
from lightning_maskprior.run.cli import MaskPriorCLI

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}
INITS = ("default", "mask")


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=DTYPES[dtype]) if DTYPES[dtype] else contextlib.nullcontext()


def build(config: str, init: str, dtype: str, extra: list[str] = ()) -> MaskPriorCLI:
    """The config's module, datamodule and trainer, as ``maskprior fit`` builds them (nothing runs)."""
    args = ["-c", config, "-c", f"init/{init}.yaml", "--trainer.precision", PRECISION[dtype],
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *extra]
    args = config_files.resolve_argv(["fit", *args])[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MaskPriorCLI(MaskPriorModule, L.LightningDataModule, subclass_mode_data=True, run=False,
                            args=args, auto_configure_optimizers=False, save_config_callback=None,
                            trainer_defaults={"default_root_dir": tempfile.mkdtemp(prefix="step_speed_")})


def first_batch(datamodule, size: int | None = None) -> dict[str, torch.Tensor]:
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    return {k: v[:size] for k, v in batch.items()} if size else batch


def matmul_peak(dtype: str, sizes=(512, 1024, 2048), seconds: float = 0.5) -> float:
    """GFLOP/s of the fastest square matmul among ``sizes`` (the peak the model is measured against)."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, dtype=DTYPES[dtype] or torch.float32)
        b = torch.randn(n, n, dtype=a.dtype)
        a @ b
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        best = max(best, 2 * n**3 * count / (time.perf_counter() - start) / 1e9)
    return best


def optimizer_step(module: MaskPriorModule, optimizer: torch.optim.Optimizer, batch, dtype: str) -> None:
    """One plain PyTorch training step: forward under the dtype's autocast, the task's loss, backward, update."""
    with autocast(dtype):
        output = module(batch["inputs"])
    loss = module.objective.loss(output, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step(module: MaskPriorModule, batch, dtype: str) -> Callable[[], None]:
    """``optimizer_step`` on a fixed batch with a fresh copy of the config's optimizer, as a call to time."""
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    return lambda: optimizer_step(module, optimizer, batch, dtype)


def count_flops(step: Callable[[], None]) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def alternate(steps: dict, rounds: int, iters: int = 1, seed: int = 0) -> dict[object, list[float]]:
    """Seconds per call of each step in each round; a round runs every step ``iters`` times, one after another.

    The order of the steps is shuffled in every round (seeded): a step runs about 4% faster right after a step
    of the same shapes (measured with two copies of one model), which a fixed order would credit to one of them.
    """
    for step in steps.values():
        for _ in range(2):
            step()
    times = {key: [] for key in steps}
    order, rng = list(steps), random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            step = steps[key]
            start = time.perf_counter()
            for _ in range(iters):
                step()
            times[key].append((time.perf_counter() - start) / iters)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the round-by-round ratio of two steps timed in the same rounds."""
    ratios = sorted(a / b for a, b in zip(numerator, denominator, strict=True))
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    low, _, high = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), low, high


def step_table(config: str, rounds: int, iters: int, peaks: dict[str, float]) -> dict[tuple, list[float]]:
    """Seconds per step of every (init, dtype, kernel) in each round; prints the median ms/step, GFLOP/s and
    the fraction of the peak."""
    steps, flops = {}, {}
    for init in INITS:
        base = build(config, init, "fp32")
        batch = first_batch(base.datamodule)
        for dtype in DTYPES:
            for kernel in ("auto", "sdpa"):
                module = copy.deepcopy(base.model)
                set_attention_kernel(module, kernel)
                steps[init, dtype, kernel] = train_step(module, batch, dtype)
                flops[init, dtype, kernel] = count_flops(steps[init, dtype, kernel])
    times = alternate(steps, rounds, iters)
    print(f"\n  {'init':<8} {'dtype':<5} {'kernel':<7} {'ms/step':>8} {'GFLOP/s':>8} {'% of peak':>9}")
    for (init, dtype, kernel), t in times.items():
        s = statistics.median(t)
        rate = flops[init, dtype, kernel] / s / 1e9
        print(f"  {init:<8} {dtype:<5} {kernel:<7} {s * 1000:8.1f} {rate:8.1f} {100 * rate / peaks[dtype]:8.1f}%")
    print(f"  ({flops['mask', 'fp32', 'auto'] / 1e9:.2f} GFLOP per step, batch {len(batch['inputs'])}; "
          f"median of {rounds} rounds)")
    return times


def validation_pass(config: str, rounds: int) -> dict[str, list[float]]:
    """Seconds of each pass of the model over the validation set (the full cube for Boolean tasks)."""
    cli = build(config, "mask", "fp32")
    cli.datamodule.setup("validate")
    batches = list(cli.datamodule.val_dataloader())
    module = cli.model.eval()

    def make(dtype: str):
        def run() -> None:
            with torch.no_grad(), autocast(dtype):
                for batch in batches:
                    module(batch["inputs"])
        return run

    times = alternate({dtype: make(dtype) for dtype in DTYPES}, rounds)
    points = sum(len(b["inputs"]) for b in batches)
    print(f"\n  validation pass over {points} points: "
          + ", ".join(f"{d} {statistics.median(t) * 1000:.0f} ms" for d, t in times.items())
          + f"; bf16/fp32 = {paired_ratio(times['bf16'], times['fp32'])[0]:.2f} (median of {rounds} rounds)")
    return times


class _StepClock(L.Callback):
    """Wall time from the start of batch ``skip`` to the end of the last batch."""

    def __init__(self, skip: int) -> None:
        self.skip, self.start, self.end, self.count = skip, None, None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.skip and self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.start is not None:
            self.end, self.count = time.perf_counter(), self.count + 1


def _fit_seconds(config: str, dtype: str, steps: int, skip: int) -> float:
    """Seconds per step of one ``Trainer.fit`` of ``steps`` steps after ``skip`` warm-up steps."""
    extra = ["--trainer.max_steps", str(steps + skip), "--trainer.limit_val_batches", "0",
             "--model.lr_schedule", "constant"]
    cli = build(config, "mask", dtype, extra)
    clock = _StepClock(skip)
    cli.trainer.callbacks.append(clock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return (clock.end - clock.start) / clock.count


def _raw_seconds(config: str, dtype: str, steps: int, skip: int) -> float:
    """Seconds per step of a plain loop: the same module, loader, optimizer and autocast, nothing else."""
    cli = build(config, "mask", dtype, ["--model.lr_schedule", "constant"])
    raw = cli.model
    optimizer = raw.configure_optimizers()
    cli.datamodule.setup("fit")
    loader = cli.datamodule.train_dataloader()
    done, start = 0, None
    while done < steps + skip:
        for batch in loader:
            if done == skip:
                start = time.perf_counter()
            optimizer_step(raw, optimizer, batch, dtype)
            done += 1
            if done == steps + skip:
                break
    return (time.perf_counter() - start) / steps


def lightning_overhead(config: str, dtype: str, steps: int, rounds: int, skip: int = 5) -> tuple[list, list]:
    """Seconds per step of Trainer.fit (the config's callbacks, the CLI's run callbacks, ModelCheckpoint,
    TensorBoard) and of the raw loop in each of ``rounds`` rounds; a round runs a fresh fit and a fresh loop, in
    alternating order."""
    fits, loops = [], []
    for round_ in range(rounds):
        if round_ % 2:
            loops.append(_raw_seconds(config, dtype, steps, skip))
            fits.append(_fit_seconds(config, dtype, steps, skip))
        else:
            fits.append(_fit_seconds(config, dtype, steps, skip))
            loops.append(_raw_seconds(config, dtype, steps, skip))
    return fits, loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="boolean/2parity.yaml",
                        help="task config whose model, batch and callbacks are measured (default: %(default)s)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="torch thread counts to measure at (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=30,
                        help="rounds in which every model takes its steps in turn (medians over rounds count)")
    parser.add_argument("--iters", type=int, default=1, help="training steps per round and model")
    parser.add_argument("--val-rounds", type=int, default=5, help="rounds of the fp32 and bf16 validation passes")
    parser.add_argument("--lightning-steps", type=int, default=50,
                        help="steps timed per round in Trainer.fit and in the raw loop (after 5 warm-up steps)")
    parser.add_argument("--lightning-rounds", type=int, default=5,
                        help="alternating rounds of Trainer.fit and the raw loop (the median counts)")
    args = parser.parse_args()
    # Lightning's per-fit info lines and the loaders' warnings would bury the tables; what is measured is unchanged.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    # What a `maskprior` run does at start (allocator.py); MASKPRIOR_KEEP_FREED_MEMORY=0 measures glibc's default.
    kept = allocator.keep_freed_memory_if_enabled()
    print(f"allocator: freed memory {'kept in the process' if kept else 'returned to the system (the C default)'}")
    if not torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported():
        print("note: this CPU has no native bf16; the bf16 rows measure emulation")

    checks = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n=== {args.config}, {threads} thread(s) ===")
        peaks = {dtype: matmul_peak(dtype) for dtype in DTYPES}
        floor = peaks["fp32"] / peaks["bf16"]
        print("  matmul peak: " + ", ".join(f"{d} {p:.0f} GFLOP/s" for d, p in peaks.items())
              + f"; bf16 / fp32 at equal efficiency (the matmul floor): {floor:.2f}")
        times = step_table(args.config, args.rounds, args.iters, peaks)
        for init in INITS:
            ratio = paired_ratio(times[init, "bf16", "auto"], times[init, "fp32", "auto"])
            checks.append((f"{threads} thr: {init} bf16 / fp32 step", ratio, 0.5, floor))
        for dtype in DTYPES:
            ratio = paired_ratio(times["mask", dtype, "auto"], times["default", dtype, "auto"])
            checks.append((f"{threads} thr: mask / default step, {dtype}", ratio, 1.10, None))
        val = validation_pass(args.config, args.val_rounds)
        checks.append((f"{threads} thr: validation pass bf16 / fp32", paired_ratio(val["bf16"], val["fp32"]), 0.5,
                       floor))

    print(f"\n=== Lightning against a raw loop ({torch.get_num_threads()} threads, mask, "
          f"median of {args.lightning_rounds} rounds of {args.lightning_steps} steps) ===")
    for dtype in DTYPES:
        fits, loops = lightning_overhead(args.config, dtype, args.lightning_steps, args.lightning_rounds)
        ratio = paired_ratio(fits, loops)
        print(f"  {dtype}: Trainer.fit {statistics.median(fits) * 1000:.1f} ms/step, "
              f"raw loop {statistics.median(loops) * 1000:.1f} ms/step, ratio {ratio[0]:.3f}")
        checks.append((f"Lightning / raw loop, {dtype}", ratio, 1.10, None))

    print("\n=== targets (median ratio, interquartile range over rounds) ===")
    for name, (value, low, high), target, floor in checks:
        spread = f"[{low:.3f}, {high:.3f}]" if high > low else ""
        verdict = "ok  " if value <= target else "MISS"
        bound = f"; matmul floor {floor:.2f}" if floor is not None else ""
        print(f"  {verdict} {name:<42} {value:6.3f} {spread:<16} (target <= {target:.2f}{bound})")


if __name__ == "__main__":
    main()

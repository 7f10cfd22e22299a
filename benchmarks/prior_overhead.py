"""Time one training step with the mask prior against the same model without it, side by side.

    python benchmarks/prior_overhead.py            # GOTU token transformer, 2parity, CPU
    python benchmarks/prior_overhead.py --device cuda --batch-size 1024

Both models are built from the same seed and timed in alternating rounds in one process, so the
ratio is not skewed by whatever else the machine is doing. Target: ratio <= 1.10 on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_maskprior.datamodules import BooleanGOTUDataModule
from lightning_maskprior.inits import apply_init
from lightning_maskprior.models import TokenTransformer


def make_step(init: str, task, device: str, batch: dict, dim: int, depth: int):
    torch.manual_seed(0)
    model = TokenTransformer(task, dim=dim, depth=depth).to(device)
    apply_init(init, model, task.structure)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = task.objective.loss(model(batch["inputs"]), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(step, iters: int, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="2parity", help="Boolean task whose structure is the prior")
    parser.add_argument("--batch-size", type=int, default=256, help="examples per step (paper: 256)")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--depth", type=int, default=4, help="number of blocks")
    parser.add_argument("--rounds", type=int, default=7, help="alternating timing rounds")
    parser.add_argument("--iters", type=int, default=10, help="steps per round")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()

    dm = BooleanGOTUDataModule(args.task)
    task = dm.task_spec()
    index = torch.arange(args.batch_size) % len(dm.train_set)
    batch = {k: v[index].to(args.device) for k, v in dm.train_set.tensors.items()}
    steps = {init: make_step(init, task, args.device, batch, args.dim, args.depth) for init in ("default", "mask")}
    for step in steps.values():  # warm-up
        timed(step, 3, args.device)
    times: dict[str, list[float]] = {init: [] for init in steps}
    for _ in range(args.rounds):
        for init, step in steps.items():
            times[init].append(timed(step, args.iters, args.device))
    median = {init: statistics.median(t) for init, t in times.items()}
    print(f"task={args.task} batch={args.batch_size} dim={args.dim} depth={args.depth} device={args.device} "
          f"threads={torch.get_num_threads()}")
    for init, t in median.items():
        print(f"  {init:<8} {t * 1000:8.2f} ms/step (median of {args.rounds} rounds x {args.iters} steps)")
    print(f"  ratio mask/default = {median['mask'] / median['default']:.3f}  (target <= 1.10 on CPU)")


if __name__ == "__main__":
    main()

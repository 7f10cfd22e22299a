"""What a prior costs as the block grows: the project's GPT with the language prior held ``full`` (N x N per head)
and ``relative`` (one value per head and offset), against the untouched model (no prior), side by side in one run.

    python benchmarks/prior_scaling.py                                  # the paper's GPT shape, blocks 256 512 1024
    python benchmarks/prior_scaling.py --dim 64 --depth 2 --num-heads 4 --head-dim 16 --batch 2 --rounds 5

For each block size it builds the three models as ``MaskPriorModule`` builds them (init ``default``, and init
``mask`` with the task's causal relative-distance prior, scale 10, in each parameterisation) and reports:

- **prior parameters**: the numbers that hold M, and their fraction of the untouched model's parameters;
- **memory of one training step**: on CUDA the peak allocated; on a CPU (no allocator statistics) what a step holds:
  parameters, gradients, AdamW's state and the tensors saved for the backward, each storage counted once;
- **step time**: one training step (forward, loss, backward, AdamW step) of each variant per round, in a shuffled
  order (``step_speed.alternate``), and the round-by-round ratio to the untouched model (median and quartiles), the
  measure that cancels a slow spell that hits both.

Targets at block 1024: ``relative`` within 1.10x of the untouched model's step time and under 1% of its parameters;
``full`` is measured, not targeted. The tables print as markdown.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
from pathlib import Path

import torch

from lightning_maskprior import priors
from lightning_maskprior.attention import attention_layers
from lightning_maskprior.models import GPT
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.objectives import LanguageModelObjective
from lightning_maskprior.task import TaskSpec

_spec = importlib.util.spec_from_file_location("step_speed", Path(__file__).with_name("step_speed.py"))
step_speed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_speed)  # alternate() and paired_ratio(): one timing method for every benchmark

VARIANTS = {"untouched": ("default", "full"), "full": ("mask", "full"), "relative": ("mask", "relative")}


def build(args: argparse.Namespace, block: int, variant: str, device: torch.device) -> MaskPriorModule:
    init, parameterisation = VARIANTS[variant]
    task = TaskSpec("language", block, args.vocab, args.vocab, LanguageModelObjective(),
                    priors.causal_relative_distance(block), init_defaults={"mask": {"scale": 10.0}})
    backbone = functools.partial(GPT, dim=args.dim, depth=args.depth, num_heads=args.num_heads,
                                 head_dim=args.head_dim, dropout=0.0)
    torch.manual_seed(0)
    return MaskPriorModule(backbone=backbone, init=init, task=task, parameterisation=parameterisation,
                           lr_schedule="constant").to(device)


def prior_parameters(module: MaskPriorModule) -> int:
    return sum(p.numel() for layer in attention_layers(module) for p in layer.prior_parameters().values())


def train_step(module: MaskPriorModule, batch: dict[str, torch.Tensor]):
    """One optimizer step of ``module`` on ``batch`` (AdamW, as the language configs), as a callable."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step(saved: dict[int, int] | None = None) -> None:
        optimizer.zero_grad(set_to_none=True)

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if saved is not None:
                storage = tensor.untyped_storage()
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = module.objective.loss(module(batch["inputs"]), batch)
        loss.backward()
        optimizer.step()

    step.optimizer = optimizer
    return step


def step_memory(module: MaskPriorModule, step, device: torch.device) -> int:
    """Bytes of one training step: the CUDA peak, or on a CPU the storages a step holds (see the module doc)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    saved: dict[int, int] = {}
    step(saved)
    held = dict(saved)
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [t for state in step.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def measure(args: argparse.Namespace, block: int, device: torch.device) -> list[dict]:
    modules = {variant: build(args, block, variant, device) for variant in VARIANTS}
    tokens = torch.randint(args.vocab, (args.batch, block + 1), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1].to(device), "target": tokens[:, 1:].to(device)}
    steps = {variant: train_step(module, batch) for variant, module in modules.items()}
    memory = {variant: step_memory(modules[variant], steps[variant], device) for variant in VARIANTS}

    def timed(step):
        def run() -> None:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    times = step_speed.alternate({v: timed(s) for v, s in steps.items()}, args.rounds)
    model_params = sum(p.numel() for p in modules["untouched"].parameters())
    rows = []
    for variant, module in modules.items():
        ratio = step_speed.paired_ratio(times[variant], times["untouched"])
        prior = prior_parameters(module)
        rows.append({"block": block, "variant": variant, "prior_params": prior, "of_model": prior / model_params,
                     "memory_mib": memory[variant] / 2**20, "memory_ratio": memory[variant] / memory["untouched"],
                     "ms": 1e3 * statistics.median(times[variant]), "time_ratio": ratio})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| block | prior | prior parameters | of the model's | step memory MiB | vs untouched | ms/step | "
             "step time vs untouched (median [quartiles]) |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        median, low, high = r["time_ratio"]
        lines.append(f"| {r['block']} | {r['variant']} | {r['prior_params']:,} | {r['of_model']:.2%} | "
                     f"{r['memory_mib']:.1f} | {r['memory_ratio']:.2f}x | {r['ms']:.1f} | "
                     f"{median:.3f}x [{low:.3f}, {high:.3f}] |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[256, 512, 1024], help="Block sizes N.")
    parser.add_argument("--dim", type=int, default=512, help="GPT width (the paper's: 512).")
    parser.add_argument("--depth", type=int, default=12, help="Blocks of the GPT (the paper's: 12).")
    parser.add_argument("--num-heads", type=int, default=12, help="Attention heads (the paper's: 12).")
    parser.add_argument("--head-dim", type=int, default=64, help="Width of each head (the paper's config: 64).")
    parser.add_argument("--vocab", type=int, default=2048, help="Vocabulary size (pydoc's BPE: 2048).")
    parser.add_argument("--batch", type=int, default=8, help="Sequences per training step.")
    parser.add_argument("--rounds", type=int, default=10, help="Timed rounds (one step of each variant per round).")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"GPT width {args.dim}, {args.depth} blocks, {args.num_heads} heads of {args.head_dim}, batch {args.batch}, "
          f"fp32, {device.type} ({torch.get_num_threads()} threads), {args.rounds} rounds", flush=True)
    rows = []
    for block in args.blocks:
        rows += measure(args, block, device)
        print(f"block {block} done", flush=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What an injected prior costs: training-step time of a timm ViT untouched, injected without a prior, and injected
with a trainable mask prior, side by side in one process.

    python benchmarks/inject_overhead.py                        # vit_tiny at 32 px, 4 px patches (65 tokens)
    python benchmarks/inject_overhead.py --model deit_small_patch16_224 --img-size 64 --patch-size 8 --batch 64

Every round runs one training step (forward, loss, backward, AdamW step) of each variant, in a shuffled order, in
fp32 and under bf16 autocast; it prints the median ms per step and the round-by-round ratio of each injected variant
to the untouched model (median and quartiles), the measure that cancels a slow spell hitting both. Target: the
injected model with its mask prior within 1.10x of the untouched model. On a CPU without native bf16, bf16 autocast
is emulated and its ratios say little.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
from pathlib import Path

import timm
import torch

from lightning_maskprior import Structure, inject_prior

_spec = importlib.util.spec_from_file_location("step_speed", Path(__file__).with_name("step_speed.py"))
step_speed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_speed)  # alternate() and paired_ratio(): one timing method for every benchmark


def variants(args) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    untouched = timm.create_model(args.model, pretrained=False, img_size=args.img_size, patch_size=args.patch_size,
                                  num_classes=10, depth=args.depth)
    tokens = untouched.patch_embed.num_patches + untouched.num_prefix_tokens
    neighbours = torch.rand(1, 1, tokens, tokens, generator=torch.Generator().manual_seed(0)) < 0.2
    neighbours |= torch.eye(tokens, dtype=torch.bool)
    return {"untouched": untouched, "injected": inject_prior(copy.deepcopy(untouched)),
            "injected + mask": inject_prior(copy.deepcopy(untouched), Structure(neighbours, name="random"))}


def train_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, dtype: str):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_tiny_patch16_224", help="a timm model name built from timm's Attention")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after two warm-up steps each)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=generator)
    labels = torch.randint(0, 10, (args.batch,), generator=generator)
    models = variants(args)
    steps = {(name, dtype): train_step(copy.deepcopy(model), images, labels, dtype)
             for name, model in models.items() for dtype in args.dtypes}
    times = step_speed.alternate(steps, args.rounds)
    tokens = models["untouched"].patch_embed.num_patches + models["untouched"].num_prefix_tokens
    print(f"{args.model}, {args.depth} blocks, {tokens} tokens, batch {args.batch}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds\n")
    print("| dtype | variant | ms / step | ratio to untouched (median, quartiles) |")
    print("|---|---|---:|---|")
    ratios = {}
    for dtype in args.dtypes:
        for name in models:
            ms = 1000 * sorted(times[name, dtype])[len(times[name, dtype]) // 2]
            if name == "untouched":
                print(f"| {dtype} | {name} | {ms:.1f} | 1 |")
                continue
            median, low, high = step_speed.paired_ratio(times[name, dtype], times["untouched", dtype])
            ratios[name, dtype] = median
            print(f"| {dtype} | {name} | {ms:.1f} | {median:.3f} ({low:.3f}-{high:.3f}) |")
    return ratios


if __name__ == "__main__":
    main()

"""What an injected prior costs: training-step time of a model untouched, injected without a prior, and injected
with a trainable prior, side by side in one process.

    python benchmarks/inject_overhead.py                        # timm vit_tiny at 32 px, 4 px patches (65 tokens)
    python benchmarks/inject_overhead.py --model deit_small_patch16_224 --img-size 64 --patch-size 8 --batch 64
    python benchmarks/inject_overhead.py --family hf            # a GPT-2 (transformers), 64-token blocks

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


def hf_variants(args) -> dict[str, torch.nn.Module]:
    import transformers

    from lightning_maskprior import priors

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.depth, n_head=4, n_embd=128, vocab_size=2048, n_positions=args.block,
                                     bos_token_id=None, eos_token_id=None)
    untouched = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    language = priors.causal_relative_distance(args.block)
    return {"untouched": untouched, "injected": inject_prior(copy.deepcopy(untouched)),
            "injected + mask": inject_prior(copy.deepcopy(untouched), language, init="mask", scale=10.0)}


def variants(args) -> dict[str, torch.nn.Module]:
    if args.family == "hf":
        return hf_variants(args)
    torch.manual_seed(0)
    untouched = timm.create_model(args.model, pretrained=False, img_size=args.img_size, patch_size=args.patch_size,
                                  num_classes=10, depth=args.depth)
    tokens = untouched.patch_embed.num_patches + untouched.num_prefix_tokens
    neighbours = torch.rand(1, 1, tokens, tokens, generator=torch.Generator().manual_seed(0)) < 0.2
    neighbours |= torch.eye(tokens, dtype=torch.bool)
    return {"untouched": untouched, "injected": inject_prior(copy.deepcopy(untouched)),
            "injected + mask": inject_prior(copy.deepcopy(untouched), Structure(neighbours, name="random"))}


def train_step(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, dtype: str):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            out = model(inputs)
            logits = (out.logits if hasattr(out, "logits") else out).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="timm", choices=["timm", "hf"],
                        help="timm: a timm ViT (--model); hf: a transformers GPT-2 (needs the hf extra)")
    parser.add_argument("--model", default="vit_tiny_patch16_224", help="a timm model name built from timm's Attention")
    parser.add_argument("--block", type=int, default=64, help="hf: tokens per sequence")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after two warm-up steps each)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(1)
    if args.family == "hf":
        inputs = torch.randint(0, 2048, (args.batch, args.block), generator=generator)
        labels, tokens, name = inputs.roll(-1, 1), args.block, "GPT-2 (width 128, 4 heads)"
    else:
        inputs = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=generator)
        labels = torch.randint(0, 10, (args.batch,), generator=generator)
    models = variants(args)
    if args.family == "timm":
        tokens, name = models["untouched"].patch_embed.num_patches + models["untouched"].num_prefix_tokens, args.model
    steps = {(variant, dtype): train_step(copy.deepcopy(model), inputs, labels, dtype)
             for variant, model in models.items() for dtype in args.dtypes}
    times = step_speed.alternate(steps, args.rounds)
    print(f"{name}, {args.depth} blocks, {tokens} tokens, batch {args.batch}, {torch.get_num_threads()} threads, "
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

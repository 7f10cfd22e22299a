"""Fine-tune a timm ViT from a checkpoint on disk with a mask prior: python examples/finetune_timm.py [OUT_DIR]

1. Stands in for "the pretrained weights you have": a small timm ViT saved as timm's training script saves one
   (with a real checkpoint, skip this step and give its path).
2. Fine-tunes it on scikit-learn's digits (offline) with the mask prior, through the same command line as every
   other run: ``maskprior fit -c vision/digits.yaml -c init/mask.yaml --model.backbone.init_args.checkpoint_path``.
3. Reopens the run with ``load_run`` (the pretrained file is no longer needed) and prints what is left of the prior.

A few minutes on a laptop CPU. With a real checkpoint, set ``--model.backbone.init_args.model_name`` to its timm
name (e.g. ``deit_tiny_patch16_224``) and drop the size overrides below.
"""

from __future__ import annotations

import sys
from pathlib import Path

import timm
import torch

from lightning_maskprior import attention_layers, load_run
from lightning_maskprior.cli import main as maskprior

SIZE = {"embed_dim": 48, "depth": 2, "num_heads": 3}


def main(out_dir: str = "runs/finetune_timm") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # 1. "pretrained" weights: any timm ViT state dict on disk (ImageNet weights at 224 px work the same way:
    #    timm resamples the position embedding to the task's patch grid and replaces the classifier).
    torch.manual_seed(0)
    pretrained = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, in_chans=1, **SIZE)
    checkpoint = out / "pretrained.pth.tar"
    # the layout timm's train.py (CheckpointSaver) writes; a bare state dict or .safetensors loads the same way
    torch.save({"arch": "vit_tiny_patch16_224", "state_dict": pretrained.state_dict()}, checkpoint)
    # 2. fine-tune with the mask prior, as any other run
    maskprior(["fit", "-c", "vision/digits.yaml", "-c", "init/mask.yaml",
               "--model.backbone.init_args.checkpoint_path", str(checkpoint),
               "--model.backbone.init_args.model_kwargs", str(SIZE).replace("'", '"'),
               "--trainer.max_epochs", "5", "--trainer.default_root_dir", str(out / "runs")])
    # 3. reopen it
    run_dir = max((out / "runs").rglob("version_*"), key=lambda p: p.stat().st_mtime)
    module, _ = load_run(run_dir)
    for index, layer in enumerate(attention_layers(module)):
        m = layer.prior_matrix().detach()
        print(f"layer {index}: {int((m > 0).sum())} of {m.numel()} prior entries open (M > 0), M in "
              f"[{m.min().item():.2f}, {m.max().item():.2f}]")


if __name__ == "__main__":
    main(*sys.argv[1:])

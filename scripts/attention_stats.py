"""Attention entropy, locality and effective receptive field per layer of the ViT runs of a study.

    python scripts/attention_stats.py runs/study/digits_causes \
        [--seed 0] [--images 256] [--inits mask impulse ...]

For each run ``<study>/<task>/<init>/seed<k>`` it reopens the final checkpoint (``load_run``), takes the first
``--images`` held-out images and, per attention layer (patch queries only; the CLS query is left out), measures

- ``entropy``: mean attention entropy in nats (uniform over the 65 tokens of digits: ln 65 = 4.17; one key: 0);
- ``cls_mass``: attention on the prefix (CLS) token;
- ``dist``: mean grid distance (in patches) from the query patch to the patches it attends to (CLS mass left out);
- ``open_mass``: attention on the structure's open entries (the 3x3 impulse of that head), as PriorPersistence;
- ``erf90`` / ``erf_dist``: attention rollout (Abnar & Zuidema 2020: R_l = (A_l/2 + I/2) R_{l-1}, A_l averaged over
  heads and images) from the patches up to this layer: the number of patches holding 90% of a query patch's rollout
  mass, and the rollout's mean grid distance: how far information has travelled by this layer.

Each number is given for the trained model and for the same model at init (rebuilt from the checkpoint's
hyperparameters with the run's seed: the init's structure exactly, its random parts re-drawn the same way).
Per-head values are averaged over heads (``--per-head`` prints them). Writes ``attention_stats.csv`` in the study dir.
Inference only: seconds per run.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import math
from pathlib import Path

import torch
import yaml


def grid_distance(rows: int, cols: int) -> torch.Tensor:
    r = torch.arange(rows).repeat_interleave(cols).float()
    c = torch.arange(cols).repeat(rows).float()
    return ((r[:, None] - r[None, :]) ** 2 + (c[:, None] - c[None, :]) ** 2).sqrt()


def initial_module(ckpt: Path, seed: int):
    """The run's model at step 0: MaskPriorModule rebuilt from the checkpoint's hyperparameters with the run's seed."""
    import lightning as L

    from lightning_maskprior.module import MaskPriorModule

    hparams = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]
    accepted = set(inspect.signature(MaskPriorModule.__init__).parameters) - {"self", "task"}
    L.seed_everything(seed, verbose=False)
    return MaskPriorModule(**{k: v for k, v in hparams.items() if k in accepted}).eval()


@torch.no_grad()
def layer_stats(module, images: torch.Tensor) -> list[dict[str, list[float]]]:
    from lightning_maskprior.attention import attention_probabilities

    backbone = module.backbone
    prefix = int(getattr(backbone, "num_prefix_tokens", 0))
    rows, cols = backbone.patch_grid()
    dist = grid_distance(rows, cols)
    probs = attention_probabilities(backbone, images)
    structure = module.structure
    open_all = structure.expanded(len(probs), probs[0].shape[1]).float() if structure is not None else None
    tokens = probs[0].shape[-1]
    rollout = torch.eye(tokens)
    out = []
    for l, p in enumerate(probs):
        p = p.float()  # (B, H, T, T)
        q = p[:, :, prefix:, :]  # patch queries
        entropy = -(q * q.clamp_min(1e-12).log()).sum(-1).mean(dim=(0, 2))
        cls_mass = q[..., :prefix].sum(-1).mean(dim=(0, 2)) if prefix else torch.zeros(q.shape[1])
        patch = q[..., prefix:]
        mean_dist = ((patch * dist).sum(-1) / patch.sum(-1).clamp_min(1e-12)).mean(dim=(0, 2))
        open_mass = ((q * open_all[l][:, prefix:, :]).sum(-1).mean(dim=(0, 2)) if open_all is not None
                     else torch.full((q.shape[1],), math.nan))
        a = p.mean(dim=(0, 1))
        rollout = (0.5 * a + 0.5 * torch.eye(tokens)) @ rollout
        r = rollout[prefix:, prefix:]
        r = r / r.sum(-1, keepdim=True).clamp_min(1e-12)
        sorted_mass = r.sort(dim=-1, descending=True).values.cumsum(-1)
        erf90 = (sorted_mass < 0.9).sum(-1).float().add(1).mean()
        erf_dist = (r * dist).sum(-1).mean()
        out.append({"entropy": entropy.tolist(), "cls_mass": cls_mass.tolist(), "dist": mean_dist.tolist(),
                    "open_mass": open_mass.tolist(), "erf90": [float(erf90)], "erf_dist": [float(erf_dist)]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--inits", nargs="*", default=None, help="init labels to include (default: all)")
    parser.add_argument("--per-head", action="store_true")
    args = parser.parse_args()

    from lightning_maskprior import load_run
    from lightning_maskprior.run.rundir import find_checkpoint

    run_dirs = sorted(p for p in args.study.glob(f"*/*/seed{args.seed}") if p.is_dir())
    if args.inits is not None:
        run_dirs = [p for p in run_dirs if p.parent.name in args.inits]
    if not run_dirs:
        raise SystemExit(f"no run directories {args.study}/<task>/<init>/seed{args.seed}")
    metrics = ("entropy", "cls_mass", "dist", "open_mass", "erf90", "erf_dist")
    records = []
    for run_dir in run_dirs:
        try:
            ckpt = find_checkpoint(run_dir)
        except FileNotFoundError:
            print(f"skip {run_dir}: no checkpoint")
            continue
        module, datamodule = load_run(run_dir)
        images = next(iter(datamodule.val_dataloader()))["inputs"][: args.images]
        config = ckpt.parent.parent / "config.yaml"
        seed = args.seed
        if config.is_file():
            seed = int((yaml.safe_load(config.read_text()) or {}).get("seed_everything", seed))
        for state, model in (("init", initial_module(ckpt, seed)), ("trained", module)):
            for layer, stats in enumerate(layer_stats(model, images)):
                record = {"task": run_dir.parent.parent.name, "init": run_dir.parent.name, "seed": args.seed,
                          "state": state, "layer": layer}
                for name in metrics:
                    values = stats[name]
                    record[name] = sum(values) / len(values)
                    if args.per_head and len(values) > 1:
                        record.update({f"{name}_h{h}": v for h, v in enumerate(values)})
                records.append(record)

    head = ["task", "init", "state", "layer", *metrics]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in records:
        print("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in head) + " |")
    keys = list(dict.fromkeys(k for r in records for k in r))
    with open(args.study / "attention_stats.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(records)
    print(f"\nwrote {args.study / 'attention_stats.csv'}")


if __name__ == "__main__":
    main()

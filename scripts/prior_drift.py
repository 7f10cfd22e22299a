"""How far the language prior moved from its start, and how local each init's attention is (the paper's Table 6).

    python scripts/prior_drift.py runs/study/pydoc_long [--seed 1337] [--blocks 32]

For each run ``<study>/<task>/<init>/seed<k>`` (final checkpoint):

- every layer with a prior M (``mask``; the paper: M_ij = -max(i - j, 0) at init, applied as log sigmoid(10 M) with
  the causal mask): the mean of M at distances 0..4 against its start (0, -1, ..., -4), the RMS of M - M0 over the
  causal entries (what PriorPersistence logs as persistence/prior_drift, there over all N x N entries) and the largest
  |M - M0|;
- every layer of every init: on the first ``--blocks`` validation blocks, the attention on the token itself (rows
  1..63), on the previous token, and the mean distance i - j attended to. A model that only looks at itself is a
  bigram-like model, whatever its init.

The per-step curve of the drift is in the study's curves.csv.gz (persistence/prior_drift, with
language/ablations/pydoc_long.yaml's PriorPersistence). Inference only: seconds per run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


@torch.no_grad()
def prior_rows(module) -> list[dict]:
    from lightning_maskprior.attention import attention_layers

    rows = []
    structure = module.structure
    for l, layer in enumerate(attention_layers(module)):
        m = layer.prior_matrix()
        if m is None:
            continue
        m = m.detach().float()  # (heads or 1, N, N)
        m0 = structure.layer_values(l) if structure is not None and structure.graded else None
        if m0 is None:
            continue
        m0 = m0.float().expand_as(m)
        n = m.shape[-1]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        causal = (j <= i).expand_as(m)
        delta = (m - m0)[causal]
        row = {"layer": l, "scale": layer.prior_scale, "rms_drift": delta.pow(2).mean().sqrt().item(),
               "max_drift": delta.abs().max().item()}
        for d in range(5):
            diag = torch.diagonal(m, offset=-d, dim1=-2, dim2=-1)
            row[f"M_d{d}"] = diag.mean().item()
        rows.append(row)
    return rows


@torch.no_grad()
def attention_rows(module, inputs: torch.Tensor) -> list[dict]:
    from lightning_maskprior.attention import attention_probabilities

    rows = []
    for l, p in enumerate(attention_probabilities(module.backbone, inputs)):
        p = p.float()[:, :, 1:, :]  # rows 1..N-1 (row 0 can only attend to itself)
        n = p.shape[-1]
        i = torch.arange(1, n)[:, None]
        j = torch.arange(n)[None, :]
        self_mass = (p * (i == j)).sum(-1).mean().item()
        prev_mass = (p * (i - 1 == j)).sum(-1).mean().item()
        distance = (p * (i - j).clamp_min(0)).sum(-1).mean().item()
        rows.append({"layer": l, "self": self_mass, "previous": prev_mass, "mean_distance": distance})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", type=Path)
    parser.add_argument("--seed", type=int, default=None, help="only this seed (default: every seed)")
    parser.add_argument("--blocks", type=int, default=32)
    args = parser.parse_args()

    from lightning_maskprior import load_run

    pattern = f"*/*/seed{args.seed}" if args.seed is not None else "*/*/seed*"
    run_dirs = sorted(p for p in args.study.glob(pattern) if p.is_dir())
    if not run_dirs:
        raise SystemExit(f"no run directories {args.study}/{pattern}")
    print("| task | init | seed | layer | M d=0 | d=1 | d=2 | d=3 | d=4 | RMS(M-M0) | max abs(M-M0) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    attention = []
    for run_dir in run_dirs:
        try:
            module, datamodule = load_run(run_dir)
        except FileNotFoundError as err:
            print(f"skip {run_dir}: {err}")
            continue
        task, init, seed = run_dir.parent.parent.name, run_dir.parent.name, run_dir.name
        for r in prior_rows(module):
            print(f"| {task} | {init} | {seed} | {r['layer']} | " + " | ".join(f"{r[f'M_d{d}']:.3f}" for d in range(5))
                  + f" | {r['rms_drift']:.4f} | {r['max_drift']:.3f} |")
        inputs = next(iter(datamodule.val_dataloader()))["inputs"][: args.blocks]
        attention += [(task, init, seed, r) for r in attention_rows(module, inputs)]
    print("\n(M at init: 0, -1, -2, -3, -4 at distances 0..4.)\n")
    print("| task | init | seed | layer | attention on self | on previous token | mean distance |")
    print("|---|---|---|---:|---:|---:|---:|")
    for task, init, seed, r in attention:
        print(f"| {task} | {init} | {seed} | {r['layer']} | {r['self']:.3f} | {r['previous']:.3f} | "
              f"{r['mean_distance']:.2f} |")


if __name__ == "__main__":
    main()

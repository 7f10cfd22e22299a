"""Seen-region MSE of Boolean runs over training, from the data files of `maskprior study`.

    python scripts/seen_mse.py runs/study/cyclic3_small_const [more dirs ...] [--inits default]

The study must list ``val/mse`` and ``val/unseen_mse`` among its ``curves`` (the
configs/study/ablations/cyclic3_*.yaml
files do). The full-cube MSE is the seen and unseen MSE weighted by their shares of the cube, so

    seen_mse = (mse - f * unseen_mse) / (1 - f),   f = unseen share (cyclic3: x0 = x1 = x2 = -1, 1/8).

Prints, per study / task / init / seed: the final accuracy over the cube, the final seen-region MSE, the first epoch
at which the seen MSE is below ``--threshold`` (0.1: "fits the seen region") and whether the
run meets the targets (default: 87.5% +- 1 with seen MSE < 0.1; mask: >= 99.9%). Writes ``seen_mse.csv`` and
``seen_mse.png`` (seen MSE against epochs, one line per task row and seed, log scale) to ``--out`` (default: the
first study dir). Reads only the data files; nothing is trained.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from collections import defaultdict
from pathlib import Path


def read_curves(study_dir: Path) -> list[dict]:
    path = study_dir / "curves.csv.gz"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: the study writes it at its end (or run `maskprior report {study_dir}`"
                         " after `maskprior study ... --table_only true`)")
    with gzip.open(path, "rt") as f:
        return list(csv.DictReader(io.StringIO(f.read())))


def seen_series(rows: list[dict], unseen_fraction: float) -> dict[tuple, list[tuple[float, float, float]]]:
    """(task, init, seed) -> [(epoch, seen_mse, acc)] at every validation."""
    values: dict[tuple, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    epochs: dict[tuple, dict[int, float]] = defaultdict(dict)
    for row in rows:
        if row["tag"] not in ("val/mse", "val/unseen_mse", "val/acc"):
            continue
        key = (row["task"], row["init"], int(row["seed"]))
        step = int(row["step"])
        values[key][step][row["tag"]] = float(row["value"])
        if row["epoch"]:
            epochs[key][step] = float(row["epoch"])
    out = {}
    for key, by_step in values.items():
        points = []
        for step in sorted(by_step):
            v = by_step[step]
            if "val/mse" not in v or "val/unseen_mse" not in v:
                continue
            seen = (v["val/mse"] - unseen_fraction * v["val/unseen_mse"]) / (1.0 - unseen_fraction)
            points.append((epochs[key].get(step, float(step)), seen, v.get("val/acc", float("nan"))))
        if points:
            out[key] = points
    return out


def verdict(init: str, acc: float, seen: float, threshold: float) -> str:
    if init.startswith("mask"):
        return "meets" if acc >= 0.999 else "short"
    if init in ("default", "zero", "qk_svd", "qk_opt"):
        return "at MDI" if abs(acc - 0.875) <= 0.01 and seen < threshold else "not at MDI"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="+", type=Path)
    parser.add_argument("--unseen-fraction", type=float, default=0.125, help="unseen share of the cube (cyclic3: 1/8)")
    parser.add_argument("--threshold", type=float, default=0.1, help="seen-region MSE that counts as fitted")
    parser.add_argument("--inits", nargs="*", default=None, help="only these init labels in the figure (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or args.studies[0]

    table, series = [], {}
    for study in args.studies:
        for (task, init, seed), points in sorted(seen_series(read_curves(study), args.unseen_fraction).items()):
            first = next((e for e, s, _ in points if s < args.threshold), None)
            epoch, seen, acc = points[-1]
            table.append({"study": study.name, "task": task, "init": init, "seed": seed, "final_epoch": epoch,
                          "acc_pct": round(100 * acc, 2), "seen_mse": round(seen, 5),
                          "first_epoch_seen_mse_below": first, "verdict": verdict(init, acc, seen, args.threshold)})
            series[(study.name, task, init, seed)] = points

    print(f"| study | task | init | seed | epoch | acc % | seen MSE | first epoch seen MSE < {args.threshold} "
          "| target |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for r in table:
        first = "-" if r["first_epoch_seen_mse_below"] is None else f"{r['first_epoch_seen_mse_below']:.0f}"
        print(f"| {r['study']} | {r['task']} | {r['init']} | {r['seed']} | {r['final_epoch']:.0f} | {r['acc_pct']:.2f} "
              f"| {r['seen_mse']:.4f} | {first} | {r['verdict']} |")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "seen_mse.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["study", "task", "init", "seed", "epoch", "seen_mse", "acc"])
        for (study, task, init, seed), points in series.items():
            for epoch, seen, acc in points:
                writer.writerow([study, task, init, seed, f"{epoch:.4g}", f"{seen:.6g}", f"{acc:.6g}"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inits = sorted({k[2] for k in series if args.inits is None or k[2] in args.inits})
    fig, axes = plt.subplots(1, len(inits), figsize=(5.5 * len(inits), 4), squeeze=False, sharey=True)
    rows = sorted({(k[0], k[1]) for k in series})
    colours = {row: f"C{i % 10}" for i, row in enumerate(rows)}
    for ax, init in zip(axes[0], inits, strict=True):
        for (study, task, label, seed), points in sorted(series.items()):
            if label != init:
                continue
            xs, ys = [p[0] for p in points], [max(p[1], 1e-5) for p in points]
            ax.plot(xs, ys, color=colours[(study, task)], alpha=1.0 if seed == 0 else 0.45,
                    label=f"{task}" if seed == min(k[3] for k in series if k[:3] == (study, task, label)) else None)
        ax.axhline(args.threshold, color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_title(f"{init}: seen-region MSE (val)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("seen-region MSE (MDI: 0)")
    fig.tight_layout()
    fig.savefig(out / "seen_mse.png", dpi=120)
    print(f"\nwrote {out / 'seen_mse.csv'} and {out / 'seen_mse.png'}")


if __name__ == "__main__":
    main()

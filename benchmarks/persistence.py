"""Does the structure survive training? Persistence curves of several inits on one task, side by side.

    python benchmarks/persistence.py                                  # 2parity, mask vs qk_opt, CPU scale
    python benchmarks/persistence.py --inits mask qk_opt default --root runs/persistence
    python benchmarks/persistence.py --skip-fit --root runs/persistence   # only read existing runs

Each init is one ``maskprior fit`` run (one after the other) of the task config, which enables
PriorPersistence; the curves are read back from the TensorBoard event files. the paper's thesis:
the mask's score (open attention mass relative to step 0) stays >= 0.9, a query/key init's falls
below 0.5 (its half-life is the first step where it does).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from lightning_maskprior.run.scalars import read_scalars

ROOT = Path(__file__).resolve().parents[1]


def run(config: str, init: str, root: Path, extra: list[str]) -> None:
    command = [sys.executable, "-m", "lightning_maskprior.cli", "fit", "-c", config,
               "-c", str(ROOT / f"configs/init/{init}.yaml"), "--trainer.enable_progress_bar", "false",
               "--trainer.default_root_dir", str(root / init), *extra]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def summary(root: Path, init: str) -> dict[str, object]:
    # <root>/<init>/<task>-<init>-seed<k>/version_N (cli.run_name); the newest run counts.
    runs = sorted((root / init).glob("*/version_*"), key=lambda p: p.stat().st_mtime)
    scalars = read_scalars(runs[-1])
    score = scalars["persistence/score"]
    half = scalars.get("persistence/half_life")
    layers = sorted({t.split("/")[2] for t in scalars if t.startswith("persistence_heads/open_mass/layer")})
    per_layer = {}
    for layer in layers:
        heads = [v for t, v in scalars.items() if t.startswith(f"persistence_heads/open_mass/{layer}/")]
        per_layer[layer] = (sum(h[0][1] for h in heads) / len(heads), sum(h[-1][1] for h in heads) / len(heads))
    last = {k: scalars[k][-1][1] for k in ("val/acc", "val/mse", "extrapolation/closer_to_mdi") if k in scalars}
    return {"score_min": min(v for _, v in score), "score_last": score[-1][1], "steps": score[-1][0],
            "half_life": int(half[0][1]) if half else None, "open_mass_by_layer": per_layer, **last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/boolean/2parity.yaml"))
    parser.add_argument("--inits", nargs="+", default=["mask", "qk_opt"])
    parser.add_argument("--root", type=Path, default=Path("runs/persistence"))
    parser.add_argument("--skip-fit", action="store_true", help="only read runs already under --root")
    args, extra = parser.parse_known_args()
    for init in args.inits:
        if not args.skip_fit:
            run(args.config, init, args.root, extra)
    for init in args.inits:
        s = summary(args.root, init)
        layers = "  ".join(f"{k} {a:.2f}->{b:.2f}" for k, (a, b) in s.pop("open_mass_by_layer").items())
        print(f"{init:>8}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in s.items()))
        print(f"{'':>8}  open mass step 0 -> last: {layers}")


if __name__ == "__main__":
    main()

"""The persistence of each run of a study, from the attention maps it saved at the start and the end of training.

    python scripts/open_mass.py runs/study/arithmetic_qk_baselines [docs/results/arithmetic_paper_lsd_operands ...]

Every study run saves ``attention_maps.npz`` (callbacks/attention_record.py: the attention of a probe batch at step 0
and at the last step, per layer and head, and the structure it is measured against); a published result directory
keeps them in one ``attention_maps.npz`` keyed ``<task>/<init>/``. For each run this prints the attention mass on the
structure's open entries (each query's probability on its open keys, averaged over queries, heads and layers) at the
start and at the end, and their ratio (the final value of PriorPersistence's ``persistence/score``, for runs that did
not log the callback); then the same over the queries whose row closes something (where a structure opens most
pairs, uniform attention already puts most of its mass on open entries). It reads the saved maps only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def open_mass(attention: np.ndarray, structure: np.ndarray, restricted: bool = False) -> float:
    """Mean over layers, heads and queries of the probability on open entries; ``attention`` (layers, heads, N, N).
    ``restricted``: over the queries whose row closes something only (a fully open row has all its mass open)."""
    open = structure > 0
    mass = (attention * open).sum(-1)
    if not restricted:
        return float(mass.mean())
    rows = ~open.all(-1)
    return float(mass[rows].mean()) if rows.any() else float("nan")


def runs(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """``{name: maps}`` of a study out_dir (one file per run directory) or a result directory (one file, keyed)."""
    found: dict[str, dict[str, np.ndarray]] = {}
    single = path / "attention_maps.npz"
    if single.is_file():
        with np.load(single) as data:
            for key in data.files:
                name, field = key.rsplit("/", 1)
                found.setdefault(name, {})[field] = data[key]
    for file in sorted(path.glob("*/*/seed*/attention_maps.npz")):  # a run's own file stands for its collected copy
        name = str(file.parent.relative_to(path))
        found.pop(name.rsplit("/", 1)[0], None)
        with np.load(file) as data:
            found[name] = {key: data[key] for key in data.files}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="study out_dirs or result directories")
    args = parser.parse_args()
    print("| run | open mass, step 0 | end | end / step 0 | restricted rows: step 0 | end | end / step 0 | end step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for directory in args.dirs:
        for name, maps in runs(directory).items():
            if not {"start", "end", "structure"} <= maps.keys():
                continue
            cells = []
            for restricted in (False, True):
                start, end = (open_mass(maps[when], maps["structure"], restricted) for when in ("start", "end"))
                cells += [f"{start:.3f}", f"{end:.3f}", f"{end / start:.3f}"]
            print(f"| {name} | {' | '.join(cells)} | {int(maps.get('end_step', -1))} |")


if __name__ == "__main__":
    main()

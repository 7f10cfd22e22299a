"""Which definition of the arithmetic test loss agrees with the accuracies printed beside it (Table 2).

    python scripts/loss_reading.py [RESULT_DIR ...] [--task NAME=PAPER_TASK ...]

A digit whose prediction is wrong has p(true digit) < 1/2, so it costs more than ln 2 nats. A loss that is the mean
over answer digits is therefore at least (1 - digit accuracy) ln 2, and one summed over the D answer digits (a
product of two 3-digit numbers has 6, a sum 4) at least D times that. Label smoothing eps puts a floor under any
loss, the entropy of the smoothed target, which the smallest loss printed bounds. For each of the paper's Table 2
cells this prints the loss, both bounds, and the loss per wrong digit (nats) under the mean reading; then the same
for the runs of each RESULT_DIR (a `maskprior study` result directory: its results.csv, mean over seeds), whose
loss is the project's (cross-entropy averaged over answer digits). Reads only data files; nothing is trained.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_maskprior.study.paper_results import METHOD_LABELS, TABLES  # noqa: E402

ANSWER_DIGITS = {"multiplication": 6, "addition": 4}  # 3-digit operands: a product < 10^6, a sum < 2000
BASE = 10


def smoothing_floor(eps: float, classes: int = BASE) -> float:
    """The least cross-entropy any model reaches against targets smoothed by ``eps`` over ``classes``."""
    high, low = 1 - eps + eps / classes, eps / classes
    return -(high * math.log(high)) - (classes - 1) * (low * math.log(low) if low > 0 else 0.0)


def largest_smoothing(loss: float) -> float:
    """The largest label smoothing whose floor is not above ``loss`` (bisection; the floor grows with eps)."""
    lo, hi = 0.0, 0.9
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if smoothing_floor(mid) <= loss else (lo, mid)
    return lo


def row(source: str, task: str, method: str, digit_acc: float, loss: float, known_mean: bool = False) -> str:
    """One line of the table: ``digit_acc`` a fraction, ``loss`` the printed value; ``known_mean``: the loss is
    known to be the mean over digits (the project's), so the sum reading is not asked."""
    wrong = 1 - digit_acc
    bounds = {"mean": wrong * math.log(2), "sum": ANSWER_DIGITS[task] * wrong * math.log(2)}
    cells = {k: f"{b:.3f} ({'fits' if loss >= b else 'impossible'})" for k, b in bounds.items()}
    if known_mean:
        cells["sum"] = "-"
    per_wrong = f"{loss / wrong:.2f}" if wrong > 0 else "-"
    return (f"| {source} | {task} | {method} | {100 * digit_acc:.2f} | {loss:.3f} | {cells['mean']} "
            f"| {cells['sum']} | {per_wrong} |")


def paper_rows() -> list[str]:
    results = TABLES["2"]["results"]
    return [row("paper", task, METHOD_LABELS[method], cell["digit_acc"] / 100, cell["loss"])
            for task, methods in results.items() for method, cell in methods.items()]


def our_rows(result_dir: Path, tasks: dict[str, str]) -> list[str]:
    """Mean over seeds of each (task, init) of ``result_dir``'s finished runs whose task names a paper task."""
    path = result_dir / "results.csv"
    if not path.is_file():
        sys.exit(f"loss_reading: {path} does not exist (give a `maskprior study` result directory)")
    cells: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for run in csv.DictReader(f):
            paper_task = tasks.get(run["task"], run["task"])
            if run["status"] == "ok" and paper_task in ANSWER_DIGITS and run.get("test/loss"):
                cells[(run["task"], run["init"])].append((float(run["test/digit_acc"]), float(run["test/loss"])))
    return [row(f"{result_dir.name} ({len(v)} seed{'s' * (len(v) > 1)})", tasks.get(task, task), f"{init} ({task})",
                statistics.mean(a for a, _ in v), statistics.mean(loss for _, loss in v), known_mean=True)
            for (task, init), v in sorted(cells.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage=__doc__.split("\n\n")[1].strip(), epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result_dirs", nargs="*", type=Path, help="`maskprior study` result directories")
    parser.add_argument("--task", action="append", default=[], metavar="NAME=PAPER_TASK",
                        help="read the study's task NAME as the paper's (e.g. "
                             "multiplication_dependency_rows=multiplication); a name ending in a paper task's name "
                             "is read as it without this")
    args = parser.parse_args()
    tasks = dict(item.split("=", 1) for item in args.task)
    for result_dir in args.result_dirs:
        if (result_dir / "results.csv").is_file():
            with open(result_dir / "results.csv", newline="") as f:
                for name in {r["task"] for r in csv.DictReader(f)}:
                    tasks.setdefault(name, next((t for t in ANSWER_DIGITS if name.startswith(t)), name))
    print("| source | task | method | digit acc % | loss | mean over digits: bound | sum over digits: bound "
          "| nats per wrong digit (mean) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for line in paper_rows() + [r for d in args.result_dirs for r in our_rows(d, tasks)]:
        print(line)
    smallest = min(cell["loss"] for methods in TABLES["2"]["results"].values() for cell in methods.values())
    print(f"\nLabel smoothing: the paper's smallest loss, {smallest}, allows eps <= {largest_smoothing(smallest):.3f} "
          f"(eps = 0.1 puts every loss at >= {smoothing_floor(0.1):.3f}).")


if __name__ == "__main__":
    main()

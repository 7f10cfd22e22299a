"""Add-k bigram (and unigram) count models on the language datamodule's own tokens, beside a study's perplexities.

    python scripts/bigram_baseline.py                                  # pydoc, the baselines alone
    # and the study's runs beside them:
    python scripts/bigram_baseline.py --study runs/study/pydoc_long

The datamodule is built from the config's ``data`` section (default configs/language/pydoc.yaml: the same 2048-token
BPE and splits as the runs, from the cache in ~/.cache/lightning_maskprior/language). Counts come from the training
split; P(next | prev) = (c(prev, next) + k) / (c(prev) + k V). Perplexity is over every token of a split after its
first, each predicted from the one before it: exactly the targets the GPT is scored on (the blocks are packed
back to back, so the first target of a block has the last token of the previous block as context). k is chosen on
the validation split (the model's checkpoint selection has no such freedom: it is scored at its last step); the
test column at that k is the fair comparison. On pydoc: val / test 62.3 / 144.6 at k = 0.01.

With ``--study``: the study's per_seed.csv (metric columns ``val ppl`` / ``test ppl``, as
configs/study/ablations/pydoc_long.yaml labels them) as mean +- sample std over seeds per init, with
the baselines as extra rows, and the best validation perplexity each run reached (from curves.csv.gz), to
show whether it overfits before its end.
Counting only: seconds.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
import statistics
from collections import defaultdict
from pathlib import Path

import torch
import yaml


def load_ids(config: Path) -> tuple[dict[str, torch.Tensor], int]:
    from lightning_maskprior.module import build_datamodule

    data = (yaml.safe_load(config.read_text()) or {}).get("data")
    if not isinstance(data, dict) or "class_path" not in data:
        raise SystemExit(f"{config} has no data section with a class_path")
    datamodule = build_datamodule(data)
    datamodule._build()  # tokenizer and token ids (cached)
    return {s: datamodule.ids[s].long() for s in ("train", "validation", "test")}, datamodule.tokenizer.get_vocab_size()


def ngram_ppl(ids: dict[str, torch.Tensor], vocab: int, k: float) -> dict[str, float]:
    train = ids["train"]
    pair = torch.bincount(train[:-1] * vocab + train[1:], minlength=vocab * vocab).view(vocab, vocab).double()
    row = pair.sum(1, keepdim=True)
    out = {}
    for split in ("validation", "test"):
        x = ids[split]
        prev, nxt = x[:-1], x[1:]
        logp = torch.log(pair[prev, nxt] + k) - torch.log(row[prev, 0] + k * vocab)
        out[split] = math.exp(-logp.mean().item())
    return out


def unigram_ppl(ids: dict[str, torch.Tensor], vocab: int, k: float) -> dict[str, float]:
    counts = torch.bincount(ids["train"], minlength=vocab).double()
    logp_all = torch.log(counts + k) - math.log(counts.sum().item() + k * vocab)
    return {s: math.exp(-logp_all[ids[s][1:]].mean().item()) for s in ("validation", "test")}


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def study_rows(study: Path) -> tuple[list[str], dict[tuple[str, str], dict[str, list[float]]]]:
    path = study / "per_seed.csv"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist (the study writes it after every run)")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        skip = {"task", "init", "seed", "status", "wall_seconds", "precision", "persistence_score_end",
                "half_life_step"}
        columns = [c for c in reader.fieldnames or [] if c not in skip]
        rows: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in reader:
            if r.get("status") != "ok":
                continue
            for c in columns:
                if r.get(c):
                    rows[(r["task"], r["init"])][c].append(float(r[c]))
            if r.get("wall_seconds"):
                rows[(r["task"], r["init"])]["minutes"].append(float(r["wall_seconds"]) / 60)
    best = best_val(study)
    for key, per_seed in best.items():
        rows[key]["best val ppl (step)"] = per_seed
    return columns, rows


def best_val(study: Path) -> dict[tuple[str, str], list[float]]:
    """Per (task, init): each seed's lowest val/ppl over training (curves.csv.gz, if the study has it)."""
    path = study / "curves.csv.gz"
    if not path.is_file():
        return {}
    lowest: dict[tuple[str, str, str], float] = {}
    with gzip.open(path, "rt") as f:
        for r in csv.DictReader(io.StringIO(f.read())):
            if r["tag"] == "val/ppl":
                key = (r["task"], r["init"], r["seed"])
                lowest[key] = min(lowest.get(key, math.inf), float(r["value"]))
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (task, init, _), value in sorted(lowest.items()):
        out[(task, init)].append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/language/pydoc.yaml"))
    parser.add_argument("--k", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0])
    parser.add_argument("--study", type=Path, default=None)
    args = parser.parse_args()

    ids, vocab = load_ids(args.config)
    print("tokens: " + ", ".join(f"{s} {len(v):,}" for s, v in ids.items()) + f"; vocabulary {vocab}")
    print("\n| model | k | val ppl | test ppl |\n|---|---:|---:|---:|")
    results = []
    for k in args.k:
        b = ngram_ppl(ids, vocab, k)
        results.append((k, b))
        print(f"| bigram | {k:g} | {b['validation']:.1f} | {b['test']:.1f} |")
    uni = unigram_ppl(ids, vocab, 1.0)
    print(f"| unigram | 1 | {uni['validation']:.1f} | {uni['test']:.1f} |")
    k_best, best = min(results, key=lambda kb: kb[1]["validation"])
    print(f"\nbigram, k chosen on validation: k = {k_best:g}: val {best['validation']:.1f} / test {best['test']:.1f}")

    if args.study is not None:
        columns, rows = study_rows(args.study)
        shown = [*columns, "best val ppl (step)", "minutes"]
        print(f"\n{args.study}: mean ± sample std over seeds\n")
        print("| task | init | " + " | ".join(shown) + " |")
        print("|---|---|" + "---:|" * len(shown))
        for (task, init), values in sorted(rows.items()):
            print(f"| {task} | {init} | " + " | ".join(mean_sd(values.get(c, [])) for c in shown) + " |")
        cells = {"val ppl": f"{best['validation']:.1f}", "test ppl": f"{best['test']:.1f}"}
        print(f"| - | bigram (k={k_best:g}) | " + " | ".join(cells.get(c, "-") for c in shown) + " |")
        cells = {"val ppl": f"{uni['validation']:.1f}", "test ppl": f"{uni['test']:.1f}"}
        print("| - | unigram (k=1) | " + " | ".join(cells.get(c, "-") for c in shown) + " |")


if __name__ == "__main__":
    main()

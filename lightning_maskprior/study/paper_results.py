"""The paper's published numbers (Ma et al., arXiv 2608.00418), as data, for `maskprior study` tables.

Transcribed from the paper: Tables 1, 2, 3, 4 and 6. Accuracies are in percent, as the
paper prints them. ``None`` marks a cell the paper leaves empty ("-").
"""

from __future__ import annotations

PAPER = "Ma et al., Mask-Based Priors Are More Persistent than Query-Key Initializations, arXiv 2608.00418"

# Column names the paper uses for each init method.
METHOD_LABELS: dict[str, str] = {
    "default": "Default",
    "zero": "Zero mask",
    "fixed": "Fixed mask",
    "mask": "Mask",
    "qk_svd": "QK-SVD",
    "qk_opt": "QK-Opt",
    "mimetic": "Mimetic",
    "impulse": "Impulse",
}

# Column names of the labelled variants of a method that a study runs beside the paper's settings.
VARIANT_LABELS: dict[str, str] = {
    "qk_svd_strong": "QK-SVD (positions x50)",
    "qk_opt_strong": "QK-Opt (positions x50, lr 1e-2, 500 steps)",
    "qk_svd_pos18": "QK-SVD (positions x18)",
    "mask_decayed": "Mask (M under weight decay)",
}


def _mse_acc(mse: float, acc: float | None) -> dict[str, float | None]:
    return {"mse": mse, "acc": acc}


def _arith(seq_acc: float, digit_acc: float, loss: float) -> dict[str, float]:
    return {"seq_acc": seq_acc, "digit_acc": digit_acc, "loss": loss}


def _ppl(val: float, test: float) -> dict[str, float]:
    return {"val_ppl": val, "test_ppl": test}


# table -> {"title", "metrics": {key: meaning}, "results": {task: {method: {metric: value}}}}
TABLES: dict[str, dict] = {
    "1": {
        "title": "Table 1: Boolean extrapolation (GOTU), test MSE over the full cube / accuracy %",
        "metrics": {"mse": "test MSE over the full cube", "acc": "accuracy % over the full cube"},
        "results": {
            "2parity": {
                "default": _mse_acc(1.379, 75.00),
                "qk_svd": _mse_acc(1.737, 75.00),
                "qk_opt": _mse_acc(1.746, 75.00),
                "mask": _mse_acc(0.0029, 100.00),
            },
            "cyclic3": {
                "default": _mse_acc(5.648, 87.45),
                "qk_svd": _mse_acc(3.257, 87.48),
                "qk_opt": _mse_acc(3.230, 87.47),
                "mask": _mse_acc(0.0034, 99.98),
            },
            "majority3": {
                "default": _mse_acc(0.509, 87.40),
                "qk_svd": _mse_acc(0.516, 87.40),
                "qk_opt": _mse_acc(0.495, 87.40),
                "mask": _mse_acc(0.0051, 100.00),
            },
            "threesym": {
                "default": _mse_acc(7.621, None),
                "qk_svd": _mse_acc(7.616, None),
                "qk_opt": _mse_acc(7.635, None),
                "mask": _mse_acc(2.9745, None),
            },
        },
    },
    "2": {
        "title": "Table 2: arithmetic (multiplication 3% data, addition 0.4% data), "
        "sequence acc % / digit acc % / test loss",
        "metrics": {"seq_acc": "sequence accuracy %", "digit_acc": "digit accuracy %", "loss": "test loss"},
        "results": {
            "multiplication": {
                "default": _arith(5.01, 70.78, 2.27),
                "qk_svd": _arith(11.13, 74.57, 1.77),
                "qk_opt": _arith(27.82, 82.37, 0.85),
                "mask": _arith(69.49, 94.13, 0.20),
            },
            "addition": {
                "default": _arith(1.19, 40.59, 4.51),
                "qk_svd": _arith(0.87, 38.56, 4.59),
                "qk_opt": _arith(3.39, 49.87, 3.40),
                "mask": _arith(77.49, 93.86, 0.23),
            },
        },
    },
    "3": {
        "title": "Table 3: vision, ViT-Tiny top-1 %",
        "metrics": {"top1": "top-1 accuracy %"},
        "results": {
            "cifar10": {"default": {"top1": 94.20}, "mimetic": {"top1": 94.80}, "impulse": {"top1": 95.12},
                        "fixed": {"top1": 94.16}, "mask": {"top1": 95.66}},
            "cifar100": {"default": {"top1": 74.00}, "mimetic": {"top1": 76.80}, "impulse": {"top1": 76.47},
                         "fixed": {"top1": 78.77}, "mask": {"top1": 77.95}},
            "imagenet100": {"default": {"top1": 83.38}, "mimetic": {"top1": 84.38}, "impulse": {"top1": 83.16},
                            "fixed": {"top1": 81.78}, "mask": {"top1": 85.92}},
        },
    },
    "4": {
        "title": "Table 4: zero-mask ablation, Boolean extrapolation, test MSE / accuracy %",
        "metrics": {"mse": "test MSE over the full cube", "acc": "accuracy % over the full cube"},
        "results": {
            "2parity": {"zero": _mse_acc(1.38, 75.00)},
            "cyclic3": {"zero": _mse_acc(2.53, 87.46)},
            "majority3": {"zero": _mse_acc(0.50, 87.40)},
            "threesym": {"zero": _mse_acc(7.62, None)},
        },
    },
    "6": {
        "title": "Table 6: language modelling, perplexity validation / test",
        "metrics": {"val_ppl": "validation perplexity", "test_ppl": "test perplexity"},
        "results": {
            "wikitext2": {"default": _ppl(172.78, 181.91), "mask": _ppl(166.76, 179.70),
                          "mimetic": _ppl(178.34, 188.87)},
            "tinystories": {"default": _ppl(10.42, 10.49), "mask": _ppl(10.40, 10.48),
                            "mimetic": _ppl(10.64, 10.60)},
        },
    },
}


def paper_value(tables: list[str], task: str, method: str, metric: str) -> float | None:
    """The paper's number for (task, method, metric), from the first of ``tables`` that has it."""
    for table in tables:
        if table not in TABLES:
            raise KeyError(f"the paper has no table {table!r} here; expected one of {sorted(TABLES)}")
        value = TABLES[table]["results"].get(task, {}).get(method, {}).get(metric)
        if value is not None:
            return value
    return None


def has_task(tables: list[str], task: str | None) -> bool:
    """Whether any of ``tables`` has a row for ``task`` (the paper's key of a study task)."""
    return task is not None and any(task in TABLES.get(table, {}).get("results", {}) for table in tables)

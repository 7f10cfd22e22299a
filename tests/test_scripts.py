"""The analysis scripts under scripts/ that the docs tell users to run: each explains itself with --help, and
seen_mse.py computes the seen-region MSE and the verdicts from a study's curves."""

import csv
import gzip
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def run(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_there_are_scripts():
    assert {p.stem for p in SCRIPTS} >= {"seen_mse", "bigram_baseline", "prior_drift", "attention_stats"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_script_explains_itself(script):
    proc = run(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and f"python scripts/{script.name}" in proc.stdout  # the docstring


def write_curves(study, rows):
    study.mkdir(parents=True)
    with gzip.open(study / "curves.csv.gz", "wt", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "init", "seed", "tag", "step", "epoch", "value"])
        writer.writeheader()
        writer.writerows(rows)


def test_seen_mse_from_a_study_s_curves(tmp_path):
    """cyclic3's unseen share is 1/8: seen = (mse - unseen_mse / 8) / (7 / 8)."""
    rows = []
    for init, acc, mse, unseen in (("default", 0.875, 0.5, 3.5), ("mask", 1.0, 0.001, 0.002)):
        for step, epoch, scale in ((10, 0, 4.0), (20, 1, 1.0)):
            rows += [{"task": "cyclic3", "init": init, "seed": 0, "tag": tag, "step": step, "epoch": epoch,
                      "value": value} for tag, value in (("val/mse", mse * scale), ("val/unseen_mse", unseen * scale),
                                                         ("val/acc", acc))]
    write_curves(tmp_path / "study", rows)
    proc = run(ROOT / "scripts/seen_mse.py", tmp_path / "study")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("|")[3].strip(): line for line in proc.stdout.splitlines() if "| cyclic3 |" in line}
    assert "| 0.0714 | 1 | at MDI |" in lines["default"]  # (0.5 - 3.5 / 8) / (7 / 8); below 0.1 from epoch 1
    assert "| 100.00 |" in lines["mask"] and lines["mask"].rstrip().endswith("| meets |")
    with open(tmp_path / "study" / "seen_mse.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and (tmp_path / "study" / "seen_mse.png").is_file()
    first = next(r for r in table if r["init"] == "default" and r["epoch"] == "0")
    assert float(first["seen_mse"]) == pytest.approx(4 * 0.0714285, rel=1e-4)


def test_seen_mse_names_a_study_without_curves(tmp_path):
    proc = run(ROOT / "scripts/seen_mse.py", tmp_path)
    assert proc.returncode != 0 and "curves.csv.gz does not exist" in proc.stderr


def test_loss_reading_rules_out_a_loss_below_what_the_wrong_digits_cost(tmp_path):
    """A wrong digit costs more than ln 2 nats: the paper's multiplication mask (94.13% of digits, loss 0.20) cannot
    be a sum over its 6 digits (>= 6 * 0.0587 * ln 2 = 0.244), and a run of ours is read per wrong digit."""
    study = tmp_path / "study"
    study.mkdir()
    with open(study / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "init", "seed", "status", "test/digit_acc", "test/loss"])
        writer.writeheader()
        writer.writerows([{"task": "multiplication_dependency_rows", "init": "mask", "seed": seed, "status": "ok",
                           "test/digit_acc": acc, "test/loss": loss} for seed, acc, loss in ((0, 0.9, 0.3),
                                                                                            (1, 0.8, 0.9))])
    proc = run(ROOT / "scripts/loss_reading.py", study)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    mask = next(line for line in lines if line.startswith("| paper | multiplication | Mask |"))
    assert "| 0.041 (fits) | 0.244 (impossible) | 3.41 |" in mask
    ours = next(line for line in lines if line.startswith("| study (2 seeds) | multiplication |"))
    assert "| 85.00 | 0.600 | 0.104 (fits) | - | 4.00 |" in ours  # mean acc 0.85, loss 0.6: 0.6 / 0.15 nats
    assert "allows eps <= 0.033" in proc.stdout

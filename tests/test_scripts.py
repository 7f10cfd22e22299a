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


def test_open_mass_reads_a_study_s_saved_maps(tmp_path):
    """Uniform attention at step 0 puts each row's open fraction on the structure; all of it at the end. A run's own
    maps stand for the study's collected copy of the same run."""
    import numpy as np

    structure = np.ones((1, 1, 3, 3))
    structure[0, 0, 0, 2] = 0  # row 0 opens 2 of 3 keys; rows 1 and 2 open all
    start = np.full((1, 1, 3, 3), 1 / 3)
    end = np.where(structure > 0, 0.5, 0.0)
    end[0, 0, 1:] = 1 / 3
    run_dir = tmp_path / "study" / "task" / "qk_opt" / "seed0"
    run_dir.mkdir(parents=True)
    np.savez(run_dir / "attention_maps.npz", start=start, end=end, structure=structure, end_step=40)
    np.savez(tmp_path / "study" / "attention_maps.npz", **{"task/qk_opt/start": start, "task/qk_opt/end": start,
                                                             "task/qk_opt/structure": structure})
    proc = run(ROOT / "scripts" / "open_mass.py", tmp_path / "study")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| task/")]
    # all rows: (2/3 + 1 + 1) / 3 = 0.889 -> 1; restricted (row 0 only): 0.667 -> 1.0
    assert rows == ["| task/qk_opt/seed0 | 0.889 | 1.000 | 1.125 | 0.667 | 1.000 | 1.500 | 40 |"]


def test_init_mass_tells_a_mask_from_the_default(tmp_path):
    """On 2parity (the two structured bits open to each other, every other row closed but its own entry), the mask's
    prior puts its rows' mass on the structure at init; the default does not."""
    proc = run(ROOT / "scripts" / "init_mass.py", "-c", "boolean/2parity.yaml", "--examples", "32",
               "--init", "default", "{}", "--init", "mask", "{}",
               "--override=--model.backbone.init_args.dim=16", "--override=--model.backbone.init_args.depth=1")
    assert proc.returncode == 0, proc.stderr
    means = {line.split(" ")[0]: float(line.split("mean ")[1].split(" ")[0]) for line in proc.stdout.splitlines()
             if " mean " in line}
    assert means["mask"] > 0.95 and means["default"] < 0.5, proc.stdout

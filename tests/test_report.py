"""``maskprior report``: tables in the paper's layout, per-seed CSV, figures (PNG + PDF) and README sections, all from
a result directory's data files, with no run directory."""

import csv
import gzip
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import CONFIGS, ROOT, TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.run.rundir import ResultDir
from lightning_maskprior.study import load_study, run_study
from lightning_maskprior.study.figures import figures
from lightning_maskprior.study.report import render, update_readme
from lightning_maskprior.study.results import load, study_info
from lightning_maskprior.study.spec import StudyError

INITS = ["default", "qk_opt", "mask"]
SEEDS = [0, 1]
METRICS = [{"tag": "test/mse", "label": "MSE", "paper": "mse"},
           {"tag": "test/acc", "label": "acc %", "scale": 100, "digits": 2, "paper": "acc"}]
# Per (init, seed): test MSE, test accuracy, wall seconds, persistence score at the end, half-life (None: never).
VALUES = {
    ("default", 0): (1.5, 0.75, 120.0, 0.9, None), ("default", 1): (1.3, 0.75, 180.0, 0.7, None),
    ("qk_opt", 0): (1.7, 0.75, 240.0, 0.3, 10.0), ("qk_opt", 1): (1.9, 0.75, 300.0, 0.45, None),
    ("mask", 0): (0.001, 1.0, 60.0, 1.0, None), ("mask", 1): (0.003, 1.0, 90.0, 0.99, None),
}


def study_dict(out_dir: Path, **changes) -> dict:
    study = {"tasks": [{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")}], "inits": INITS,
             "seeds": SEEDS, "metrics": METRICS, "curves": ["val/acc"], "paper_tables": ["1"],
             "launcher": "inprocess", "out_dir": str(out_dir)}
    return {**study, **changes}


def write_result_dir(path: Path, curves: bool = True, **changes) -> Path:
    """A result directory as a finished study leaves it: study.json, results.csv, curves.csv.gz, attention maps."""
    study = load_study(study_dict(path, **changes))
    path.mkdir(parents=True, exist_ok=True)
    (path / "study.json").write_text(json.dumps(study_info(study)))
    with open(path / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "init", "seed", "status", "seconds", "precision", "persistence/half_life",
                         "persistence/score", "test/acc", "test/mse", "error"])
        inits = {init.label for init in study.inits}
        for task in study.tasks:
            for (init, seed), (mse, acc, seconds, score, half) in VALUES.items():
                if init not in inits or seed not in study.seeds:  # a run outside the study is refused
                    continue
                writer.writerow([task.name, init, seed, "ok", seconds, "bf16-mixed", "" if half is None else half,
                                 score, acc, mse, ""])
    if not curves:
        return path
    rows = [["task", "init", "seed", "tag", "step", "epoch", "value"]]
    for task in study.tasks:
        for (init, seed), (_, acc, _, score, half) in VALUES.items():
            key = [task.name, init, seed]
            rows += [[*key, "val/acc", 9, 1, 0.6], [*key, "val/acc", 19, 2, acc], [*key, "val/mdi_acc", 19, 2, 0.75]]
            for step in (0, 10, 20):
                rows += [[*key, "persistence/open_mass", step, step / 10, 0.9 - (0.9 - score * 0.9) * step / 20],
                         [*key, "persistence/score", step, step / 10, 1 - (1 - score) * step / 20],
                         [*key, "persistence/attn_corr_rel", step, step / 10, 1.0]]
                if step:
                    rows.append([*key, "persistence/grad_q", step, step / 10, 10.0 ** -step])
            if half is not None:
                rows.append([*key, "persistence/half_life", int(half), half / 10, half])
    with gzip.open(path / ResultDir.CURVES, "wt", newline="") as f:
        csv.writer(f).writerows(rows)
    maps = {}
    for task in study.tasks:
        for init in INITS:
            for when in ("start", "end"):
                maps[f"{task.name}/{init}/{when}"] = np.full((2, 3, 4, 4), 0.25, dtype=np.float16)
                maps[f"{task.name}/{init}/{when}_step"] = np.array(0 if when == "start" else 20)
            maps[f"{task.name}/{init}/structure"] = np.eye(4, dtype=bool)[None, None].repeat(2, 0).repeat(3, 1)
    np.savez_compressed(path / ResultDir.MAPS, **maps)
    return path


@pytest.fixture
def result_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(ROOT)
    return write_result_dir(tmp_path / "fake")


# ----------------------------------------------------------------------------------------------- tables
def test_table_in_the_papers_layout(result_dir):
    md = render(result_dir, figures=False).read_text()
    lines = md.splitlines()
    assert "## MSE (test/mse; lower is better)" in md and "## acc % (test/acc x 100; higher is better)" in md
    # One table per metric; ours, then the paper's row beneath; the best mean in bold.
    mse = lines.index("| 2parity | 1.4000 ± 0.1414 | 1.8000 ± 0.1414 | **0.0020 ± 0.0014** |")
    assert lines[mse + 1] == "| *paper* | *1.3790* | *1.7460* | *0.0029* |"
    acc = lines.index("| 2parity | 75.00 ± 0.00 | 75.00 ± 0.00 | **100.00 ± 0.00** |")
    assert lines[acc + 1] == "| *paper* | *75.00* | *75.00* | *100.00* |"
    assert "| task | Default | QK-Opt | Mask |" in md
    # Wall time (minutes), persistence score at the end and half-life, means over seeds.
    assert "## Wall time per run (minutes)" in md and "| 2parity | 2.5 ± 0.7 | 4.5 ± 0.7 | 1.2 ± 0.4 |" in md
    assert "| 2parity | 0.800 ± 0.141 | 0.375 ± 0.106 | 0.995 ± 0.007 |" in md
    assert "| 2parity | never | 10 (1/2 seeds; the others never) | never |" in md
    assert "precision: bf16-mixed (all 6 runs)" in md
    assert "do not edit by hand" in md


def test_which_way_is_better_a_cost_and_a_count():
    """Seconds are a cost (lower is better); a count of found pairs is neither: nothing bold, no direction."""
    from lightning_maskprior.study.results import InitInfo
    from lightning_maskprior.study.spec import _metrics
    from lightning_maskprior.study.tables import Cell, _describe, _table

    seconds, pairs = _metrics(["discovery/seconds", {"tag": "discovery/pairs", "better": "none"}], "metrics")
    assert seconds.better == "lower" and _describe(seconds) == "discovery/seconds (discovery/seconds; lower is better)"
    assert _describe(pairs) == "discovery/pairs (discovery/pairs)"
    with pytest.raises(StudyError, match=r"metrics\[0\]: better: expected one of 'higher', 'lower', 'none' or null, "
                                         r"got 'up'"):
        _metrics([{"tag": "test/acc", "better": "up"}], "metrics")

    class Result:
        inits = [InitInfo("default", "default"), InitInfo("mask", "mask")]
        seeds = [0]

    class Task:
        name = "2parity"
        inits = None  # every init

    cells = [Cell(mean=1.0, std=None, n=1), Cell(mean=3.0, std=None, n=1)]
    for better, row in [("none", "| 2parity | 1.0 | 3.0 |"), ("lower", "| 2parity | **1.0** | 3.0 |")]:
        assert row in _table(Result(), "t", [(Task(), cells)], 1, 2, better)


def test_a_value_too_small_for_the_digits_is_not_printed_as_zero():
    """An MSE of 4.2e-05 at 4 decimals is not 0.0000: such a metric's mean (and std) keeps two significant digits;
    wall times (a cost, timing noise) keep their decimals."""
    from lightning_maskprior.study.tables import Cell, cell_text

    assert cell_text(Cell(mean=4.182e-05, n=1), 4, 1, small=True) == "4.2e-05"
    assert cell_text(Cell(mean=0.037, std=0.008, n=3), 1, 3, small=True) == "3.7e-02 ± 8.0e-03"
    assert cell_text(Cell(mean=0.0, std=0.0, n=3), 2, 3, small=True) == "0.00 ± 0.00"  # a true zero stays as it is
    assert cell_text(Cell(mean=0.00006, std=0.00001, n=3), 4, 3, small=True) == "0.0001 ± 0.0000"  # not 0 there
    assert cell_text(Cell(mean=0.016, std=0.001, n=3), 1, 3) == "0.0 ± 0.0"  # wall minutes of a tiny run: a cost


def test_bold_goes_by_the_printed_mean():
    """Two tiny means printed apart (4.2e-05, 2.0e-05) are not a tie at 4 decimals: only the better is bold; means
    printed alike are (nothing to mark)."""
    from lightning_maskprior.study.tables import Cell, best

    tiny = [Cell(mean=4.2e-05, n=1), Cell(mean=2.0e-05, n=1), Cell(mean=0.5, n=1)]
    assert best(tiny, 4, "lower", small=True) == {1}
    assert best(tiny, 4, "lower") == {0, 1}  # wall-time tables round to the digits: both print 0.0000
    assert best([Cell(mean=2.01e-05, n=1), Cell(mean=2.04e-05, n=1)], 4, "lower", small=True) == set()


def test_ties_are_not_bold(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = write_result_dir(tmp_path / "fake", curves=False, inits=["default", "qk_opt"])
    md = render(path, figures=False).read_text()
    assert "| 2parity | 75.00 ± 0.00 | 75.00 ± 0.00 |" in md  # every method ties: nothing is bold
    assert "| 2parity | **1.4000 ± 0.1414** | 1.8000 ± 0.1414 |" in md


def test_per_seed_csv_holds_the_inputs(result_dir):
    render(result_dir, figures=False)
    with open(result_dir / "per_seed.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(VALUES)
    for row in rows:
        mse, acc, seconds, score, half = VALUES[(row["init"], int(row["seed"]))]
        assert row["task"] == "2parity" and row["status"] == "ok" and row["precision"] == "bf16-mixed"
        assert float(row["MSE"]) == pytest.approx(mse) and float(row["acc %"]) == pytest.approx(acc * 100)
        assert float(row["wall_seconds"]) == seconds and float(row["persistence_score_end"]) == pytest.approx(score)
        assert row["half_life_step"] == ("" if half is None else str(half))
    with open(result_dir / "table.csv") as f:
        table = {row["task"]: row for row in csv.DictReader(f)}
    assert float(table["2parity"]["mask:MSE:mean"]) == pytest.approx(0.002)
    assert float(table["2parity"]["qk_opt:half-life:mean"]) == 10.0 and table["2parity"]["mask:MSE:paper"] == "0.0029"


# ---------------------------------------------------------------------------------------------- figures
def test_figures_have_labels_references_and_fixed_ranges(result_dir):
    made = figures(load(result_dir))
    assert set(made) == {"2parity_curves", "persistence", "2parity_persistence", "2parity_attention_maps"}
    for name, fig in made.items():
        assert fig.legends or name.endswith("attention_maps"), name  # legends sit outside the panels
        for ax in fig.axes:
            assert ax.get_legend() is None, name
            if ax.lines:  # every panel with data says what its axes are
                assert ax.get_xlabel() and ax.get_ylabel(), (name, ax.get_title())
        assert any(ax.get_xlabel() for ax in fig.axes) and any(ax.get_ylabel() for ax in fig.axes), name
    curves = made["2parity_curves"].axes[0]
    assert curves.get_ylabel() == "accuracy, full cube (%)" and curves.get_xlabel() == "epoch"
    assert any(list(line.get_ydata()) == [75.0, 75.0] for line in curves.lines)  # the MDI's accuracy
    assert sum(line.get_marker() == "*" for line in curves.lines) == 3  # the paper's number per init
    assert made["persistence"].axes[0].get_ylim() == (0, 1.05)
    detail = {ax.get_ylabel(): ax for ax in made["2parity_persistence"].axes}
    assert detail["attention mass on the structure"].get_ylim()[1] == pytest.approx(1.05)
    assert detail["corr(attention, structure)\n/ step 0"].get_ylim() == pytest.approx((0, 1.05))  # flat looks flat
    assert detail["‖∂L/∂Wq‖ (Frobenius)"].get_yscale() == "log"
    half_life = detail["half-life (optimizer steps)"]
    assert all(line.get_linestyle() == "None" for line in half_life.lines)  # one value per run: markers, no line
    assert len(half_life.patches) == 1  # a bar only where a run reached it (qk_opt)


def test_figures_are_written_as_png_and_pdf(result_dir):
    render(result_dir)
    names = {"2parity_curves", "persistence", "2parity_persistence", "2parity_attention_maps"}
    for name in names:
        for suffix in (".png", ".pdf"):
            assert (result_dir / "figures" / f"{name}{suffix}").stat().st_size > 1000
    md = (result_dir / "table.md").read_text()
    assert "![persistence](figures/persistence.png)" in md


def test_fraction_sweep_is_drawn_against_the_training_fraction(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    config = str(CONFIGS / "arithmetic/addition.yaml")
    tasks = [{"name": "addition_1pct", "config": config, "args": ["--data.init_args.train_fraction", "0.01"]},
             {"name": "addition_10pct", "config": config, "args": ["--data.init_args.train_fraction=0.1"]}]
    path = write_result_dir(tmp_path / "sweep", curves=False, tasks=tasks,
                            metrics=[{"tag": "test/acc", "label": "acc %", "scale": 100}])
    assert [t.train_fraction for t in load(path).tasks] == [0.01, 0.1]
    made = figures(load(path))
    assert set(made) == {"fraction_sweep"}  # no curves: only what results.csv allows
    ax = made["fraction_sweep"].axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "training fraction (% of all pairs)"
    assert ax.get_ylabel() == "acc %"


def test_each_task_without_its_fraction_is_a_sweep_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    multiplication, addition = (str(CONFIGS / f"arithmetic/{name}.yaml") for name in ("multiplication", "addition"))
    fraction = "--data.init_args.train_fraction"
    tasks = [{"name": "multiplication_1pct", "config": multiplication, "args": [fraction, "0.01"]},
             {"name": "multiplication", "config": multiplication},  # 3%: its config file's fraction
             {"name": "multiplication_wd", "config": multiplication, "args": ["--model.weight_decay", "0.1"]},
             {"name": "addition", "config": addition},  # 0.4%
             {"name": "addition_10pct", "config": addition, "args": [f"{fraction}=0.1"]}]
    metric = {"tag": "test/acc", "label": "seq acc %", "scale": 100, "paper": "seq_acc"}
    path = write_result_dir(tmp_path / "sweeps", curves=False, tasks=tasks, metrics=[metric], paper_tables=["2"])
    result = load(path)
    loaded = result.tasks
    assert [t.train_fraction for t in loaded] == [0.01, 0.03, 0.03, 0.004, 0.1]
    assert loaded[0].series == loaded[1].series != loaded[2].series  # the weight decay is another task
    axes = figures(result)["fraction_sweep"].axes
    assert [ax.get_title() for ax in axes] == ["multiplication", "addition"]  # a row per sweep
    mean_lines = [[line for line in ax.get_lines() if line.get_linestyle() == "-"] for ax in axes]
    assert [list(line.get_xdata()) for line in mean_lines[0]] == [[1.0, 3.0]] * len(INITS)  # not the wd task
    assert [list(line.get_xdata()) for line in mean_lines[1]] == [[0.4, 10.0]] * len(INITS)
    stars = [line for line in axes[0].get_lines() if line.get_marker() == "*"]
    assert {tuple(line.get_xdata()) for line in stars} == {(3.0,)}  # the paper's value at the fraction it has
    assert sorted(line.get_ydata()[0] for line in stars) == [5.01, 27.82, 69.49]


def test_missing_curves_give_tables_and_a_note(result_dir, capsys):
    (result_dir / ResultDir.CURVES).unlink()
    (result_dir / ResultDir.MAPS).unlink()
    main(["report", str(result_dir)])
    assert "tables only" in capsys.readouterr().out
    md = (result_dir / "table.md").read_text()
    assert "No curves.csv.gz here" in md and "## Figures" not in md
    assert not (result_dir / "figures").exists()


def test_runs_without_curves_are_named(result_dir):
    """A run kept from a result directory without its curves is in the tables but not in the curve figures: the
    table's notes name it, so a published figure with a missing line says why."""
    path = result_dir / ResultDir.CURVES
    with gzip.open(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    with gzip.open(path, "wt", newline="") as f:
        csv.writer(f).writerows(row for row in rows if row[:3] != ["2parity", "mask", "1"])
    md = render(result_dir, figures=False).read_text()
    assert "- 1 finished run(s) have no curves in curves.csv.gz" in md and "leave them out: 2parity/mask/seed1." in md
    with gzip.open(path, "wt", newline="") as f:
        csv.writer(f).writerows(rows)
    assert "no curves in curves.csv.gz" not in render(result_dir, figures=False).read_text()


# ------------------------------------------------------------------------------------- command, README
def test_report_command_regenerates_and_checks(result_dir, tmp_path, capsys):
    main(["report", str(result_dir)])
    md = (result_dir / "table.md").read_text()
    main(["report", "--check", str(result_dir)])  # up to date: no exit
    (result_dir / "table.md").write_text(md.replace("0.0020", "0.0010"))  # a hand edit
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--check", str(result_dir)])
    assert exit_info.value.code == 1 and "table.md" in capsys.readouterr().err
    main(["report", str(result_dir)])
    assert (result_dir / "table.md").read_text() == md
    # Publishing into another directory copies the data files: that copy regenerates on its own.
    main(["report", str(result_dir), "--out_dir", str(tmp_path / "published")])
    published = tmp_path / "published"
    assert (published / ResultDir.CURVES).is_file() and (published / "figures/persistence.pdf").is_file()
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path)])  # not a result directory: named
    assert f"{tmp_path} is not a study's result directory" in capsys.readouterr().err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    for option in ("RESULT_DIR", "--readme", "--out_dir", "--no_figures", "--check", "--scorecard"):
        assert option in out
    assert "<!-- results: NAME -->" in out


def test_readme_sections_are_replaced_idempotently(result_dir, tmp_path):
    readme = tmp_path / "README.md"
    before = "# Project\n\nIntro.\n\n"
    after = "\nOutro, hand-written.\n\n<!-- results: other -->\nleft alone\n<!-- /results -->\n"
    readme.write_text(before + "<!-- results: fake -->\nold hand-edited table\n<!-- /results -->\n" + after)
    render(result_dir)
    assert update_readme(readme, [result_dir]) == (["fake"], ["fake"])
    text = readme.read_text()
    assert text.startswith(before) and text.endswith(after) and "old hand-edited" not in text
    assert "### " in text and "| 2parity | 1.4000 ± 0.1414 | 1.8000 ± 0.1414 | **0.0020 ± 0.0014** |" in text
    assert "](fake/figures/persistence.png)" in text  # links relative to the README
    assert update_readme(readme, [result_dir]) == (["fake"], [])
    assert readme.read_text() == text


def test_readme_results_are_what_report_generates():
    """The README's result sections and docs/results/*/table.md are generated: none was edited by hand.
    After a new study run: `maskprior report --readme README.md docs/results/*`."""
    dirs = sorted(str(p) for p in (ROOT / "docs/results").iterdir() if (p / "study.json").is_file())
    assert dirs, "docs/results has no result directory with study.json"
    main(["report", "--check", "--readme", str(ROOT / "README.md"), *dirs])  # exit 1 names what is out of date
    replaced, _ = update_readme(ROOT / "README.md", [Path(d) for d in dirs], write=False)
    assert replaced, "the README has no generated results section"


# -------------------------------------------------------------------------------- a real tiny study
def test_tiny_study_writes_the_data_files_report_needs(tmp_path, monkeypatch, capsys):
    """Real runs: the study's data files alone (no run directory) regenerate its tables, as --table_only does."""
    monkeypatch.chdir(ROOT)
    persistence = [{"class_path": "lightning_maskprior.callbacks.PriorPersistence",
                    "init_args": {"every_n_steps": 1, "probe_size": 16}}]
    args = [*TINY_BOOLEAN, "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1",
            "--trainer.enable_model_summary", "false", "--trainer.callbacks", json.dumps(persistence),
            "--data.init_args.batch_size", "16"]
    config = study_dict(tmp_path / "out", inits=["default", "mask"], seeds=[0], args=args, test=False,
                        metrics=[{"tag": "val/mse", "label": "MSE"}], curves=["val/acc"])
    assert run_study(load_study(config), log=lambda *a, **k: None) == 0
    out = tmp_path / "out"
    result = load(out)
    assert {r.precision for r in result.runs} <= {"32-true", "bf16-mixed"} and all(r.precision for r in result.runs)
    assert all("persistence/score" in r.values for r in result.runs)
    tags = {key[3] for key in result.curves}
    assert {"val/acc", "val/mdi_acc", "persistence/open_mass", "persistence/score"} <= tags
    assert not any(t.startswith("persistence_heads/") or t.count("/") > 1 for t in tags)
    val = result.curves[("2parity", "mask", 0, "val/acc")]
    assert [epoch for _, epoch, _ in val] == [1.0, 2.0]  # epochs elapsed at each validation
    maps = result.maps[("2parity", "mask")]
    assert maps["start"].shape == maps["end"].shape == maps["structure"].shape and int(maps["start_step"]) == 0
    assert set(figures(result)) >= {"2parity_curves", "persistence", "2parity_persistence", "2parity_attention_maps"}
    # A published copy of the data files, without run directories, gives the same tables.
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("study.json", "results.csv", ResultDir.CURVES, ResultDir.MAPS):
        shutil.copyfile(out / name, copy / name)
    render(copy)
    for name in ("per_seed.csv", "table.csv"):
        assert (copy / name).read_text() == (out / name).read_text()
    # The same table.md (its last note names the directory it came from).
    assert (copy / "table.md").read_text().replace("from copy/", "from out/") == (out / "table.md").read_text()
    assert sorted(p.name for p in (copy / "figures").iterdir()) == sorted(p.name for p in (out / "figures").iterdir())
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["study", "-c", str(path), "--table_only", "true"])
    assert (out / "figures" / "persistence.pdf").is_file()
    # The data files alone carry the study on: in a fresh out_dir (no run directory), with results_from the copy,
    # a finished run whose fingerprint is the same is kept with its row, curves and maps; one whose command
    # changed runs again.
    moved = tmp_path / "moved"
    config = study_dict(moved, inits=["default", {"name": "mask", "args": ["--model.prior_weight_decay", "null"]}],
                        seeds=[0], args=args, test=False, metrics=[{"tag": "val/mse", "label": "MSE"}],
                        curves=["val/acc"], results_from=str(copy))
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    main(["study", "-c", str(path), "--dry_run", "true"])  # says beforehand what results_from keeps
    printed = capsys.readouterr().out
    assert "[kept from results_from] 2parity/default/seed0" in printed and "[to run] 2parity/mask/seed0" in printed
    lines = []
    assert run_study(load_study(config, path), log=lambda *a, **k: lines.append(" ".join(map(str, a)))) == 0
    assert f"1 of them kept from {copy}), 1 to run" in lines[1]
    assert not (moved / "2parity" / "default").exists() and (moved / "2parity" / "mask" / "seed0").is_dir()
    again = load(moved)
    assert again.runs_of("2parity", "default") == result.runs_of("2parity", "default")  # fingerprint included
    assert again.curves[("2parity", "default", 0, "val/acc")] == result.curves[("2parity", "default", 0, "val/acc")]
    assert np.array_equal(again.maps[("2parity", "default")]["end"], result.maps[("2parity", "default")]["end"])
    assert again.runs_of("2parity", "mask")[0].fingerprint != result.runs_of("2parity", "mask")[0].fingerprint
    # Studies run in parts join into one: from two result directories, each run's row comes from the first that
    # finished it with the run's fingerprint (the copy's mask row is of the old command: the moved one's is taken).
    joined = tmp_path / "joined"
    config = {**config, "out_dir": str(joined), "results_from": [str(copy), str(moved)]}
    lines.clear()
    assert run_study(load_study(config, path), log=lambda *a, **k: lines.append(" ".join(map(str, a)))) == 0
    assert f"2 of them kept from {copy}, {moved}), 0 to run" in lines[1]
    both = load(joined)
    assert both.runs_of("2parity", "default") == result.runs_of("2parity", "default")
    assert both.runs_of("2parity", "mask") == again.runs_of("2parity", "mask")
    assert both.curves[("2parity", "mask", 0, "val/acc")] == again.curves[("2parity", "mask", 0, "val/acc")]
    assert np.array_equal(both.maps[("2parity", "mask")]["end"], again.maps[("2parity", "mask")]["end"])
    assert not (joined / "2parity").exists()
    # A directory joined from tables alone (no curves.csv.gz, no maps), listed first, gives the rows; each run's
    # curves and maps come from the next directory that has them.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("study.json", "results.csv"):
        shutil.copyfile(moved / name, bare / name)
    config = {**config, "out_dir": str(tmp_path / "rejoined"), "results_from": [str(bare), str(moved)]}
    assert run_study(load_study(config, path), log=lambda *a, **k: None) == 0
    rejoined = load(tmp_path / "rejoined")
    assert rejoined.runs_of("2parity", "mask") == again.runs_of("2parity", "mask")
    assert rejoined.curves[("2parity", "mask", 0, "val/acc")] == again.curves[("2parity", "mask", 0, "val/acc")]
    assert np.array_equal(rejoined.maps[("2parity", "mask")]["end"], again.maps[("2parity", "mask")]["end"])
    with pytest.raises(StudyError, match="results_from: '.*nowhere' is not a study's result directory"):
        load_study({**config, "results_from": str(tmp_path / "nowhere")})
    with pytest.raises(StudyError, match="results_from: '.*nowhere' is not a study's result directory"):
        load_study({**config, "results_from": [str(copy), str(tmp_path / "nowhere")]})
    with pytest.raises(StudyError, match=r"results_from: expected list\[pathlib.Path\], pathlib.Path or null, got .3."):
        load_study({**config, "results_from": 3})


def test_a_labelled_variant_gets_its_name_and_every_column_says_what_it_ran(tmp_path):
    strong = str(CONFIGS / "init/qk_opt_strong.yaml")
    inits = ["default", {"name": "qk_opt", "label": "qk_opt_strong", "config": strong},
             {"name": "mask", "label": "mask_decayed", "args": ["--model.prior_weight_decay", "null"]}]
    study = load_study(study_dict(tmp_path / "out", inits=inits))
    info = study_info(study)
    assert [i["variant"] for i in info["inits"]] == ["", "qk_opt_strong.yaml", "--model.prior_weight_decay null"]
    path = tmp_path / "result"
    path.mkdir()
    (path / "study.json").write_text(json.dumps(info))
    with open(path / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "init", "seed", "status", "seconds", "precision", "test/acc", "test/mse", "error"])
        for label in ("default", "qk_opt_strong", "mask_decayed"):
            for seed in SEEDS:
                writer.writerow(["2parity", label, seed, "ok", 60.0, "bf16-mixed", 0.75, 1.4, ""])
    text = render(path, figures=False).read_text()
    assert "| task | Default | QK-Opt (positions x50, lr 1e-2, 500 steps) | Mask (M under weight decay) |" in text
    assert ("- Columns: each init method with its task's defaults (the paper's settings where the paper states "
            "them), plus what the study adds: Default: `default`; QK-Opt (positions x50, lr 1e-2, 500 steps): "
            "`qk_opt` + `qk_opt_strong.yaml`; Mask (M under weight decay): `mask` + "
            "`--model.prior_weight_decay null`.") in text
    # A study.json written before variants were recorded says nothing it cannot know.
    for entry in info["inits"]:
        del entry["variant"]
    (path / "study.json").write_text(json.dumps(info))
    assert "- Columns:" not in render(path, figures=False).read_text()


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.joinpath("results.csv").write_text(p.joinpath("results.csv").read_text()[:-40]),
     r"results.csv, line \d+ has \d+ of the header's \d+ fields: cut short or corrupt"),
    (lambda p: p.joinpath("results.csv").write_text("\n".join(p.joinpath("results.csv").read_text().splitlines()[:3])
                                                    + "\n"),
     r"results.csv has no row for \d+ of the study's 6 runs"),
    (lambda p: p.joinpath("study.json").write_text('{"title": "x", "seeds": [0'),
     r"study.json is not valid JSON .*cut short or corrupt"),
    (lambda p: p.joinpath(ResultDir.CURVES).write_bytes(p.joinpath(ResultDir.CURVES).read_bytes()[:30]),
     r"curves.csv.gz: cannot read the curves"),
])
def test_report_refuses_a_cut_or_corrupt_data_file_naming_it(tmp_path, capsys, damage, message):
    path = write_result_dir(tmp_path / "result")
    damage(path)
    with pytest.raises(SystemExit) as info:
        main(["report", str(path), "--no_figures"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("extra, message", [
    ("2parity,mask,0,ok,60.0,bf16-mixed,,1.0,1.0,0.5,\n",
     r"results.csv, line 8: a second row for run 2parity/mask/0 \(the first is line 6\): expected one row per run"),
    ("2parity,mask,7,ok,60.0,bf16-mixed,,1.0,1.0,0.5,\n",
     r"results.csv, line 8: run 2parity/mask/7 is not one of the study's runs \(.*seeds \[0, 1\]\)"),
])
def test_report_refuses_a_repeated_row_or_a_run_outside_the_study(tmp_path, extra, message):
    """A mean over seeds counts each run once: a second row of a run, or a row of a seed (task, init) the study
    does not have, is refused naming its line, through the console script, and nothing is written."""
    import os
    import subprocess
    import sys

    path = write_result_dir(tmp_path / "result", curves=False)
    with open(path / "results.csv", "a") as f:
        f.write(extra)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "report", str(path), "--no_figures"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_report_into_a_path_the_machine_refuses_is_one_line(tmp_path):
    """An --out_dir under a file (or on a read-only or full disk): the path, errno and what it needs, exit 2."""
    import os
    import subprocess
    import sys

    path = write_result_dir(tmp_path / "result", curves=False)
    (tmp_path / "a_file").write_text("not a directory\n")
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "report", str(path), "--no_figures",
                           "--out_dir", str(tmp_path / "a_file" / "out")], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert re.search(r"a_file/out: Not a directory \(ENOTDIR\); expected a directory", proc.stderr), proc.stderr


# ------------------------------------------------------------------- a table never poorer than its data
def with_fingerprints(path: Path, study_file: Path) -> Path:
    """The result directory at ``path`` with each row's fingerprint: the row of the run the study file runs there."""
    study = load_study(yaml.safe_load(study_file.read_text()), study_file)
    prints = {(run.task.name, run.init.label, str(run.seed)): run.fingerprint() for run in study.runs()}
    with open(path / "results.csv", newline="") as f:
        rows = list(csv.reader(f))
    rows = [rows[0] + ["fingerprint"]] + [row + [prints[tuple(row[:3])]] for row in rows[1:]]
    with open(path / "results.csv", "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def finished_study_without_run_directories(tmp_path: Path) -> tuple[Path, Path]:
    """A study's out_dir holding its data files (every run finished, with curves) and no run directory (removed)."""
    out = tmp_path / "out"
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(study_dict(out)))
    return with_fingerprints(write_result_dir(out), study_file), study_file


@pytest.mark.parametrize("results_from", [False, True])
def test_table_only_keeps_the_finished_rows_whose_run_directories_were_removed(tmp_path, monkeypatch, results_from):
    """--table_only rebuilds from the runs and keeps every finished row it cannot recompute, with its curves: from
    the out_dir's own data files, also beside a results_from directory that holds the rows without their curves."""
    monkeypatch.chdir(ROOT)
    out, study_file = finished_study_without_run_directories(tmp_path)
    before = load(out)
    args = ["study", "-c", str(study_file), "--table_only", "true"]
    if results_from:
        bare = tmp_path / "bare"
        bare.mkdir()
        for name in ("study.json", "results.csv"):
            shutil.copyfile(out / name, bare / name)
        args += ["--results_from", str(bare)]
    main(args)
    after = load(out)
    assert sorted((r.task, r.init, r.seed, r.status, r.seconds, r.values) for r in after.runs) == \
        sorted((r.task, r.init, r.seed, r.status, r.seconds, r.values) for r in before.runs)
    assert after.curves.keys() == before.curves.keys() and after.curves[("2parity", "mask", 0, "val/acc")]
    for key, points in before.curves.items():
        assert [x for point in after.curves[key] for x in point] == pytest.approx([x for p in points for x in p])
    assert "pending" not in (out / "table.md").read_text()


def test_report_check_says_which_rows_rest_on_the_data_files_alone(result_dir, capsys):
    render(result_dir, figures=False)
    main(["report", "--check", str(result_dir)])
    assert f"{result_dir}: all 6 finished rows rest on the data files alone" in capsys.readouterr().out
    run_dir = result_dir / "2parity" / "mask" / "seed1"
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text("{}")
    main(["report", "--check", str(result_dir)])
    printed = capsys.readouterr().out
    assert f"{result_dir}: 5 of 6 finished rows rest on the data files alone" in printed
    assert "2parity/mask/seed0" in printed and "2parity/mask/seed1" not in printed


def test_report_check_names_a_missing_figure_as_missing(result_dir, capsys):
    main(["report", str(result_dir)])
    capsys.readouterr()
    (result_dir / "figures" / "2parity_curves.png").unlink()
    with pytest.raises(SystemExit) as info:
        main(["report", "--check", str(result_dir)])
    err = capsys.readouterr().err
    assert info.value.code == 1
    assert f"missing figures (`maskprior report RESULT_DIR` draws them):\n  {result_dir}/figures/2parity_curves.png" \
        in err
    assert "out of date" not in err and "table.md" not in err


@pytest.mark.parametrize("table_only", [False, True])
@pytest.mark.parametrize("damage, message", [
    ("2parity,mask,0,ok,60.0,bf16-mixed,,1.0,1.0,0.5,,x\n", r"line 8: a second row for run 2parity/mask/0"),
    (None, r"line \d+ has \d+ of the header's \d+ fields: cut short or corrupt"),
])
def test_study_with_a_repeated_or_cut_row_in_results_from_is_one_line(tmp_path, monkeypatch, capsys, table_only,
                                                                     damage, message):
    monkeypatch.chdir(ROOT)
    source, _ = finished_study_without_run_directories(tmp_path)
    text = (source / "results.csv").read_text()
    cut = "\n".join([*text.splitlines()[:-1], ",".join(text.splitlines()[-1].split(",")[:5])]) + "\n"
    (source / "results.csv").write_text(text + damage if damage else cut)
    study_file = tmp_path / "again.yaml"
    study_file.write_text(yaml.safe_dump(study_dict(tmp_path / "again", results_from=str(source))))
    with pytest.raises(SystemExit) as info:
        main(["study", "-c", str(study_file), "--table_only", str(table_only).lower()])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"results_from: .*results.csv, {message}", err), err
    assert not (tmp_path / "again" / "2parity").exists()


def test_a_study_grown_by_an_init_keeps_the_rows_its_files_hold(tmp_path, monkeypatch):
    """The out_dir's files are read before study.json is rewritten: a study that now asks for one more init keeps
    the finished rows of the others (their run directories removed) and lists the new init's runs as pending."""
    monkeypatch.chdir(ROOT)
    out, study_file = finished_study_without_run_directories(tmp_path)
    study_file.write_text(yaml.safe_dump(study_dict(out, inits=[*INITS, "zero"])))
    main(["study", "-c", str(study_file), "--table_only", "true"])
    statuses = {(r.init, r.seed): r.status for r in load(out).runs}
    assert statuses == {**{(init, seed): "ok" for init in INITS for seed in SEEDS},
                        ("zero", 0): "pending", ("zero", 1): "pending"}

"""``maskprior study``: validation before any run, tables (mean / std / paper), resume, failures, figures."""

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, ROOT, TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.run.rundir import StudyRunDir
from lightning_maskprior.study import (
    LOCK_NAME,
    OWNER_NAME,
    Interrupted,
    StudyError,
    build_parser,
    check_commands,
    load_study,
    paper_results,
    run_study,
    study_lock,
    study_options,
    write_outputs,
)
from lightning_maskprior.study import cell as cell_module
from lightning_maskprior.study.cell import prepare_run
from lightning_maskprior.study.launchers import cell_command
from lightning_maskprior.study.launchers import local as local_launcher

TINY = [
    *TINY_BOOLEAN,
    "--trainer.max_epochs", "1", "--trainer.check_val_every_n_epoch", "1",
    "--trainer.enable_model_summary", "false", "--trainer.callbacks", "null",
]
ONE_TASK = [{"name": "2parity", "config": "configs/boolean/2parity.yaml"}]
METRICS = [{"tag": "val/mse", "label": "MSE", "paper": "mse"},
           {"tag": "val/acc", "label": "acc %", "scale": 100, "digits": 2, "paper": "acc"}]


def tiny_study(out_dir: Path, **changes) -> dict:
    study = {
        "tasks": [{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")},
                  {"name": "majority3", "config": str(CONFIGS / "boolean/majority3.yaml")}],
        "inits": ["default", "mask"],
        "seeds": [0, 1],
        "args": TINY,
        "metrics": METRICS,
        "paper_tables": ["1"],
        "test": False,
        "launcher": "inprocess",
        "out_dir": str(out_dir),
    }
    study.update(changes)
    return study


def read_csv_table(path: Path) -> dict[str, dict[str, str]]:
    import csv

    with open(path) as f:
        return {row["task"]: row for row in csv.DictReader(f)}


# ------------------------------------------------------------------------------ validation
def parse_file(path: Path):
    parser = build_parser()
    return parser.parse_args(["-c", str(path)])


STUDIES = sorted((CONFIGS / "study").rglob("*.yaml"))  # the paper's tables and, under ablations/, the ablations


def test_there_are_studies():
    names = {p.stem for p in STUDIES}
    assert {"boolean_cpu", "boolean_quick", "boolean_paper", "arithmetic_cpu", "arithmetic_paper"} <= names
    assert {"cyclic3_small_cos", "digits_causes", "pydoc_long"} <= names


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: str(p.relative_to(CONFIGS / "study").with_suffix("")))
def test_shipped_studies_validate(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    study = load_study(study_options(parse_file(path)), path)  # every task config resolves (clone or package)
    assert study.runs() and study.out_dir.parent == ROOT / "runs" / "study"
    if path.parent.name == "study":
        assert study.out_dir.name == path.stem
    for task in study.tasks:
        for metric in task.metrics:
            if metric.paper is not None:  # every paper key the study names exists in the paper's tables
                assert any(metric.paper in paper_results.TABLES[t]["metrics"] for t in study.paper_tables)
    if path.stem == "boolean_cpu":
        assert len(study.runs()) == 96  # 4 tasks x 8 columns (the five methods, 2 stronger QK, M decayed) x 3 seeds


@pytest.mark.parametrize(
    "change,message",
    [
        ({"inits": ["default", "svd"]}, r"inits\[1\] \(svd\): unknown init method 'svd'"),
        ({"tasks": [{"name": "a", "config": "configs/boolean/2parity.yaml"},
                    {"name": "b", "config": "configs/boolean/nope.yaml"}]},
         r"tasks\[1\] \(b\): config 'configs/boolean/nope.yaml' does not exist"),
        ({"seeds": [0, -1]}, r"seeds\[1\]: a seed is a non-negative integer, got -1"),
        ({"seeds": [1, 1]}, r"seeds: \[1, 1\] repeats a seed"),
        ({"seeds": []}, "seeds: give at least one seed"),
        ({"inits": ["mask", {"name": "mask"}]}, r"inits \(labels\): \['mask'\] appear more than once"),
        ({"tasks": [{"name": "a", "config": "configs/boolean/2parity.yaml", "metric": ["val/acc"]}]},
         r"tasks\[0\] \(a\): unknown keys \['metric'\]"),
        ({"metrics": ["acc"]}, r"metrics\[0\]: a metric is a logged tag like 'test/acc'"),
        ({"paper_tables": ["5"]}, r"paper_tables\[0\]: the paper has no table '5'"),
        ({"parallel": 0}, "parallel: must be a positive integer"),
    ],
)
def test_bad_study_fails_naming_the_entry(tmp_path, monkeypatch, change, message):
    monkeypatch.chdir(ROOT)
    with pytest.raises(StudyError, match=message):
        load_study(tiny_study(tmp_path / "out", **change))


def test_bad_study_file_fails_before_any_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    study = tiny_study(tmp_path / "out", inits=["default", "mask", "svd"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(study))
    with pytest.raises(SystemExit) as exit_info:
        main(["study", "-c", str(path)])
    assert exit_info.value.code == 2
    assert "inits[2] (svd): unknown init method 'svd'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


# A process holding the study lock as a study on another host would (filelock on the shared directory, and
# the owner file naming that host and process); it prints "locked" once it holds the lock.
HOLD_LOCK = """
import json, sys, time
from filelock import FileLock
out, name = sys.argv[1:]
lock = FileLock(out + "/" + name, timeout=0)
lock.acquire()
json.dump({"host": "node-7", "pid": 4242, "started": "2024-01-02 03:04:05"}, open(out + "/.study.lock.json", "w"))
print("locked", flush=True)
time.sleep(120)
"""


def hold_lock(out: Path, name: str = LOCK_NAME) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out), name], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_second_study_in_the_same_directory_fails_naming_the_first(tmp_path, monkeypatch, capsys):
    """Two studies in one out_dir would take each other's unfinished runs: the second must refuse, naming the first."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    out.mkdir()
    holder = hold_lock(out)
    try:
        message = r"another study \(host node-7, process 4242, started at 2024-01-02 03:04:05\) is running in"
        with pytest.raises(StudyError, match=message):
            run_study(load_study(tiny_study(out)))
        path = tmp_path / "study.yaml"
        path.write_text(yaml.safe_dump(tiny_study(out)))
        with pytest.raises(SystemExit) as exit_info:
            main(["study", "-c", str(path)])
        assert exit_info.value.code == 2
        assert "host node-7, process 4242" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, OWNER_NAME]  # nothing ran
        assert json.loads((out / OWNER_NAME).read_text())["pid"] == 4242  # the other study's owner file is kept
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_killed_study_is_free(tmp_path):
    """The OS releases the lock when its holder dies (even by SIGKILL): no stale lock to clean up."""
    out = tmp_path / "out"
    out.mkdir()
    holder = hold_lock(out)
    holder.kill()
    holder.wait()
    with study_lock(out):
        owner = json.loads((out / OWNER_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        with pytest.raises(StudyError, match=f"process {os.getpid()}"):  # held: a second taker fails
            with study_lock(out):
                pass
    assert not (out / OWNER_NAME).exists()
    with study_lock(out):  # released: free again
        pass


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["study", "--help"])
    out = capsys.readouterr().out
    for option in ("--tasks", "--inits", "--seeds", "--seed_args", "--metrics", "--curves", "--paper_tables",
                   "--args", "--test", "--out_dir", "--parallel", "--threads_per_run", "--retry_failed",
                   "--launcher", "--launcher_options", "--gpus_per_run", "--dry_run", "--table_only"):
        assert option in out


# ---------------------------------------------------------------------- tables from known results
def fake_results(study, values: dict, persistence: bool = False) -> None:
    """Write result.json (and TensorBoard curves) as finished runs would, with chosen metric values."""
    from torch.utils.tensorboard import SummaryWriter

    for run in study.runs():
        run.dir.mkdir(parents=True)
        metrics = values[(run.task.name, run.init.label, run.seed)]
        run.result_path.write_text(json.dumps({"status": "ok", "key": run.key(), "seconds": 1.0,
                                               "metrics": metrics}))
        writer = SummaryWriter(str(run.dir / "lightning_logs" / "version_0"))
        for step in range(3):
            writer.add_scalar("val/acc", metrics["val/acc"] * (step + 1) / 3, step)
            if persistence:
                writer.add_scalar("persistence/open_mass/layer0", 0.9 - 0.1 * step, step)
                writer.add_scalar("persistence/open_mass", 0.8 - 0.1 * step, step)
        writer.close()


def test_table_has_mean_std_and_paper_numbers(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    study = load_study(tiny_study(tmp_path / "out", seeds=[0, 1, 2]))
    acc = {"default": [0.75, 0.75, 0.76], "mask": [1.0, 0.99, 1.0]}
    values = {(t.name, i.label, s): {"val/mse": 0.1 * (s + 1) + (1 if i.label == "default" else 0),
                                     "val/acc": acc[i.label][s]}
              for t in study.tasks for i in study.inits for s in study.seeds}
    fake_results(study, values, persistence=True)
    assert write_outputs(study) == 0

    table = read_csv_table(study.out_dir / "table.csv")
    row = table["2parity"]
    assert float(row["mask:acc %:mean"]) == pytest.approx(statistics.mean([100, 99, 100]))
    assert float(row["mask:acc %:std"]) == pytest.approx(statistics.stdev([100, 99, 100]))
    assert float(row["default:MSE:mean"]) == pytest.approx(1.2)
    assert float(row["default:MSE:std"]) == pytest.approx(0.1)
    assert row["mask:MSE:n"] == "3"
    assert float(row["mask:MSE:paper"]) == 0.0029 and float(row["default:acc %:paper"]) == 75.0

    md = (study.out_dir / "table.md").read_text()
    assert "| task | Default | Mask |" in md  # one table per metric, the paper's row beneath ours, best in bold
    assert "| 2parity | 1.2000 ± 0.1000 | **0.2000 ± 0.1000** |\n| *paper* | *1.3790* | *0.0029* |" in md
    assert "| 2parity | 75.33 ± 0.58 | **99.67 ± 0.58** |\n| *paper* | *75.00* | *100.00* |" in md
    figures = sorted(p.name for p in (study.out_dir / "figures").glob("*.png"))
    assert figures == ["2parity_curves.png", "2parity_persistence.png", "majority3_curves.png",
                       "majority3_persistence.png", "persistence.png"]


def test_one_seed_has_no_std(tmp_path, monkeypatch):
    """A single value has no sample std: the table shows the value alone, the CSV leaves std empty."""
    monkeypatch.chdir(ROOT)
    study = load_study(tiny_study(tmp_path / "out", seeds=[0]))
    values = {(t.name, i.label, 0): {"val/mse": 0.5, "val/acc": 0.75} for t in study.tasks for i in study.inits}
    fake_results(study, values)
    assert write_outputs(study, plots=False) == 0
    md = (study.out_dir / "table.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| 2parity |")]
    assert rows[0] == "| 2parity | 0.5000 | 0.5000 |" and not any("±" in row for row in rows)
    row = read_csv_table(study.out_dir / "table.csv")["2parity"]
    assert row["default:MSE:std"] == "" and row["default:MSE:n"] == "1"


def test_a_task_runs_only_its_inits_and_its_table_leaves_the_others_blank(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    tasks = [{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")},
             {"name": "majority3", "config": str(CONFIGS / "boolean/majority3.yaml"), "inits": ["mask"]}]
    study = load_study(tiny_study(tmp_path / "out", tasks=tasks, seeds=[0]))
    assert [run.name for run in study.runs()] == ["2parity/default/seed0", "2parity/mask/seed0",
                                                  "majority3/mask/seed0"]
    fake_results(study, {(r.task.name, r.init.label, 0): {"val/mse": 0.5, "val/acc": 0.75} for r in study.runs()})
    assert write_outputs(study, plots=False) == 0
    md = (study.out_dir / "table.md").read_text()
    assert "| majority3 |  | 0.5000 |" in md and "Blank: the study does not run that init on that task" in md
    assert check_commands(study) == 3  # --dry_run parses the commands of the runs there are
    with pytest.raises(StudyError, match=r"tasks\[1\] \(majority3\).inits: \['qk_opt'\] is not"):
        load_study(tiny_study(tmp_path / "out", tasks=[tasks[0], {**tasks[1], "inits": ["qk_opt"]}]))


# ------------------------------------------------------------------ real tiny runs (in-process)
def test_tiny_study_runs_resumes_and_tabulates(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    study = load_study(tiny_study(tmp_path / "out"))
    lines = []

    def stop_after_five(line, **kwargs):  # Ctrl-C after the fifth run has finished
        lines.append(line)
        if line.startswith("[5/8]"):
            raise KeyboardInterrupt

    with pytest.raises(Interrupted):
        run_study(study, log=stop_after_five)
    finished = [r for r in study.runs() if r.result_path.is_file()]
    assert len(finished) == 5
    first_results = {r.name: r.result_path.read_text() for r in finished}
    # Seed by seed: every cell of seed 0 first, then seed 1.
    assert sorted(r.name for r in finished) == sorted(
        [f"{t}/{i}/seed0" for t in ("2parity", "majority3") for i in ("default", "mask")] + ["2parity/default/seed1"])
    half_table = read_csv_table(study.out_dir / "table.csv")  # written after every run
    assert half_table["majority3"]["mask:MSE:n"] == "1"  # seed 1 not run yet
    # A run killed before its first checkpoint leaves a directory without result.json: it is redone from scratch.
    unfinished = study.runs()[5]
    assert unfinished.run_path.is_file() and not unfinished.result_path.exists()  # prepared, never ran
    (unfinished.dir / "stale.txt").write_text("from a killed run")

    lines.clear()
    assert run_study(load_study(tiny_study(tmp_path / "out")), log=lambda line, **kw: lines.append(line)) == 0
    assert "  5 finished earlier (skipped), 3 to run" in lines[1]
    assert sum(line.startswith("[") for line in lines) == 3
    assert {r.name: r.result_path.read_text() for r in finished} == first_results  # not rerun
    assert not (unfinished.dir / "stale.txt").exists()

    results = {r.name: json.loads(r.result_path.read_text()) for r in study.runs()}
    assert all(r["status"] == "ok" for r in results.values())
    table = read_csv_table(study.out_dir / "table.csv")
    for task in ("2parity", "majority3"):
        for init in ("default", "mask"):
            mse = [results[f"{task}/{init}/seed{s}"]["metrics"]["val/mse"] for s in (0, 1)]
            assert float(table[task][f"{init}:MSE:mean"]) == pytest.approx(statistics.mean(mse))
            assert float(table[task][f"{init}:MSE:std"]) == pytest.approx(statistics.stdev(mse))
    assert (study.out_dir / "figures" / "2parity_curves.png").is_file()
    # A third invocation has nothing to do and writes the same table.
    md = (study.out_dir / "table.md").read_text()
    lines.clear()
    run_study(load_study(tiny_study(tmp_path / "out")), log=lambda line, **kw: lines.append(line))
    assert "  8 finished earlier (skipped), 0 to run" in lines[1]
    assert (study.out_dir / "table.md").read_text() == md
    # A run redone from scratch (its directory lost) gives the same numbers: the table is the same as an
    # uninterrupted study's.
    redo = study.runs()[0]
    shutil.rmtree(redo.dir)
    run_study(load_study(tiny_study(tmp_path / "out")), log=lambda line, **kw: None)
    assert json.loads(redo.result_path.read_text())["metrics"] == results[redo.name]["metrics"]
    assert (study.out_dir / "table.md").read_text() == md


# -------------------------------------------------------- real subprocesses: test stage, a failure
def test_subprocess_runs_fit_and_test_and_record_failures(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    # a run that fails once it trains (a bad option fails the study's check before any run: see the dry run's tests)
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.syspath_prepend(tests)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    study = tiny_study(
        tmp_path / "out", launcher="local", test=True, seeds=[0], inits=["mask"],
        tasks=[{"name": "broken", "config": "configs/boolean/2parity.yaml",
                "args": ["--trainer.callbacks+=resume_helpers.CrashAt", "--trainer.callbacks.step", "0"]},
               {"name": "2parity", "config": "configs/boolean/2parity.yaml"}],
        metrics=[{"tag": "test/mse", "label": "MSE", "paper": "mse"},
                 {"tag": "test/acc", "label": "acc %", "scale": 100, "digits": 2, "paper": "acc"}],
    )
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    with pytest.raises(SystemExit) as exit_info:  # exit code 1: a run failed, the study went on
        main(["study", "-c", str(path)])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "[1/2] broken/mask/seed0: FAILED in fit" in out and "[2/2] 2parity/mask/seed0: ok" in out
    broken = json.loads((tmp_path / "out/broken/mask/seed0/result.json").read_text())
    assert broken["status"] == "failed" and "crash at step 0" in broken["error"]
    ok = json.loads((tmp_path / "out/2parity/mask/seed0/result.json").read_text())
    assert ok["status"] == "ok" and len(ok["commands"]) == 2 and " test -c " in ok["commands"][1]
    assert 0 <= ok["metrics"]["test/acc"] <= 1 and "val/acc" in ok["metrics"]
    md = (tmp_path / "out/table.md").read_text()
    assert "## Failed runs" in md and "- broken/mask/seed0: " in md
    assert "| broken | – |" in md


# --------------------------------------------------------------- dry run, diverged runs in the table
def test_dry_run_parses_every_fit_command(tmp_path, monkeypatch, capsys):
    """A misspelled option in a task's args fails the dry run, naming the task and init (not the real run later)."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_study(tmp_path / "out", seeds=[0, 1])))
    main(["study", "-c", str(path), "--dry_run", "true"])
    out = capsys.readouterr().out
    assert "8 runs, valid (4 distinct fit commands parsed)" in out
    bad = tiny_study(tmp_path / "out", tasks=[{"name": "2parity", "config": "configs/boolean/2parity.yaml",
                                               "args": ["--trainer.max_epocs", "3"]}])
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(SystemExit) as exit_info:
        main(["study", "-c", str(path), "--dry_run", "true"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "task 2parity x init default: the fit command does not parse" in err and "max_epocs" in err
    assert not (tmp_path / "out").exists()


def test_diverged_runs_are_listed_apart_from_the_means(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    study = load_study(tiny_study(tmp_path / "out", tasks=ONE_TASK))
    values = {(t.name, i.label, s): {"val/mse": 0.5, "val/acc": 0.75} for t in study.tasks for i in study.inits
              for s in study.seeds}
    fake_results(study, values)
    diverged = study.runs()[1]  # 2parity/mask/seed0
    result = json.loads(diverged.result_path.read_text())
    result.update(status="diverged", stage="fit", returncode=3, error="non-finite loss nan at step 17")
    diverged.result_path.write_text(json.dumps(result))
    assert write_outputs(study, plots=False) == 0  # a result, not a failure
    md = (study.out_dir / "table.md").read_text()
    assert "| 2parity | 0.5000 ± 0.0000 | 0.5000 (1/2 seeds, 1 diverged) |" in md
    assert "## Diverged runs" in md and "- 2parity/mask/seed0: non-finite loss nan at step 17" in md
    assert "## Failed runs" not in md
    assert diverged.is_done()  # rerunning would diverge again: not retried


# ------------------------------------------------------- the cell: a self-contained command per run
def test_cell_writes_its_own_result_and_the_table_reads_it(tmp_path, monkeypatch, capsys):
    """A run executed anywhere (here: the bare cell command) leaves a result.json that --table_only tabulates."""
    monkeypatch.chdir(ROOT)
    config = tiny_study(tmp_path / "out", seeds=[0], inits=["mask"],
                        tasks=ONE_TASK)
    study = load_study(config)
    run = study.runs()[0]
    assert prepare_run(run, threads=1) == "new"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cell_command(run.dir), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(run.result_path.read_text())
    assert result["status"] == "ok" and result["key"] == run.key() and 0 <= result["metrics"]["val/acc"] <= 1
    assert result["cuda_visible_devices"] == "" and result["host"] == socket.gethostname()
    assert result["started_at"] < result["ended_at"] and result["threads"] == 1
    assert result["commands"][0].startswith("maskprior fit -c ") and "--ckpt_path" not in result["commands"][0]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["study", "-c", str(path), "--table_only", "true"])
    acc = result["metrics"]["val/acc"] * 100
    md = (study.out_dir / "table.md").read_text()
    assert f"| 2parity | {result['metrics']['val/mse']:.4f} |" in md and f"| 2parity | {acc:.2f} |" in md
    assert result["precision"] in ("32-true", "bf16-mixed") and (run.dir / "attention_maps.npz").is_file()


def test_interrupted_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A run stopped mid-fit (same key, last.ckpt, no result) is resumed with --ckpt_path, not deleted;
    a run whose key changed is deleted and redone."""
    monkeypatch.chdir(ROOT)
    config = tiny_study(tmp_path / "out", seeds=[0], inits=["mask"],
                        tasks=ONE_TASK)
    run_study(load_study(config), log=lambda line, **kw: None)
    run = load_study(config).runs()[0]
    ckpts = sorted(run.dir.rglob("*.ckpt"))
    assert ckpts
    last = ckpts[0].parent / "last.ckpt"
    if not last.exists():  # every fit keeps last.ckpt (the CLI's contract); copy one where it does not yet
        shutil.copy(ckpts[0], last)
    run.result_path.unlink()  # as if the fit was killed: its checkpoint and logs stay, no result
    (run.dir / "fit.json").unlink()
    (run.dir / "marker.txt").write_text("kept")
    lines = []
    assert run_study(load_study(config), log=lambda line, **kw: lines.append(line)) == 0
    assert "1 to run (1 resumed from their last checkpoint)" in lines[1]
    result = json.loads(run.result_path.read_text())
    assert result["status"] == "ok" and result["resumed_from"] == str(last)
    assert result["commands"][0].endswith(f"--ckpt_path {last}")
    assert (run.dir / "marker.txt").exists()
    # Another key (here: another command in run.json) is not resumed: the directory is redone.
    run.result_path.unlink()
    spec = json.loads(run.run_path.read_text())
    spec["key"]["fit"].append("--trainer.max_epochs=2")
    run.run_path.write_text(json.dumps(spec))
    assert prepare_run(run) == "redo" and not (run.dir / "marker.txt").exists()


def test_interrupted_runs_go_first(tmp_path, monkeypatch):
    """A restarted study runs its interrupted runs before new ones (they are closest to done), the rest in the
    study's order (seed by seed)."""
    from lightning_maskprior.study import cli as study_cli

    monkeypatch.chdir(ROOT)
    study = load_study(tiny_study(tmp_path / "out"))
    interrupted = {"majority3/mask/seed0", "2parity/default/seed1"}
    monkeypatch.setattr(study_cli, "prepare_run",
                        lambda run, threads=None: "resume" if run.name in interrupted else "new")
    given = []

    class Recorder:
        def describe(self):
            return "recorded"

        def run(self, todo, report):
            given.extend(run.name for run in todo)

        def stop(self):
            pass

    lines = []
    study_cli._run_study(study, Recorder(), log=lambda line, **kw: lines.append(line))
    assert "8 to run (2 resumed from their last checkpoint)" in lines[1]
    assert given == ["majority3/mask/seed0", "2parity/default/seed1",  # the study's order among them too
                     "2parity/default/seed0", "2parity/mask/seed0", "majority3/default/seed0",
                     "2parity/mask/seed1", "majority3/default/seed1", "majority3/mask/seed1"]


def test_the_same_study_from_another_install_location_keeps_its_runs(tmp_path, monkeypatch):
    """Runs are matched by fingerprint (command and parsed config contents, no paths): the same configs at another
    path (a reinstall, a moved checkout) keep a finished run and resume an interrupted one, as does an edited
    comment; a changed value redoes it."""
    monkeypatch.chdir(ROOT)
    first, second = tmp_path / "first", tmp_path / "second"
    for where in (first, second):
        where.mkdir()
        shutil.copy(CONFIGS / "boolean/2parity.yaml", where / "2parity.yaml")
    config = tiny_study(tmp_path / "out", seeds=[0], inits=["mask"],
                        tasks=[{"name": "2parity", "config": str(first / "2parity.yaml")}])
    moved = {**config, "tasks": [{"name": "2parity", "config": str(second / "2parity.yaml")}]}
    run_study(load_study(config), log=lambda line, **kw: None)
    run = load_study(moved).runs()[0]
    assert run.key() != load_study(config).runs()[0].key() and run.is_done()
    finished = run.result_path.read_text()
    lines = []
    assert run_study(load_study(moved), log=lambda line, **kw: lines.append(line)) == 0
    assert "1 finished earlier (skipped), 0 to run" in lines[1] and run.result_path.read_text() == finished

    ckpts = sorted(run.dir.rglob("*.ckpt"))
    last = ckpts[0].parent / "last.ckpt"
    if not last.exists():
        shutil.copy(ckpts[0], last)
    run.result_path.unlink()  # interrupted under the first path: its checkpoint stays
    (run.dir / "fit.json").unlink()
    assert prepare_run(run) == "resume"
    # The contents are what the config parses to: an edited comment is the same run, a changed value is not.
    text = (second / "2parity.yaml").read_text()
    (second / "2parity.yaml").write_text("# an edited comment\n" + text)
    assert prepare_run(load_study(moved).runs()[0]) == "resume"
    assert "max_epochs: 10" in text
    (second / "2parity.yaml").write_text(text.replace("max_epochs: 10", "max_epochs: 11"))
    changed = load_study(moved).runs()[0]
    assert not changed.is_done() and prepare_run(changed) == "redo"


def test_a_fingerprint_is_of_the_composed_config_not_of_its_files(tmp_path, monkeypatch):
    """The fingerprint digests the CLI's default configs and the run's configs merged in order: a trainer option
    moved from the task file into the defaults, or into another composed file, is the same run; a changed value,
    or a later file's list replacing an earlier one with another, is another."""
    from lightning_maskprior.run import config_files

    monkeypatch.chdir(ROOT)
    task = yaml.safe_load((CONFIGS / "boolean/2parity.yaml").read_text())
    write = lambda name, content: (tmp_path / name).write_text(yaml.safe_dump(content)) and tmp_path / name  # noqa: E731
    defaults = write("defaults.yaml", {"trainer": {}})
    monkeypatch.setattr(config_files, "default_files", lambda: [defaults])

    def fingerprint(*files: Path) -> str:
        study = load_study(tiny_study(tmp_path / "out", seeds=[0], inits=["mask"],
                                      tasks=[{"name": "2parity", "config": [str(f) for f in files]}]))
        return study.runs()[0].fingerprint()

    whole = fingerprint(write("whole.yaml", task))
    callbacks, epochs = task["trainer"]["callbacks"], task["trainer"]["max_epochs"]
    slim = {**task, "trainer": {k: v for k, v in task["trainer"].items() if k not in ("max_epochs", "callbacks")}}
    write("defaults.yaml", {"trainer": {"max_epochs": epochs, "callbacks": callbacks}})
    assert fingerprint(write("slim.yaml", slim)) == whole  # moved into the defaults
    write("defaults.yaml", {"trainer": {}})
    extra = write("extra.yaml", {"trainer": {"max_epochs": epochs, "callbacks": callbacks}})
    assert fingerprint(tmp_path / "slim.yaml", extra) == whole  # moved into a file composed after it
    write("defaults.yaml", {"trainer": {"max_epochs": epochs, "callbacks": callbacks[:1]}})
    assert fingerprint(tmp_path / "whole.yaml") == whole  # the task file's list replaces the defaults' list
    assert fingerprint(tmp_path / "slim.yaml") != whole  # the defaults' (shorter) list is another run
    write("defaults.yaml", {"trainer": {"max_epochs": epochs + 1, "callbacks": callbacks}})
    assert fingerprint(tmp_path / "slim.yaml") != whole  # a changed value
    assert fingerprint(tmp_path / "whole.yaml") == whole  # ... the task file overrides


def test_run_still_executing_elsewhere_is_left_alone(tmp_path, monkeypatch):
    """A cell still running (e.g. one of a just-killed study saving its checkpoint) holds its run's .cell.lock:
    a new study waits for it, then refuses rather than delete or rerun the directory under it."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cell_module, "CELL_LOCK_WAIT_SECONDS", 0.3)
    run = load_study(tiny_study(tmp_path / "out")).runs()[0]
    run.dir.mkdir(parents=True)
    holder = hold_lock(run.dir, StudyRunDir.LOCK)
    try:
        with pytest.raises(StudyError, match=f"{run.name}: .* is still being executed by another process"):
            prepare_run(run)
        assert (run.dir / ".study.lock.json").exists()  # nothing deleted
    finally:
        holder.kill()
        holder.wait()
    assert prepare_run(run) == "redo"  # its holder gone, the directory (no run.json) is redone


# ------------------------------------------------------------- the local launcher: GPU slots, signals
FAKE_CELL = """
import json, os, sys, time
run_dir = sys.argv[1]
spec = json.load(open(os.path.join(run_dir, "run.json")))
start = time.time()
time.sleep(1.0)
result = {"key": spec["key"], "status": "ok", "seconds": 1.0, "metrics": {"val/mse": 0.5, "val/acc": 0.5},
          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "omp": os.environ.get("OMP_NUM_THREADS"),
          "started_at": start, "ended_at": time.time()}
json.dump(result, open(os.path.join(run_dir, "result.json"), "w"))
"""


def test_local_launcher_gives_concurrent_runs_disjoint_gpus(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(local_launcher, "_cuda_devices", lambda: ["0", "1", "2"])  # a fake 3-GPU machine
    monkeypatch.setattr(local_launcher, "cell_command", lambda run_dir: [sys.executable, "-c", FAKE_CELL, str(run_dir)])
    study = load_study(tiny_study(tmp_path / "out", launcher="local", parallel=2, gpus_per_run=1,
                                  threads_per_run=1, seeds=[0]))
    assert run_study(study, log=lambda line, **kw: None) == 0
    results = [json.loads(r.result_path.read_text()) for r in study.runs()]
    assert len(results) == 4 and all(r["omp"] == "1" for r in results)
    assert all(r["cuda_visible_devices"] in ("0", "1", "2") for r in results)  # exactly one device each
    overlapping = [(a, b) for i, a in enumerate(results) for b in results[i + 1:]
                   if a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]]
    assert overlapping  # runs did go two at a time
    assert all(a["cuda_visible_devices"] != b["cuda_visible_devices"] for a, b in overlapping)
    assert all(len([r for r in results if r["started_at"] <= a["started_at"] < r["ended_at"]]) <= 2
               for a in results)  # never more than parallel at once


@pytest.mark.parametrize("gpus,devices,expected", [
    (None, ["0", "1", "2", "3"], ["0", "1", "2", "3"]),  # default with CUDA: one each
    (2, ["4", "5", "6", "7", "8"], ["4,5", "6,7"]),  # slots of two; the odd device is left over
    (0, ["0", "1"], [""]),  # CPU runs on a GPU machine see no device
    (None, [], [None]),  # no CUDA: the environment is left alone
])
def test_local_launcher_device_slots(tmp_path, monkeypatch, gpus, devices, expected):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(local_launcher, "_cuda_devices", lambda: devices)
    launcher = local_launcher.LocalLauncher(load_study(tiny_study(tmp_path, launcher="local", gpus_per_run=gpus,
                                                                  parallel=8)))
    slots = launcher.slots or [None]
    assert [launcher.environment(s).get("CUDA_VISIBLE_DEVICES") for s in slots] == expected
    assert launcher.concurrency == (len(launcher.slots) if launcher.slots else 8)


def test_local_launcher_refuses_more_gpus_than_there_are(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(local_launcher, "_cuda_devices", lambda: ["0"])
    with pytest.raises(StudyError, match=r"gpus_per_run: each run asks for 2 CUDA device\(s\) but this machine has 1"):
        run_study(load_study(tiny_study(tmp_path / "out", launcher="local", gpus_per_run=2)))


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_killed_study_leaves_no_live_run(tmp_path):
    """SIGKILL to the study: its cell and the cell's fit die too (PDEATHSIG), the fit interrupted, not orphaned."""
    out = tmp_path / "out"
    config = tiny_study(out, launcher="local", seeds=[0], inits=["mask"],
                        tasks=[{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")}],
                        args=[*TINY, "--trainer.max_epochs", "100000"])
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    study = subprocess.Popen([sys.executable, "-m", "lightning_maskprior.cli", "study", "-c", str(path)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            children = _children(study.pid)
            commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children
                        if Path(f"/proc/{pid}/cmdline").exists()}
            if any(b"lightning_maskprior.cli\0fit" in c for c in commands.values()):
                break
            assert study.poll() is None, "the study ended before its run started"
            time.sleep(0.2)
        else:
            pytest.fail("the run's fit never started")
        assert len(children) == 2  # the cell and its fit
        study.kill()
        study.wait()
        deadline = time.time() + 60
        while any(_alive(pid) for pid in children) and time.time() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)]
    finally:
        if study.poll() is None:
            study.kill()
            study.wait()
    result = json.loads((out / "2parity/mask/seed0/result.json").read_text())  # the cell outlived its fit
    assert result["status"] == "interrupted"
    assert result["error"].startswith("interrupted during fit (exit code")  # not the fit's last line of stderr


# ------------------------------------------------------------------------------ reliability of a study
def test_an_out_dir_of_another_study_is_refused_unless_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    first = load_study(tiny_study(tmp_path / "out", title="first study", seeds=[0]))
    fake_results(first, {(t.name, i.label, 0): {"val/mse": 0.5, "val/acc": 0.75}
                         for t in first.tasks for i in first.inits})
    write_outputs(first, plots=False)
    finished = sorted(p for p in (tmp_path / "out").rglob("result.json"))
    other_args = [*TINY, "--model.lr_schedule", "constant"]
    second = load_study(tiny_study(tmp_path / "out", title="second study", seeds=[0], args=other_args))
    with pytest.raises(StudyError, match=r"out_dir \S+ holds another study: 'first study' .*--replace_out_dir true"):
        run_study(second, log=lambda *a, **k: None)
    assert sorted(p for p in (tmp_path / "out").rglob("result.json")) == finished  # nothing deleted
    # The same study again (an override of its grid included) is its own: it skips what it finished.
    again = load_study(tiny_study(tmp_path / "out", title="first study", seeds=[0], inits=["default"]))
    assert run_study(again, log=lambda *a, **k: None) == 0


def test_a_metric_tag_no_run_logged_is_a_warning_in_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    metrics = [*METRICS, {"tag": "val/acc_typo", "label": "typo"}]
    study = load_study(tiny_study(tmp_path / "out", seeds=[0], metrics=metrics))
    fake_results(study, {(t.name, i.label, 0): {"val/mse": 0.5, "val/acc": 0.75}
                         for t in study.tasks for i in study.inits})
    write_outputs(study, plots=False)
    md = (study.out_dir / "table.md").read_text()
    assert "**Warning**: no finished run logged 2parity: val/acc_typo, majority3: val/acc_typo" in md
    assert "val/mse" not in md.split("**Warning**")[1].splitlines()[0]


@pytest.mark.parametrize("args, message", [
    (["--model.warmup_steps", "-5"], r"task 2parity x init default: warmup_steps must be a whole number of steps "
                                     r">= 0, got -5"),
    (["--trainer.max_epochs", "0"], r"task 2parity x init default: trainer.max_epochs must be .* got 0"),
    (["--model.init_options", "{scale: -1}"], r"task 2parity x init mask: init method 'mask': init_options.scale "
                                              r"must be a number > 0, got -1"),
])
def test_dry_run_checks_every_run_by_the_rules_of_a_fit(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(ROOT)
    inits = ["default"] if "scale" not in args[-1] else ["mask"]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_study(tmp_path / "out", inits=inits, tasks=ONE_TASK, args=[*TINY, *args])))
    with pytest.raises(SystemExit) as exit_info:
        main(["study", "-c", str(path), "--dry_run", "true"])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.slow  # two real runs through the local launcher: ~1 min
def test_a_run_directory_deleted_while_the_study_runs_is_run_again(tmp_path, monkeypatch):
    """A local-launcher study whose first run's directory is deleted mid-run finishes, with every run ok."""
    monkeypatch.chdir(ROOT)
    study = load_study(tiny_study(tmp_path / "out", tasks=ONE_TASK, seeds=[0], launcher="local", parallel=1,
                                  inits=["default", "mask"]))
    victim = study.runs()[0].dir
    started = {}

    def delete_when_running():
        deadline = time.time() + 120
        while time.time() < deadline and not (victim / "cell.log").is_file():
            time.sleep(0.05)
        time.sleep(0.5)
        shutil.rmtree(victim, ignore_errors=True)
        started["deleted"] = True

    import threading

    thread = threading.Thread(target=delete_when_running, daemon=True)
    thread.start()
    assert run_study(study, log=lambda *a, **k: None) == 0
    thread.join(timeout=5)
    assert started.get("deleted")
    assert all(run.load_result()["status"] == "ok" for run in study.runs())


@pytest.mark.slow  # two real studies in subprocesses: ~1-4 min
def test_a_study_killed_with_sigkill_and_rerun_gives_the_uninterrupted_tables_and_curves(tmp_path):
    """Every cell of results.csv (but wall time) and every curve point equal those of a study that was never killed;
    the fit is killed mid-run, after its first checkpoint, and the rerun resumes it (and tests it) from there."""
    import csv
    import gzip
    import signal

    persistence = [{"class_path": "lightning_maskprior.callbacks.PriorPersistence",
                    "init_args": {"every_n_steps": 2, "probe_size": 16}}]
    args = [*TINY_BOOLEAN, "--data.init_args.batch_size", "8", "--trainer.max_epochs", "6",
            "--trainer.check_val_every_n_epoch", "1", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_model_summary", "false", "--trainer.callbacks", json.dumps(persistence)]

    def study_file(out: Path) -> Path:
        path = tmp_path / f"{out.name}.yaml"
        path.write_text(yaml.safe_dump({
            "title": "killed", "tasks": [{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")}],
            "inits": ["mask"], "seeds": [0], "args": args, "test": True, "parallel": 1, "launcher": "local",
            "metrics": [{"tag": "test/mse", "label": "MSE"}, {"tag": "test/acc", "label": "acc"}],
            "curves": ["val/acc", "val/mse"], "out_dir": str(out)}))
        return path

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_maskprior.cli", "study", "-c"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run([*command, str(study_file(whole))], check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)

    process = subprocess.Popen([*command, str(study_file(killed))], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoints = killed / "2parity/mask/seed0/lightning_logs/version_0/checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not list(checkpoints.glob("epoch=1-*.ckpt")) and process.poll() is None:
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)  # the study and its cell and fit: nothing gets to save or record
    process.wait()
    assert not (killed / "2parity/mask/seed0/result.json").is_file(), "the run finished before the kill"
    rerun = subprocess.run([*command, str(study_file(killed))], check=True, env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert "resumed from their last checkpoint" in rerun.stdout

    def rows(path: Path, drop: tuple[str, ...] = ()) -> list[dict]:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", newline="") as f:
            return [{k: v for k, v in row.items() if k not in drop} for row in csv.DictReader(f)]

    assert rows(killed / "results.csv", ("seconds",)) == rows(whole / "results.csv", ("seconds",))
    assert rows(killed / "curves.csv.gz") == rows(whole / "curves.csv.gz")
    assert any(r["tag"] == "persistence/score" for r in rows(whole / "curves.csv.gz"))


@pytest.mark.parametrize("study_json", [None, "{cut short", "dir"], ids=["missing", "unreadable", "a directory"])
def test_run_directories_no_readable_study_json_vouches_for_are_refused(tmp_path, monkeypatch, study_json):
    """Without a readable study.json, an out_dir holding another study's finished runs is refused (one line, exit 2,
    nothing deleted) instead of those runs being deleted and redone; the study's own runs are still its own."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    first = load_study(tiny_study(out, title="first study", seeds=[0], tasks=ONE_TASK, inits=["default"]))
    fake_results(first, {("2parity", "default", 0): {"val/mse": 0.5, "val/acc": 0.75}})
    if study_json == "dir":
        (out / "study.json").mkdir()
    elif study_json is not None:
        (out / "study.json").write_text(study_json)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    path = tmp_path / "second.yaml"
    path.write_text(yaml.safe_dump(tiny_study(out, title="second study", seeds=[0], tasks=ONE_TASK, inits=["default"],
                                              args=[*TINY, "--model.lr_schedule", "constant"])))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "study", "-c", str(path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert re.search(r"out_dir \S+ holds 1 run directory \(e.g. 2parity/default/seed0\) that no readable study.json "
                     r"vouches for .*--replace_out_dir true", proc.stderr), proc.stderr
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.startswith(LOCK_NAME)}
    assert after == before  # nothing deleted or rewritten (the study's lock file aside)
    if study_json != "dir":  # the first study again: its finished run is its own, kept, not rerun
        assert run_study(first, log=lambda *a, **k: None) == 0
        assert json.loads((out / "2parity/default/seed0/result.json").read_text())["status"] == "ok"


def test_a_study_checks_every_run_before_starting_any(tmp_path):
    """A bad option in the study's fit commands fails the study before any cell runs (as --dry_run does): one line,
    exit 2, no out_dir."""
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_study(tmp_path / "out", tasks=ONE_TASK, inits=["default"], seeds=[0],
                                              args=[*TINY, "--model.warmup_steps", "-5"])))
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "study", "-c", str(path)], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "task 2parity x init default: warmup_steps must be a whole number of steps >= 0, got -5" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_study_stopped_by_sigterm_exits_143(tmp_path):
    """The exit-code table's 143 for SIGTERM holds for a study as for a fit (130 is SIGINT's)."""
    import signal

    out = tmp_path / "out"
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_study(out, tasks=ONE_TASK, inits=["default"], seeds=[0], launcher="local",
                                              args=[*TINY, "--trainer.max_epochs", "500"])))
    study = subprocess.Popen([sys.executable, "-m", "lightning_maskprior.cli", "study", "-c", str(path)], cwd=ROOT,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list(out.glob("2parity/default/seed0/lightning_logs/version_*/config.yaml")):
            assert study.poll() is None and time.time() < deadline, study.communicate()
            time.sleep(0.5)
        study.send_signal(signal.SIGTERM)
        _, err = study.communicate(timeout=300)
    finally:
        if study.poll() is None:
            study.kill()
            study.wait()
    assert study.returncode == 143, err[-3000:]


# ---------------------------------------------------------- persistence measured by the study, outside the key
def _last_weights(root: Path) -> dict:
    import torch

    (last,) = root.rglob("last.ckpt")
    return torch.load(last, map_location="cpu", weights_only=True)["state_dict"]


def test_study_persistence_measures_runs_whose_config_does_not(tmp_path):
    """``persistence:`` adds PriorPersistence to runs whose config has none (TINY drops the config's callbacks): the
    table gets its score and half-life, the curves its points; the run's key is unchanged, so a run finished
    without it is kept."""
    plain = tiny_study(tmp_path / "out", tasks=ONE_TASK, inits=["mask"], seeds=[0])
    measured = {**plain, "persistence": {"every_n_steps": 2, "probe_size": 16}}
    study = load_study(measured)
    assert study.persistence == {"probe_split": "val", "every_n_steps": 2, "probe_size": 16}
    assert [r.key() for r in study.runs()] == [r.key() for r in load_study(plain).runs()]
    assert run_study(study, log=lambda line, **kw: None) == 0
    (run,) = study.runs()
    result = json.loads(run.result_path.read_text())
    assert result["status"] == "ok" and 0 < result["metrics"]["persistence/score"] <= 1.5
    assert "persistence/score" in (study.out_dir / "results.csv").read_text()
    assert "Persistence score" in (study.out_dir / "table.md").read_text()
    lines = []
    run_study(load_study(plain), log=lambda line, **kw: lines.append(line))  # without it: kept, not rerun
    assert "  1 finished earlier (skipped), 0 to run" in lines[1]


def test_study_persistence_leaves_the_training_as_it_was(tmp_path):
    """The callback a study adds (probe from the validation split) draws nothing from the training's random
    streams (dropout draws from torch's): a fit with it ends with the weights of the same fit without it."""
    spec = {"class_path": "lightning_maskprior.callbacks.PriorPersistence",
            "init_args": {"every_n_steps": 1, "probe_size": 16, "probe_split": "val"}}
    base = ["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--model.init", "mask", *TINY,
            "--model.backbone.init_args.dropout", "0.1", "--trainer.max_epochs", "6", "--seed_everything", "3"]
    main([*base, "--trainer.default_root_dir", str(tmp_path / "plain")])
    main([*base, f"--trainer.callbacks+={json.dumps(spec)}", "--trainer.default_root_dir", str(tmp_path / "measured")])
    plain, measured = _last_weights(tmp_path / "plain"), _last_weights(tmp_path / "measured")
    assert plain.keys() == measured.keys()
    assert all((plain[k] == measured[k]).all() for k in plain)
    assert "persistence/score" in next((tmp_path / "measured").rglob("scalars.csv")).read_text()


def test_a_configs_own_persistence_is_the_one_that_measures(tmp_path):
    """Two PriorPersistence callbacks (a config's, then a study's): the first measures, the second stands aside."""
    def spec(every: int) -> str:
        return "--trainer.callbacks+=" + json.dumps({"class_path": "lightning_maskprior.callbacks.PriorPersistence",
                                                     "init_args": {"every_n_steps": every, "probe_size": 16}})
    main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--model.init", "mask", *TINY, spec(3), spec(2),
          "--trainer.max_epochs", "7", "--trainer.default_root_dir", str(tmp_path)])
    rows = next(tmp_path.rglob("scalars.csv")).read_text().splitlines()
    steps = {int(line.split(",")[0]) for line in rows[1:] if line.split(",")[1] == "persistence/score"}
    assert steps and all(step % 3 == 0 for step in steps) and len(steps) > 1


@pytest.mark.parametrize("options,message", [
    ({"every_n_step": 2}, r"persistence: unknown options \['every_n_step'\]; expected PriorPersistence's, some of "
                          r"\['every_n_steps'"),
    ({"every_n_steps": 0}, r"persistence: every_n_steps must be >= 1, got 0"),
    ({"probe_split": "test"}, r"persistence: probe_split must be 'train' or 'val', got 'test'"),
])
def test_study_persistence_bad_options(tmp_path, options, message):
    with pytest.raises(StudyError, match=message):
        load_study(tiny_study(tmp_path / "out", persistence=options))

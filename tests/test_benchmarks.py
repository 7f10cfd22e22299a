"""The benchmark scripts' own arithmetic (their timings are not tested: benchmarks/ reports them)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "step_speed.py"


@pytest.fixture(scope="module")
def step_speed():
    spec = importlib.util.spec_from_file_location("step_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_ratio_cancels_a_slow_spell_that_hits_both_steps(step_speed):
    # Round 3 ran 3x slower for both steps (another process, say): the paired ratio does not move.
    fast = [1.0, 1.0, 3.0, 1.0, 1.0]
    slow = [2.0, 2.0, 6.0, 2.0, 2.0]
    assert step_speed.paired_ratio(fast, slow) == (0.5, 0.5, 0.5)
    # The ratio of separately taken medians would be the same here, but not once the spell is lopsided:
    fast, slow = [1.0, 1.0, 1.0, 3.0, 3.0], [3.0, 3.0, 6.0, 6.0, 6.0]
    median, low, high = step_speed.paired_ratio(fast, slow)
    assert median == pytest.approx(1 / 3) and low < median < high == pytest.approx(0.5)
    with pytest.raises(ValueError):
        step_speed.paired_ratio([1.0, 2.0], [1.0])  # rounds must pair up


def test_alternate_times_every_step_in_every_round(step_speed):
    calls = []
    times = step_speed.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert {key: len(t) for key, t in times.items()} == {"a": 3, "b": 3}
    rounds = [sorted(calls[i:i + 2]) for i in range(4, len(calls), 2)]  # after two warm-up calls each
    assert rounds == [["a", "b"]] * 3  # one call of each step per round
    assert len(calls) == 10


def test_alternate_shuffles_the_order_of_the_steps_between_rounds(step_speed):
    calls = []
    steps = {key: (lambda key=key: calls.append(key)) for key in "abcd"}
    step_speed.alternate(steps, rounds=6)
    orders = {tuple(calls[i:i + 4]) for i in range(8, len(calls), 4)}
    assert len(orders) > 1  # a fixed order would credit the step after a same-shaped one with its warm start


def test_step_speed_help_lists_every_option():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for option in ("--config", "--threads", "--rounds", "--iters", "--val-rounds", "--lightning-steps"):
        assert option in out


def test_gpu_check_runs_at_tiny_size_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.py --tiny: the prior's gradient path (SDPA math against the explicit kernel), the relative
    prior through FlexAttention (its output; no backward on a CPU) and one step of each tiny config, every row ok,
    the table and the JSON written (on a GPU it runs the paper configs)."""
    script = SCRIPT.parent / "gpu_check.py"
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(script), "--tiny", "--steps", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    import json

    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    kernels = ("prior gradient path", "relative prior through FlexAttention")
    assert rows["prior gradient path"]["status"] == "ok"
    assert "bfloat16: output" in rows["relative prior through FlexAttention"]["detail"]
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows.values()), rows
    assert all(r["gflop_per_step"] > 0 and r["ms_per_step"] > 0 for n, r in rows.items() if n not in kernels)
    assert "| prior gradient path | ok |" in proc.stdout


def test_gpu_check_without_a_gpu_says_so():
    script = SCRIPT.parent / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "no CUDA device is visible" in proc.stderr


def test_run_overhead_splits_a_tiny_fit_and_compares_it_with_its_steps(tmp_path):
    script = SCRIPT.parent / "run_overhead.py"
    tiny = ["--data.init_args.n", "6", "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth",
            "1", "--model.backbone.init_args.head_dim", "8", "--model.backbone.init_args.mlp_dim", "16",
            "--data.init_args.batch_size", "16", "--data.init_args.eval_batch_size", "64"]
    proc = subprocess.run([sys.executable, str(script), "--config", "boolean/paper/2parity.yaml", "--epochs", "1",
                           "--", *tiny], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "boolean/paper/2parity.yaml: 3 optimizer steps" in proc.stdout
    parts = ("whole fit", "start-up", "validation", "steps alone", "whole / steps", "extrapolated to its 90 epochs")
    for part in parts:
        assert part in proc.stdout, proc.stdout


def test_inject_overhead_runs_tiny():
    """benchmarks/inject_overhead.py end to end on a 2-block model: every variant timed, each ratio positive."""
    spec = importlib.util.spec_from_file_location("inject_overhead", SCRIPT.with_name("inject_overhead.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ratios = module.main(["--depth", "2", "--img-size", "16", "--batch", "4", "--rounds", "2", "--dtypes", "fp32"])
    assert set(ratios) == {("injected", "fp32"), ("injected + mask", "fp32")}
    assert all(r > 0 for r in ratios.values())


def test_prior_scaling_runs_tiny_and_tabulates_each_prior_against_the_untouched_gpt():
    spec = importlib.util.spec_from_file_location("prior_scaling", SCRIPT.with_name("prior_scaling.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.build_parser().parse_args(["--blocks", "8", "16", "--dim", "16", "--depth", "1", "--num-heads", "2",
                                             "--head-dim", "8", "--batch", "2", "--rounds", "1", "--vocab", "20"])
    cpu = torch.device("cpu")
    rows = {(r["block"], r["variant"]): r for block in args.blocks for r in module.measure(args, block, cpu)}
    assert rows[16, "full"]["prior_params"] == 16 * 16 and rows[16, "relative"]["prior_params"] == 2 * 16 - 1
    assert rows[16, "untouched"]["prior_params"] == 0 and rows[16, "untouched"]["time_ratio"] == (1.0, 1.0, 1.0)
    assert all(r["memory_mib"] > 0 and r["ms"] > 0 for r in rows.values())
    assert "| 16 | relative | 31 |" in module.table(list(rows.values()))

"""Every shipped config parses with --print_config, alone (tasks) or composed (inits, trainers)."""

import contextlib
import io

import pytest
import yaml

from conftest import CONFIGS
from lightning_maskprior.cli import main

READINGS = sorted((CONFIGS / "arithmetic" / "readings").glob("*.yaml"))  # composed after an arithmetic config
TASK_CONFIGS = sorted(
    p for p in CONFIGS.rglob("*.yaml")
    if p.relative_to(CONFIGS).parts[0] not in ("init", "trainer", "study", "tune") and p not in READINGS
)
COMPOSE_WITH = sorted((CONFIGS / "init").rglob("*.yaml")) + sorted((CONFIGS / "trainer").rglob("*.yaml"))
BASE = CONFIGS / "boolean" / "2parity.yaml"


def print_config(*configs, args: tuple[str, ...] = ()) -> dict:
    fit = ["fit"]
    for config in configs:
        fit += ["-c", str(config)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*fit, *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


def test_there_are_configs():
    assert len(TASK_CONFIGS) >= 8 and len(COMPOSE_WITH) >= 7


@pytest.mark.parametrize("config", TASK_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_task_config_parses(config):
    printed = print_config(config)
    assert printed["data"]["class_path"].startswith("lightning_maskprior.datamodules.")
    assert "backbone" in printed["model"]


@pytest.mark.parametrize("config", COMPOSE_WITH, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_init_and_trainer_configs_compose(config):
    printed = print_config(BASE, config)
    own = yaml.safe_load(config.read_text())
    for section, values in own.items():
        for key, value in values.items():
            if isinstance(value, dict):  # a structure: the printed one adds its defaults
                assert {k: printed[section][key][k] for k in value} == value, (section, key)
            else:
                assert printed[section][key] == value, (section, key)


@pytest.mark.parametrize("config", READINGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("task", ["multiplication", "addition"])
def test_arithmetic_readings_compose_with_the_paper_configs(config, task):
    printed = print_config(CONFIGS / "arithmetic" / "paper" / "pooled" / f"{task}.yaml", config)
    own = yaml.safe_load(config.read_text())
    assert {k: printed["data"]["init_args"][k] for k in own["data"]["init_args"]} == own["data"]["init_args"]
    assert printed["model"]["backbone"]["init_args"]["pooling"] == own["model"]["backbone"]["init_args"]["pooling"]
    assert printed["data"]["init_args"]["operation"] == task[:3]


def test_the_cli_reads_its_defaults_first_and_a_config_replaces_their_lists(tmp_path, monkeypatch):
    """The CLI's default configs come before any -c, and a config composes over them as a later -c does: an option
    it leaves out is the defaults', and a list given in both (trainer.callbacks) is the config's, not the two joined
    (as the fingerprint of a study's run merges them: study/spec.py merge_configs)."""
    from lightning_maskprior.run import config_files
    from lightning_maskprior.study.spec import merge_configs

    monitor = {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(yaml.safe_dump({"trainer": {"log_every_n_steps": 7, "max_epochs": 3, "callbacks": [monitor]}}))
    monkeypatch.setattr(config_files, "default_files", lambda: [defaults])
    task = yaml.safe_load(BASE.read_text())
    printed = print_config(BASE)["trainer"]
    names = [c["class_path"].rsplit(".", 1)[1] for c in printed["callbacks"]]
    assert names == ["PriorPersistence", "ExtrapolationMonitor", "AttentionMaps"]  # replaced, not appended
    assert names == [c["class_path"].rsplit(".", 1)[1] for c in task["trainer"]["callbacks"]]
    assert printed["log_every_n_steps"] == 7 and printed["max_epochs"] == task["trainer"]["max_epochs"]
    merged = merge_configs(yaml.safe_load(defaults.read_text()), task)["trainer"]
    assert merged["callbacks"] == task["trainer"]["callbacks"] and merged["log_every_n_steps"] == 7
    without = tmp_path / "without_callbacks.yaml"
    without.write_text(yaml.safe_dump({**task, "trainer": {k: v for k, v in task["trainer"].items()
                                                            if k != "callbacks"}}))
    assert [c["class_path"] for c in print_config(without)["trainer"]["callbacks"]] == [monitor["class_path"]]


def test_the_defaults_hold_only_what_is_right_for_every_run():
    """configs/trainer/default.yaml applies to every run, the user's own configs too: nothing there may tie a run
    to a machine (accelerator, precision, strategy) or to a task (its length, its callbacks)."""
    from lightning_maskprior.run import config_files

    files = config_files.default_files()
    assert files == [CONFIGS / "trainer" / "default.yaml"] and all(f.is_file() for f in files)
    for path in files:
        content = yaml.safe_load(path.read_text())
        assert set(content) == {"trainer"}, path
        assert not set(content["trainer"]) & {"accelerator", "precision", "strategy", "num_nodes", "max_epochs",
                                              "max_steps", "callbacks", "default_root_dir"}, path


def test_discover_reads_the_defaults_as_a_fit_does(tmp_path, monkeypatch, capsys):
    """``maskprior discover`` builds its task from the same composed config as ``maskprior fit``: defaults first."""
    from lightning_maskprior.run import config_files

    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(yaml.safe_dump({"trainer": {"devices": 0}}))  # refused by the Trainer: read, it stops
    assert "devices" not in yaml.safe_load(BASE.read_text())["trainer"]
    monkeypatch.setattr(config_files, "default_files", lambda: [defaults])
    with pytest.raises(SystemExit) as exit_info:
        main(["discover", "-c", str(BASE), "--out", str(tmp_path / "structure.yaml")])
    assert exit_info.value.code == 2 and "devices" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["multiplication", "addition"])
def test_the_paper_arithmetic_configs_are_the_reading_table_2_ran(task):
    """The shipped paper configs run exactly what the Table 2 study ran as its ``*_dependency_rows`` tasks."""
    paper = CONFIGS / "arithmetic" / "paper"
    shipped = print_config(paper / f"{task}.yaml")
    studied = print_config(paper / "pooled" / f"{task}.yaml", CONFIGS / "arithmetic" / "readings" / "lsd_operands.yaml",
                           args=("--data.init_args.readout_rows", "dependencies"))
    assert shipped == studied
    assert print_config(paper / "pooled" / f"{task}.yaml") != shipped


TUNES = sorted((CONFIGS / "tune").rglob("*.yaml"))  # maskprior tune files: parsed by the tune's own parser


def test_there_are_tune_configs():
    assert {p.stem for p in TUNES} >= {"quick", "pydoc_scale"}


@pytest.mark.parametrize("config", TUNES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_tune_config_parses_and_its_trial_commands_parse(config, monkeypatch):
    pytest.importorskip("optuna")
    from lightning_maskprior.tune.cli import build_parser
    from lightning_maskprior.tune.spec import check_trial_commands, load_tune

    monkeypatch.chdir(CONFIGS.parent)
    cfg = build_parser().parse_args(["-c", str(config)])
    tune = load_tune({k: v for k, v in cfg.as_dict().items() if k not in ("config", "dry_run")}, config)
    assert tune.out_dir == CONFIGS.parent / "runs" / "tune" / config.stem
    assert check_trial_commands(tune) >= 2 + 2 * len(tune.search)  # as configured, each range's ends, together

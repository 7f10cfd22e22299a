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
    if p.relative_to(CONFIGS).parts[0] not in ("init", "trainer", "study") and p not in READINGS
)
COMPOSE_WITH = sorted((CONFIGS / "init").rglob("*.yaml")) + sorted((CONFIGS / "trainer").rglob("*.yaml"))
BASE = CONFIGS / "boolean" / "2parity.yaml"


def print_config(*configs) -> dict:
    args = ["fit"]
    for config in configs:
        args += ["-c", str(config)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(args + ["--print_config"])
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
    printed = print_config(CONFIGS / "arithmetic" / "paper" / f"{task}.yaml", config)
    own = yaml.safe_load(config.read_text())
    assert {k: printed["data"]["init_args"][k] for k in own["data"]["init_args"]} == own["data"]["init_args"]
    assert printed["model"]["backbone"]["init_args"]["pooling"] == own["model"]["backbone"]["init_args"]["pooling"]
    assert printed["data"]["init_args"]["operation"] == task[:3]

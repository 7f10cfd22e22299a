"""Every shipped task config, alone and as each study composes it, parses to the configuration recorded in
tests/fixtures/print_config/ (``maskprior fit -c ... --print_config``): a change to the configs' layout changes no run.

After a deliberate change to what a config runs, record it again: ``python tests/test_config_layout.py``.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CONFIGS  # noqa: E402
from lightning_maskprior.cli import main  # noqa: E402
from lightning_maskprior.run import config_files  # noqa: E402

SNAPSHOTS = Path(__file__).resolve().parent / "fixtures" / "print_config"
NOT_TASKS = ("init", "trainer", "study", "tune")


def compositions() -> list[tuple[str, ...]]:
    """Each task config alone, and each list of configs a study composes for one of its tasks (names as -c takes)."""
    found = {(p.relative_to(CONFIGS).as_posix(),) for p in CONFIGS.rglob("*.yaml")
             if p.relative_to(CONFIGS).parts[0] not in NOT_TASKS and "readings" not in p.parts}
    for study in sorted((CONFIGS / "study").rglob("*.yaml")):
        for task in yaml.safe_load(study.read_text()).get("tasks") or []:
            configs = task.get("config") if isinstance(task, dict) else task
            configs = [configs] if isinstance(configs, str) else list(configs or [])
            names = tuple(_short(c) for c in configs)
            if names and all(names):
                found.add(names)
    return sorted(found)


def _short(name: str) -> str | None:
    path = config_files.resolve(name, CONFIGS.parent)
    return path.resolve().relative_to(CONFIGS).as_posix() if path is not None else None


def snapshot_path(configs: tuple[str, ...]) -> Path:
    return SNAPSHOTS / ("+".join(c.removesuffix(".yaml").replace("/", "__") for c in configs) + ".yaml")


def print_config(configs: tuple[str, ...]) -> str:
    args = ["fit"]
    for config in configs:
        args += ["-c", str(CONFIGS / config)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*args, "--print_config"])
    return out.getvalue()


@pytest.mark.parametrize("configs", compositions(), ids="+".join)
def test_a_config_parses_to_its_recorded_configuration(configs):
    recorded = snapshot_path(configs)
    assert recorded.is_file(), f"no recorded configuration for {configs}: run python tests/test_config_layout.py"
    assert yaml.safe_load(print_config(configs)) == yaml.safe_load(recorded.read_text())


def test_every_recorded_configuration_is_of_a_shipped_config():
    assert {snapshot_path(c) for c in compositions()} == set(SNAPSHOTS.glob("*.yaml"))


if __name__ == "__main__":
    SNAPSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SNAPSHOTS.glob("*.yaml"):
        old.unlink()
    for configs in compositions():
        snapshot_path(configs).write_text(print_config(configs))
        print(snapshot_path(configs).name)

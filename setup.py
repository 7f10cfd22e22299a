"""Which folders the wheel ships as packages, found by discovery; the rest of the metadata is in pyproject.toml.

pyproject.toml's ``[tool.setuptools.package-dir]`` installs three top-level folders of the repository inside
``lightning_maskprior`` (a bare ``import callbacks`` would collide in site-packages). Its ``packages`` cannot prefix
what discovery finds under such a mapping, so this file does: each mapped package and every folder below it is a
(namespace) package, configs/ subfolders included, and a new folder needs no edit anywhere. configs/ holds YAML
only: its files are ``package-data``.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pyproject's build-system requires tomli there
    import tomli as tomllib


ROOT = Path(__file__).resolve().parent


def packages(root: Path = ROOT) -> list[str]:
    """Each package of pyproject's package-dir mapping and every folder below it, by discovery."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for name, folder in mapping.items():
        below = find_namespace_packages(str(root / folder), exclude=["__pycache__", "*.__pycache__"])
        found += [name, *(f"{name}.{sub}" for sub in below)]
    return found


setup(packages=packages())

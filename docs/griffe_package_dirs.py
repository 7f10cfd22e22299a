"""A griffe extension for the API reference: subpackages whose source lives outside the package folder.

pyproject.toml maps ``lightning_maskprior.datamodules`` to the top-level ``datamodules/`` folder (and
``callbacks`` the same way). Python follows that mapping once the project is installed, but griffe reads the
source tree and would look for ``lightning_maskprior/datamodules/``. This extension reads the mapping from
``[tool.setuptools.package-dir]`` and loads each mapped folder as the subpackage it is installed as. It also
turns the package's lazily imported public names (``_EXPORTS`` in ``lightning_maskprior/__init__.py``) into
aliases, so ``::: lightning_maskprior.load_run`` finds the function wherever it is defined, and renders Sphinx roles
in docstrings (``:class:`X` ``) as code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from griffe import Alias, Extension, GriffeLoader, Module, Object

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# :class:`Name`, :func:`~pkg.mod.name`, ...: Sphinx roles, which Markdown would print as they are.
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`(~?)([\w.]+)`")


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """``{dotted subpackage name: folder}`` for every subpackage mapped to a folder of another name."""
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("package-dir", {})
    return {
        name: ROOT / folder
        for name, folder in table.items()
        if "." in name and (ROOT / folder / "__init__.py").is_file()  # a Python package, not a data folder
    }


def lazy_exports(init_file: Path) -> dict[str, str]:
    """The ``_EXPORTS`` dict of a package's ``__init__.py``: public name -> the module that defines it."""
    for node in ast.parse(init_file.read_text()).body:
        if isinstance(node, ast.AnnAssign):
            target = node.target
        elif isinstance(node, ast.Assign):
            target = node.targets[0]
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and node.value is not None:
            return ast.literal_eval(node.value)
    return {}


class PackageDirs(Extension):
    """Graft the folders of ``[tool.setuptools.package-dir]`` into the loaded package, and alias its lazy exports."""

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        for dotted, folder in package_dirs().items():
            parent_name, _, name = dotted.rpartition(".")
            if parent_name != pkg.path or name in pkg.members:
                continue
            # Load the folder's __init__ with the package as its parent (so relative imports resolve), attach it,
            # then its submodules, which then get their full dotted paths.
            module = loader._load_module(name, folder / "__init__.py", submodules=False, parent=pkg)
            pkg.set_member(name, module)
            loader._load_submodules(module)
        if isinstance(pkg.filepath, Path):
            for name, module_name in lazy_exports(pkg.filepath).items():
                if name not in pkg.members:
                    pkg.set_member(name, Alias(name, f"{pkg.path}.{module_name}.{name}", parent=pkg))

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SPHINX_ROLE.sub(
                lambda m: f"`{m[2].rpartition('.')[2] if m[1] else m[2]}`", obj.docstring.value
            )

    def on_module(self, *, mod: Module, **kwargs: Any) -> None:
        self.on_object(obj=mod)

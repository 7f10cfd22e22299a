"""The package's shape: no import cycle anywhere (imports inside functions included), and the run plumbing under
the method, never above it."""

import ast
import functools
from pathlib import Path

import pytest

from conftest import ROOT

# package prefix -> its folder (setuptools package-dir: the datamodules and callbacks live at the top level)
FOLDERS = {
    "lightning_maskprior.datamodules": ROOT / "datamodules",
    "lightning_maskprior.callbacks": ROOT / "callbacks",
    "lightning_maskprior": ROOT / "lightning_maskprior",
}
CORE = ("attention", "priors", "inits", "models", "module", "objectives", "task", "discover", "fourier", "checkpoints")


def module_file(name: str) -> Path | None:
    for prefix, folder in FOLDERS.items():
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):].lstrip(".").split(".") if name != prefix else []
            path = folder.joinpath(*rest)
            if (path / "__init__.py").is_file():
                return path / "__init__.py"
            if path.with_suffix(".py").is_file():
                return path.with_suffix(".py")
            return None
    return None


def module_name(path: Path) -> str:
    for prefix, folder in FOLDERS.items():
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([prefix, *parts])
    raise AssertionError(path)


def imports_of(path: Path, typing: bool = False) -> set[str]:
    """The package modules ``path`` imports, at the top or inside a function (with ``typing``, also those imported
    for annotations alone, under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = set() if typing else {  # `if TYPE_CHECKING:` imports never run
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the module pkg.sub where there is one, else a name of pkg
            names = [f"{node.module}.{a.name}" if module_file(f"{node.module}.{a.name}") else node.module
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("lightning_maskprior") and module_file(n)}
    return found


@functools.cache
def import_graph(typing: bool = False) -> dict[str, set[str]]:
    files = [p for folder in FOLDERS.values() for p in folder.rglob("*.py")]
    return {module_name(p): {module_name(module_file(n)) for n in imports_of(p, typing)} - {module_name(p)}
            for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "lightning_maskprior.run.cli" in graph["lightning_maskprior.cli"] or len(graph) > 30
    assert "lightning_maskprior.module" in graph["lightning_maskprior.run.cli"]
    assert "lightning_maskprior.callbacks.probe" in graph["lightning_maskprior.callbacks.attention_maps"]


def test_cycles_are_found():  # the check itself can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_import_cycle_counting_the_imports_for_annotations():
    """A contract stands beside the registry that checks it: the imports a type checker reads close no circle."""
    assert cycles(import_graph(typing=True)) == []


# A study's path, one module per step, each importing only those before it (typing imports included).
STUDY_PATH = ["paper_results", "spec", "lock", "cell", "launchers", "launchers.local", "launchers.slurm",
              "launchers.ray", "results", "tables", "figures", "scorecard", "report", "cli"]


def test_the_study_path_reads_one_way():
    graph = import_graph(typing=True)
    steps = [f"lightning_maskprior.study.{name}" for name in STUDY_PATH]
    assert sorted(steps + ["lightning_maskprior.study"]) == sorted(n for n in graph if n.startswith(
        "lightning_maskprior.study")), "a module of study/ that the path does not place"
    for i, step in enumerate(steps):
        later = sorted(set(steps[i + 1:]) & graph[step])
        assert not later, f"{step} imports {later}, which come after it on the study's path"


def test_every_function_of_the_study_fits_on_a_screen():
    """Every function of study/ within 80 lines."""
    long = [f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in (ROOT / "lightning_maskprior/study").rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80]
    assert not long


def test_every_benchmark_datamodule_is_a_maskprior_datamodule():
    from lightning_maskprior import datamodules
    from lightning_maskprior.datamodules.base import MaskPriorDataModule

    for name in ("BooleanGOTUDataModule", "ArithmeticDataModule", "CIFARDataModule", "ImageNet100DataModule",
                 "DigitsDataModule", "WikiText2DataModule", "TinyStoriesDataModule", "PydocDataModule"):
        assert issubclass(getattr(datamodules, name), MaskPriorDataModule), name


def test_a_datamodule_of_another_kind_is_refused_naming_the_contract():
    import lightning as L

    from lightning_maskprior.datamodules.base import MaskPriorDataModule
    from lightning_maskprior.run.cli import _task_spec

    with pytest.raises(TypeError, match="LightningDataModule is not a maskprior datamodule; expected a subclass of "
                                        "lightning_maskprior.datamodules.MaskPriorDataModule"):
        _task_spec(L.LightningDataModule())
    with pytest.raises(NotImplementedError, match="Half must implement dataset"):
        type("Half", (MaskPriorDataModule,), {})().dataset("train")


def test_the_base_class_owns_the_loaders():
    """A subclass gives task_spec and dataset; the base's loaders shuffle with the seed and cover each split."""
    import torch

    from lightning_maskprior.datamodules.base import MaskPriorDataModule
    from lightning_maskprior.datamodules.loaders import TensorDictDataset

    class Tiny(MaskPriorDataModule):
        batch_size, eval_batch_size, seed = 4, 5, 0

        def dataset(self, split):
            return TensorDictDataset(inputs=torch.arange(10 if split == "train" else 7).float())

    dm = Tiny()
    train = [b["inputs"] for b in dm.train_dataloader()]
    assert sorted(torch.cat(train).tolist()) == list(range(10)) and len(train) == 3
    assert torch.cat(train).tolist() != list(range(10))  # shuffled
    for loader in (dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()):
        assert torch.cat([b["inputs"] for b in loader]).tolist() == list(range(7))


@pytest.mark.parametrize("core", CORE)
def test_the_method_does_not_import_the_run_plumbing(core):
    """The method stands under the plumbing: nothing at the top level of the package imports run/ or study/."""
    graph = import_graph()
    names = [n for n in graph if n == f"lightning_maskprior.{core}" or n.startswith(f"lightning_maskprior.{core}.")]
    assert names
    for name in names:
        bad = {m for m in graph[name] if m.startswith(("lightning_maskprior.run", "lightning_maskprior.study"))}
        assert not bad, f"{name} imports {sorted(bad)}"

"""Plug-ins from a user's own package, outside the repository: found by import path by the CLI, a study and
load_run, checked against their contracts; and one prefix-token name for every backbone."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from conftest import CONFIGS, TINY_BOOLEAN
from lightning_maskprior import discover
from lightning_maskprior.attention import attention_layers
from lightning_maskprior.cli import main
from lightning_maskprior.contracts import PluginError, prefix_tokens
from lightning_maskprior.datamodules import BooleanGOTUDataModule
from lightning_maskprior.inits import apply_init, svd_query_key
from lightning_maskprior.models import TokenTransformer
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.objectives import ClassificationObjective, RegressionObjective, build_objective
from lightning_maskprior.plugins import resolve
from lightning_maskprior.priors import build_structure, pairs
from lightning_maskprior.run.load import load_run
from lightning_maskprior.task import TaskSpec

PACKAGE = "maskprior_user_plugins"
PLUGINS = '''
"""A user's plug-ins: one of each kind, and some that break their contracts."""
import torch
from torch import nn

from lightning_maskprior import attention_layers
from lightning_maskprior.discover import Discovery
from lightning_maskprior.objectives import RegressionObjective
from lightning_maskprior.priors import Structure


def band(backbone, structure, open_value: float = 4.0, closed_value: float = -4.0) -> None:
    """The structure as a learnable prior M, open_value on open pairs and closed_value elsewhere."""
    for layer in attention_layers(backbone):
        layer.set_prior(torch.where(structure.layer(0), open_value, closed_value), trainable=True)


band.uses_structure = True


def first_pair(datamodule, first: int = 0) -> Discovery:
    """Opens tokens first and first + 1."""
    return Discovery("first_pair", datamodule.task_spec().seq_len, [(first, first + 1)])


def first_pair_from_env(datamodule) -> Discovery:
    """Opens the pair starting at the token MASKPRIOR_TEST_FIRST names: an estimator whose result changes."""
    import os

    first = int(os.environ.get("MASKPRIOR_TEST_FIRST", "0"))
    return Discovery("first_pair_from_env", datamodule.task_spec().seq_len, [(first, first + 1)])


def raises_inside(backbone, structure) -> None:
    """An init method with a bug of its own."""
    raise ValueError("a bug in the user's init")


def out_of_range(datamodule) -> Discovery:
    """Opens a pair past the task's last token."""
    n = datamodule.task_spec().seq_len
    return Discovery("out_of_range", n, [(0, n)])


def ring(seq_len: int, width: int = 1) -> Structure:
    """Each token with its neighbours up to width away, around a ring."""
    index = torch.arange(seq_len)
    distance = (index[:, None] - index[None, :]).abs()
    return Structure(torch.minimum(distance, seq_len - distance) <= width, name=f"ring {width}")


class Huber(RegressionObjective):
    def loss(self, output, batch):
        return nn.functional.huber_loss(output.squeeze(-1).float(), batch["target"].float())


def huber(task):
    return Huber([-1.0, 1.0])


def one_argument(backbone):
    pass


def no_default(backbone, structure, width):
    pass


def estimator_of_dm(dm, steps: int = 1):
    pass


def gives_a_list(seq_len):
    return [[0, 1]]


def not_an_objective(task):
    return nn.Linear(1, 1)


NOT_A_FUNCTION = 3
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A package of plug-ins in a directory outside the repository, on this process's path and PYTHONPATH's."""
    root = tmp_path_factory.mktemp("user_code")
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "ext.py").write_text(textwrap.dedent(PLUGINS))
    (root / PACKAGE / "broken.py").write_text("import maskprior_no_such_dependency\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.startswith(PACKAGE)]:
        del sys.modules[name]


def plugin(name: str) -> str:
    return f"{PACKAGE}.ext:{name}"


def run_maskprior(args: list[str], plugin_path, cwd) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(plugin_path), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# ------------------------------------------------------------------------------------------ the resolver
def test_registered_names_and_import_paths_resolve(plugin_path):
    assert resolve("init", "mask").uses_structure and not resolve("init", "default").uses_structure
    assert resolve("estimator", "fourier") is discover.fourier_estimator
    assert resolve("structure", "full")(3).open.all()
    band = resolve("init", plugin("band"))
    assert band.__name__ == "band" and band.uses_structure
    assert build_structure(plugin("ring"), 6, {"width": 2}).name == "ring 2"
    task = TaskSpec("t", 6, 2, 1, RegressionObjective())
    assert type(build_objective(plugin("huber"), task)).__name__ == "Huber"
    assert isinstance(build_objective("classification", TaskSpec("t", 6, 2, 3, task.objective)),
                      ClassificationObjective)


@pytest.mark.parametrize("kind, name, message", [
    ("init", "maks", r"unknown init method 'maks'; expected one of \[.*'mask'.*\], or module.path:attribute"),
    ("init", "no_such_package.inits:band", r"init method 'no_such_package.inits:band': module "
                                           r"'no_such_package.inits' cannot be imported \(ModuleNotFoundError"),
    ("init", plugin("nothing"), rf"init method '{plugin('nothing')}': module '{PACKAGE}.ext' has no attribute "
                               r"'nothing'"),
    ("init", plugin("NOT_A_FUNCTION"), r"'.*:NOT_A_FUNCTION' is a int, not a function; expected fn\(backbone, "),
    ("init", plugin("one_argument"), r"init method '.*:one_argument' takes \(backbone\); expected fn\(backbone, "
                                     r"structure, \*\*options\)"),
    ("init", plugin("no_default"), r"init method '.*:no_default': option\(s\) width have no default"),
    ("estimator", plugin("estimator_of_dm"), r"estimator '.*:estimator_of_dm' takes \(dm, steps\); expected "
                                             r"fn\(datamodule, \*\*options\) -> Discovery"),
    ("objective", plugin("one_argument"), None),  # a function of one argument is an objective factory's shape
])
def test_a_plugin_that_breaks_its_contract_is_named_with_what_it_lacks(plugin_path, kind, name, message):
    if message is None:
        resolve(kind, name)
        return
    with pytest.raises(PluginError, match=message) as error:
        resolve(kind, name)
    assert "\n" not in str(error.value)


def test_what_a_builder_or_an_objective_gives_is_checked(plugin_path):
    with pytest.raises(PluginError, match=r"structure builder '.*:gives_a_list' returned a list; expected a Structure"):
        build_structure(plugin("gives_a_list"), 6)
    with pytest.raises(PluginError, match=r"structure builder '.*:ring': got an unexpected keyword argument 'radius' "
                                          r"\(its options: width\)"):
        build_structure(plugin("ring"), 6, {"radius": 2})
    with pytest.raises(PluginError, match=r"objective '.*:not_an_objective' \(Linear\) does not implement loss, "
                                          r"make_metrics, update_metrics"):
        build_objective(plugin("not_an_objective"), TaskSpec("t", 6, 2, 1, RegressionObjective()))


def test_a_bad_plugin_on_the_command_line_is_one_line_and_exit_2(plugin_path, tiny_args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--model.init", plugin("one_argument"), *tiny_args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"init method '{plugin('one_argument')}' takes (backbone); expected fn(backbone, structure" in err


# --------------------------------------------------------------------------------- fit, discover, study
def test_fit_and_load_run_with_an_init_a_structure_builder_and_an_objective_of_the_users(plugin_path, tmp_path,
                                                                                          tiny_args):
    run_maskprior(["fit", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--model.init", plugin("band"),
                   "--model.structure", f"{{builder: {plugin('ring')}, options: {{width: 2}}}}",
                   "--model.objective", plugin("huber"), *tiny_args], plugin_path, cwd=tmp_path)
    (run_dir,) = (tmp_path / "runs").glob("*/version_0")
    module, _ = load_run(run_dir)
    assert module.init_method == plugin("band") and type(module.objective).__name__ == "Huber"
    assert module.structure.name == "ring 2" and module.structure.seq_len == 6
    prior = attention_layers(module)[0].prior_logits
    assert prior is not None and prior.shape[-1] == 6


def test_an_estimator_of_the_users_in_the_discover_command_and_a_model(plugin_path, capsys):
    main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--method", plugin("first_pair"), "--first", "2",
          "--data.init_args.n", "6"])
    assert "pairs: [[2, 3]]" in capsys.readouterr().out
    datamodule = {"class_path": "lightning_maskprior.datamodules.BooleanGOTUDataModule", "init_args": {"n": 6}}
    backbone = functools.partial(TokenTransformer, dim=16, depth=1, head_dim=8, mlp_dim=16)
    module = MaskPriorModule(backbone, init="mask", structure=f"discover:{plugin('first_pair')}",
                             datamodule=datamodule)
    assert module.hparams["discovered_structure"]["pairs"] == [[0, 1]]
    assert discover.discover(plugin("first_pair"), BooleanGOTUDataModule(n=6), first=3).pairs == [(3, 4)]


def test_a_reload_and_a_resume_keep_the_structure_an_estimator_found_for_the_run(plugin_path, tmp_path, tiny_args,
                                                                                 monkeypatch):
    """The estimator would now return another structure: load_run and --ckpt_path last use the checkpoint's."""
    monkeypatch.setenv("MASKPRIOR_TEST_FIRST", "0")
    args = ["-c", str(CONFIGS / "boolean/2parity.yaml"), "--model.init", "mask", "--model.structure",
            f"discover:{plugin('first_pair_from_env')}", *tiny_args, "--trainer.max_epochs", "1"]
    main(["fit", *args])
    (run,) = (tmp_path / "runs").glob("*/version_0")
    monkeypatch.setenv("MASKPRIOR_TEST_FIRST", "2")
    module, _ = load_run(run)
    assert module.hparams["discovered_structure"]["pairs"] == [[0, 1]]
    assert module.structure.open[0, 0, 0, 1] and not module.structure.open[0, 0, 2, 3]
    main(["fit", *args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    last = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] > 0 and last["hyper_parameters"]["discovered_structure"]["pairs"] == [[0, 1]]
    assert yaml.safe_load((run / "hparams.yaml").read_text())["discovered_structure"]["pairs"] == [[0, 1]]


@pytest.mark.parametrize("init,raised", [
    (plugin("raises_inside"), f"init method '{plugin('raises_inside')}' raised ValueError: a bug in the user's init"),
    (f"{PACKAGE}.broken:anything", f"init method '{PACKAGE}.broken:anything': importing module '{PACKAGE}.broken' "
                                   "failed"),
], ids=["raised-in-the-init", "raised-importing-its-module"])
def test_an_exception_in_a_users_plugin_keeps_its_traceback_and_names_the_plugin(plugin_path, tmp_path, tiny_args,
                                                                                  init, raised):
    """Not the project's one-line bad input (exit 2): the user's bug, with its traceback (exit 1)."""
    path = os.pathsep.join(p for p in (str(plugin_path), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "fit", "-c",
                           str(CONFIGS / "boolean/2parity.yaml"), "--model.init", init, *tiny_args], cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and raised in proc.stderr, proc.stderr[-3000:]


def test_discover_refuses_an_estimators_pair_past_the_task_and_writes_a_result_without_a_summary(plugin_path,
                                                                                                  tmp_path, capsys):
    out = tmp_path / "structure.yaml"
    with pytest.raises(SystemExit) as info:
        main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--method", plugin("out_of_range"),
              "--data.init_args.n", "6", "--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "estimator 'maskprior_user_plugins.ext:out_of_range' returned the pair (0, 6); " \
        "expected two token indices in [0, 6)" in err and not out.exists()
    main(["discover", "-c", str(CONFIGS / "boolean/2parity.yaml"), "--method", plugin("first_pair"),
          "--data.init_args.n", "6", "--out", str(out)])  # first_pair gives no summary
    assert f"{out}: 1 open pair(s)" in capsys.readouterr().out
    assert "pairs: [[0, 1]]" in out.read_text()


def tiny_study(tmp_path, **changes) -> dict:
    study = {"tasks": [{"name": "2parity", "config": str(CONFIGS / "boolean/2parity.yaml")}],
             "inits": ["default", {"name": plugin("band")}], "seeds": [0],
             "args": [*TINY_BOOLEAN, "--trainer.max_epochs", "1", "--trainer.check_val_every_n_epoch", "1",
                      "--trainer.enable_model_summary", "false", "--trainer.callbacks", "null",
                      "--model.objective", plugin("huber")],
             "metrics": [{"tag": "val/mse", "label": "MSE"}], "test": False, "launcher": "inprocess",
             "out_dir": str(tmp_path / "out")}
    return {**study, **changes}


def test_a_study_checks_an_init_of_the_users_by_import_path(plugin_path, tmp_path, capsys):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_study(tmp_path)))
    main(["study", "-c", str(path), "--dry_run", "true"])
    assert "2 runs, valid (2 distinct fit commands parsed)" in capsys.readouterr().out
    path.write_text(yaml.safe_dump(tiny_study(tmp_path, inits=[{"name": plugin("no_default")}])))
    with pytest.raises(SystemExit) as exit_info:
        main(["study", "-c", str(path), "--dry_run", "true"])
    assert exit_info.value.code == 2
    assert "inits[0] (maskprior_user_plugins.ext:no_default): init method" in capsys.readouterr().err


@pytest.mark.slow
def test_a_study_runs_the_users_init_estimator_and_objective_in_subprocesses(plugin_path, tmp_path):
    args = [*tiny_study(tmp_path)["args"], "--model.structure", f"discover:{plugin('first_pair')}"]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_study(tmp_path, inits=[{"name": plugin("band")}], args=args,
                                              launcher="local")))
    run_maskprior(["study", "-c", str(path)], plugin_path, cwd=tmp_path)
    run = tmp_path / "out/2parity/band/seed0"
    assert yaml.safe_load((run / "result.json").read_text())["status"] == "ok"
    module, _ = load_run(run)
    assert module.init_method == plugin("band") and type(module.objective).__name__ == "Huber"
    assert module.hparams["discovered_structure"]["pairs"] == [[0, 1]]


# ----------------------------------------------------------------------------------- the prefix tokens
def test_qk_svd_leaves_the_cls_token_of_a_token_transformer_out_of_its_fit():
    """The token transformer's CLS token is a prefix token, as a ViT's: QK-SVD fits the task's tokens alone."""
    task = TaskSpec("t", seq_len=6, vocab_size=2, num_outputs=1, objective=RegressionObjective())
    torch.manual_seed(0)
    backbone = TokenTransformer(task, dim=16, depth=1, num_heads=2, head_dim=8, mlp_dim=16, pooling="cls")
    assert prefix_tokens(backbone) == 1
    structure = backbone.structure_for_sequence(pairs(6, [(0, 1)]))
    apply_init("qk_svd", backbone, structure, open_value=10.0, closed_value=0.0, pos_scale=1.0, qk_scale=1.0)
    with torch.no_grad():
        positions = backbone.blocks[0].norm1(backbone.positional_embedding()).float()
    target = torch.where(structure.layer(0), 10.0, 0.0).expand(2, -1, -1)
    wq, wk = svd_query_key(positions[1:], target[..., 1:, 1:], 8)
    q, k = attention_layers(backbone)[0].query_key_weights()
    assert torch.allclose(q[:, : wq.shape[1]], wq, atol=1e-5) and torch.allclose(k[:, : wk.shape[1]], wk, atol=1e-5)


def test_the_attention_estimator_reads_a_vit_among_its_patches_after_its_cls_token(monkeypatch):
    pytest.importorskip("timm")
    from lightning_maskprior.models import VisionTransformer

    extras = {"img_size": 8, "patch_size": 4, "in_chans": 1, "num_classes": 2}
    task = TaskSpec("images", seq_len=4, vocab_size=0, num_outputs=2, objective=ClassificationObjective(2),
                    extras=extras)
    backbone = functools.partial(VisionTransformer, model_kwargs={"embed_dim": 16, "depth": 1, "num_heads": 2})

    class Images:  # the task contract (contracts.TaskDataModule), nothing more
        def task_spec(self):
            return task

        def setup(self, stage=None):
            pass

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            return [{"inputs": torch.randn(8, 1, 8, 8, generator=generator), "target": torch.arange(8) % 2}]

    shapes = []
    relevant_tokens = discover.relevant_tokens
    monkeypatch.setattr(discover, "relevant_tokens",
                        lambda scores, *args: shapes.append(tuple(scores.shape)) or relevant_tokens(scores, *args))
    discover.discover("attention", Images(), make_module=lambda init: MaskPriorModule(backbone, init=init, task=task),
                      steps=0, seeds=[0], probe_size=8, max_loss_ratio=10.0)
    assert shapes == [(1, 2, 4, 4)]  # the 2 x 2 patches, not the CLS token before them

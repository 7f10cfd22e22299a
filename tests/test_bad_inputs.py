"""Bad inputs fail before any training, with a message that names the option or file, the bad value and
what was expected; never with a suggestion to load a file unsafely (``weights_only=False``)."""

from __future__ import annotations

import copy
import datetime
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import CONFIGS, TINY_BOOLEAN
from lightning_maskprior.cli import main
from lightning_maskprior.datamodules import (
    ArithmeticDataModule,
    BooleanGOTUDataModule,
    CIFARDataModule,
    DigitsDataModule,
    TinyStoriesDataModule,
    WikiText2DataModule,
)
from lightning_maskprior.models import TokenTransformer
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.run import checks, config_files
from lightning_maskprior.run.rundir import Checkpoint, CheckpointError, RunDir

BOOLEAN = str(CONFIGS / "boolean/2parity.yaml")
MASK = str(CONFIGS / "init/mask.yaml")
# "@name" in an argument is replaced by the path of file ``name`` made by the ``files`` fixture; "@runs" is the
# test's own run directory, which must stay empty: every case fails before a run directory is made.
TINY = [
    *TINY_BOOLEAN,
    "--trainer.max_epochs", "1", "--trainer.check_val_every_n_epoch", "1", "--trainer.callbacks", "null",
    "--trainer.enable_model_summary", "false", "--trainer.enable_progress_bar", "false",
    "--trainer.default_root_dir", "@runs",
]  # fmt: skip


def fit(*extra: str) -> list[str]:
    return ["fit", "-c", BOOLEAN, *TINY, *extra]


def fit_mask(*extra: str) -> list[str]:
    return ["fit", "-c", BOOLEAN, "-c", MASK, *TINY, *extra]


def own_task(target: str, seen: str, *extra: str) -> list[str]:
    return fit("--data.init_args.target", target, "--data.init_args.seen", seen, *extra)


def structure(spec: str) -> list[str]:
    return fit_mask("--model.structure", spec)


def study(name: str) -> list[str]:
    return ["study", "-c", f"@{name}", "--dry_run", "true"]


def tiny_module(init: str = "mask", **backbone) -> MaskPriorModule:
    task = BooleanGOTUDataModule("2parity", n=6).task_spec()
    options = {"dim": 16, "depth": 2, "head_dim": 8, "mlp_dim": 32, **backbone}
    return MaskPriorModule(lambda t: TokenTransformer(t, **options), init=init, task=task)


def wikitext(folder: str, tokenizer: str | None = None):
    def build(f):
        path = None if tokenizer is None else f[tokenizer]
        return WikiText2DataModule(data_dir=f[folder], cache_dir=f["cache"], vocab_size=300, tokenizer=path).task_spec()

    return build


def tinystories(folder: str):
    return lambda f: TinyStoriesDataModule(data_dir=f[folder], cache_dir=f["cache"], vocab_size=300).task_spec()


def raising_target(points: torch.Tensor) -> torch.Tensor:
    """A task of one's own whose target function fails."""
    raise ZeroDivisionError("no target here")


def nan_target(points: torch.Tensor) -> torch.Tensor:
    """A task of one's own whose target is NaN at one point."""
    values = points[:, 0].double()
    values[3] = float("nan")
    return values


EXPECTED_STRUCTURE = r"expected a Boolean \(0/1\) tensor of shape \(N, N\)"
NOT_READABLE = r"is not a readable PyTorch checkpoint \(truncated or not a checkpoint\)"

# (case id, argv of `maskprior` or a call taking the files, exit code or exception type, regex the message matches)
CASES = [
    # ------------------------------------------------------------------------- model options (CLI)
    ("warmup_steps negative", fit("--model.warmup_steps", "-5"), ValueError,
     r"warmup_steps must be a whole number of steps >= 0, got -5"),
    ("prior_weight_decay negative", fit("--model.prior_weight_decay", "-0.1"), ValueError,
     r"prior_weight_decay must be a finite number >= 0 .*got -0.1"),
    ("prior_weight_decay nan", fit("--model.prior_weight_decay", "nan"), 2,
     r"model.prior_weight_decay: expected float or null, got 'nan'"),
    ("init option not a number", fit_mask("--model.init_options", "{open_value: abc}"), ValueError,
     r"init method 'mask': init_options.open_value must be a number, got 'abc' \(str\)"),
    ("init option bool for a number", fit_mask("--model.init_options", "{scale: true}"), ValueError,
     r"init method 'mask': init_options.scale must be a number > 0, got True"),
    ("init option infinite", fit_mask("--model.init_options", "{open_value: .inf}"), ValueError,
     r"init method 'mask': init_options.open_value must be a finite number, got inf"),
    # ------------------------------------------------------------------------- nonsense that trained before
    ("mask scale negative", fit_mask("--model.init_options", "{scale: -1}"), 2,
     r"init method 'mask': init_options.scale must be a number > 0, got -1"),
    ("mask scale zero", fit_mask("--model.init_options", "{scale: 0}"), 2,
     r"init method 'mask': init_options.scale must be a number > 0, got 0"),
    ("qk_opt steps negative", fit("--model.init", "qk_opt", "--model.init_options", "{steps: -5}"), 2,
     r"init method 'qk_opt': init_options.steps must be a whole number > 0, got -5"),
    ("qk_svd pos_scale zero", fit("--model.init", "qk_svd", "--model.init_options", "{pos_scale: 0}"), 2,
     r"init method 'qk_svd': init_options.pos_scale must be a number > 0, got 0"),
    ("datamodule option unknown", fit("--data.init_args.nope", "1"), 2,
     r"data.init_args.nope: lightning_maskprior.datamodules.BooleanGOTUDataModule has no option nope; its options: "
     r"task, n, target, seen"),
    ("backbone option unknown", fit("--model.backbone.init_args.nope", "1"), 2,
     r"model.backbone.init_args.nope: lightning_maskprior.models.TokenTransformer has no option nope; its options: "
     r"dim, depth"),
    ("discover option unknown", ["discover", "-c", BOOLEAN, "--estimator.init_args.nope", "1"], 2,
     r"maskprior discover has no option --estimator.init_args.nope; expected -c/--config, --method, --out, --run, "
     r"an option of estimator 'fourier' \(--tolerance, --noise_multiple; .*\(--data.\*, --model.\*"),
    ("lr zero", fit("--model.optimizer.init_args.lr", "0"), 2,
     r"model.optimizer.init_args.lr must be a number > 0, got 0.0: the fit would train nothing"),
    ("max_epochs zero", fit("--trainer.max_epochs", "0"), 2, r"trainer.max_epochs must be .*, got 0"),
    ("limit_train_batches zero", fit("--trainer.limit_train_batches", "0"), 2,
     r"trainer.limit_train_batches must be .*, got 0"),
    ("gradient_clip_val negative", fit("--trainer.gradient_clip_val", "-1"), 2,
     r"trainer.gradient_clip_val must be a number >= 0 .*got -1"),
    ("accumulate_grad_batches zero", fit("--trainer.accumulate_grad_batches", "0"), 2,
     r"trainer.accumulate_grad_batches must be a whole number >= 1, got 0"),
    ("check_val_every_n_epoch zero", fit("--trainer.check_val_every_n_epoch", "0"), 2,
     r"trainer.check_val_every_n_epoch must be a whole number of epochs >= 1 .*got 0"),
    ("target empty", own_task("{}", "{x0: 1, '1': 1}"), 2, r"the target \{\} is an empty expansion \(0 everywhere\)"),
    ("target coefficient nan", own_task("{x0: .nan}", "{x0: 1, '1': 1}"), 2,
     r"the coefficient of 'x0' is nan; expected a finite number"),
    ("target coefficient inf", own_task("{x0: .inf}", "{x0: 1, '1': 1}"), 2,
     r"the coefficient of 'x0' is inf; expected a finite number"),
    ("target variable far beyond n", own_task("{x99999999999: 1}", "{x0: 1, '1': 1}"), 2,
     r"monomial 'x99999999999' uses x99999999999; expected variables x0 .. x5 \(n=6\)"),
    ("test without a checkpoint", ["test", "-c", BOOLEAN, "-c", MASK, *TINY], 2,
     r"test needs --ckpt_path, got none"),
    ("predict without a checkpoint", ["predict", "-c", BOOLEAN, "-c", MASK, *TINY], 2,
     r"predict needs --ckpt_path, got none"),
    ("test last without a run", ["test", "-c", BOOLEAN, "-c", MASK, *TINY, "--ckpt_path", "last"], 2,
     r"--ckpt_path last: no last.ckpt under \S+"),
    ("init option float for an integer", fit("--model.init", "qk_opt", "--model.init_options", "{steps: 1.5}"),
     ValueError, r"init method 'qk_opt': init_options.steps must be a whole number > 0, got 1.5"),
    ("init option unknown", fit_mask("--model.init_options", "{opn_value: 1}"), ValueError,
     r"init method 'mask' got unknown options \['opn_value'\]; it accepts \['closed_value', 'open_value', "
     r"'pos_scale', 'qk_gain', 'scale', 'value_alpha', 'value_beta'\]"),
    ("init method unknown", fit("--model.init", "maks"), ValueError,
     r"unknown init method 'maks'; expected one of \[.*'mask'"),
    ("open value below closed value", fit_mask("--model.init_options", "{open_value: -1, closed_value: 1}"),
     ValueError, r"open value \(-1\) must be greater than closed value \(1\)"),
    ("lr_schedule unknown", fit("--model.lr_schedule", "linear"), 2,
     r"model.lr_schedule: expected one of 'constant', 'cosine', got 'linear'"),
    ("option unknown", fit("--model.learning_rate", "5"), 2, r"unrecognized arguments: --model.learning_rate 5"),
    # -------------------------------------------------------------------------- data options (CLI)
    ("max_train_points negative", fit("--data.init_args.max_train_points", "-1"), ValueError,
     r"max_train_points must be a positive number of training points, or null for every seen point, got -1"),
    ("max_train_points zero", fit("--data.init_args.max_train_points", "0"), ValueError,
     r"max_train_points must be a positive number .*got 0"),
    ("Boolean task unknown", fit("--data.init_args.task", "2parrity"), ValueError,
     r"unknown Boolean task '2parrity'; expected one of \['2parity', 'cyclic3', 'majority3', 'threesym'\]"),
    ("n zero", fit("--data.init_args.n", "0"), ValueError, r"n=0 bits is outside 1..20"),
    ("n too large", fit("--data.init_args.n", "21"), ValueError, r"n=21 bits is outside 1..20"),
    ("cyclic3 n too small", fit("--data.init_args.task", "cyclic3", "--data.init_args.n", "2"), ValueError,
     r"cyclic3 needs n >= 3, got n=2"),
    ("batch_size zero", fit("--data.init_args.batch_size", "0"), ValueError, r"batch sizes must be positive, got 0"),
    ("seed not a number", fit("--data.init_args.seed", "abc"), 2, r"data.init_args.seed: expected int, got 'abc'"),
    # ---------------------------------------------------------------------------------- YAML files
    ("config YAML syntax error", ["fit", "-c", BOOLEAN, "-c", "@syntax.yaml", *TINY], 2,
     r"error: config \S*syntax.yaml: YAML syntax error at line 3, column 4: expected ',' or '\]', but got ':' "
     r"\(while parsing a flow sequence that starts at line 2, column 9\)"),
    ("config not a mapping", ["fit", "-c", "@list.yaml", *TINY], 2,
     r"config \S*list.yaml holds a YAML list; expected a mapping of options \(key: value\)"),
    ("config empty", ["fit", "-c", BOOLEAN, "-c", "@empty.yaml", *TINY], 2,
     r"config \S*empty.yaml is empty: expected a mapping of options"),
    ("config not UTF-8", ["fit", "--config=@binary.yaml", *TINY], 2, r"config \S*binary.yaml is not UTF-8 text"),
    ("config missing", ["fit", "-c", "@missing.yaml", *TINY], 2, r"File does not exist: '\S*missing.yaml'"),
    ("config key unknown", ["fit", "-c", BOOLEAN, "-c", "@unknown_key.yaml", *TINY], 2,
     r"Subcommand 'fit' does not accept option 'model.warmup'"),
    # ------------------------------------------------------------------------------ a task of your own
    ("own task without seen", fit("--data.init_args.target", "{x0: 1.0}"), ValueError,
     r"a task of your own needs both `target` and `seen`"),
    ("seen nowhere", own_task("{x0: 1.0}", "{'1': -1.0}"), ValueError,
     r"the seen condition \{'1': -1.0\} holds nowhere on the cube"),
    ("seen everywhere", own_task("{x0: 1.0}", "{'1': 1.0}"), ValueError,
     r"task 2parity: the seen condition \{'1': 1.0\} holds on all 2\^6 = 64 points, so there is no unseen slice"),
    ("monomial unreadable", own_task("{y0: 1.0}", "{x0: 1.0}"), ValueError,
     r"cannot read monomial 'y0': expected factors like x0\*x3, or '1'"),
    ("monomial beyond n", own_task("{x9: 1.0}", "{x0: 1.0}"), ValueError,
     r"monomial 'x9' uses x9; expected variables x0 .. x5 \(n=6\)"),
    ("coefficient not a number", own_task("{x0: abc}", "{x0: 1.0}"), 2,
     r"data.init_args.target: expected dict\[str, float\], str or null, got \"\{'x0': 'abc'\}\""),
    ("import path missing", own_task("no_such_module:f", "{x0: 1.0}"), ValueError,
     r"cannot import 'no_such_module:f': No module named 'no_such_module'"),
    ("import path bad shape", own_task("torch:ones_like", "{x0: 1.0}"), ValueError,
     r"target 'torch:ones_like' returned shape \(64, 6\), expected \(64,\)"),
    ("target function raises", own_task("test_bad_inputs:raising_target", "{x0: 1.0}"), 2,
     r"data.init_args.target: 'test_bad_inputs:raising_target' failed on the 2\^6 points: ZeroDivisionError: "
     r"no target here"),
    ("seen function raises", own_task("{x0: 1.0}", "test_bad_inputs:raising_target"), 2,
     r"data.init_args.seen: 'test_bad_inputs:raising_target' failed on the 2\^6 points"),
    ("target function NaN", own_task("test_bad_inputs:nan_target", "{x0: 1.0}"), 2,
     r"data.init_args.target: 'test_bad_inputs:nan_target' returned 1 NaN and 0 infinite values of 64; expected a "
     r"finite number at every point"),
    ("own task mask without structure", own_task("{x0: 1.0}", "{x0: 1.0}", "--model.init", "mask"), ValueError,
     r"init method 'mask' needs a structure, but the task gave none"),
    # ----------------------------------------------------------------------------------- structures
    ("structure pair out of range", structure("{pairs: [[0, 9]]}"), ValueError,
     r"pair \[0, 9\] has token 9, outside 0..5"),
    ("structure two sources", structure("{pairs: [[0, 1]], file: x.pt}"), ValueError,
     r"a structure needs exactly one of pairs, heads, layers, file or builder; got \['pairs', 'file'\]"),
    ("structure file missing", structure("{file: @missing.pt}"), FileNotFoundError,
     rf"structure file \S*missing.pt does not exist; {EXPECTED_STRUCTURE}"),
    ("structure file suffix", structure("{file: @structure.txt}"), ValueError,
     r"structure file \S*structure.txt must end in .pt or .npy, not '.txt'"),
    ("structure .pt random bytes", structure("{file: @random.pt}"), ValueError,
     rf"structure file \S*random.pt is not a torch.save file \(truncated, or another format\); {EXPECTED_STRUCTURE}"),
    ("structure .pt truncated", structure("{file: @truncated.pt}"), ValueError,
     r"structure file \S*truncated.pt is not a torch.save file"),
    ("structure .pt holds a dict", structure("{file: @dict.pt}"), ValueError,
     rf"structure file \S*dict.pt holds a dict with keys \['open'\]; {EXPECTED_STRUCTURE}"),
    ("structure .pt holds a list", structure("{file: @list.pt}"), ValueError,
     rf"structure file \S*list.pt holds a list; {EXPECTED_STRUCTURE}"),
    ("structure .pt holds an object", structure("{file: @object.pt}"), ValueError,
     r"structure file \S*object.pt holds Python objects other than tensors"),
    ("structure .npy holds text", structure("{file: @text.npy}"), ValueError,
     rf"structure file \S*text.npy is not a .npy array \(no NumPy header; a text file\?\); {EXPECTED_STRUCTURE}"),
    ("structure .npy holds strings", structure("{file: @strings.npy}"), ValueError,
     rf"structure file \S*strings.npy holds <U1 values; {EXPECTED_STRUCTURE}"),
    ("structure .npy holds objects", structure("{file: @objects.npy}"), ValueError,
     r"structure file \S*objects.npy cannot be read safely \(it holds pickled Python objects\)"),
    ("structure values not 0/1", structure("{file: @half.npy}"), ValueError,
     rf"structure file \S*half.npy holds values other than 0 and 1 \(e.g. 0.5\); {EXPECTED_STRUCTURE}"),
    ("structure not square", structure("{file: @rectangle.pt}"), ValueError,
     rf"structure file \S*rectangle.pt holds a tensor of shape \(6, 5\); {EXPECTED_STRUCTURE}"),
    ("structure size", structure("{file: @eye5.pt}"), ValueError,
     r"structure is 5x5 but the sequence has 6 tokens \(structure file \S*eye5.pt\)"),
    ("structure row all closed", structure("{file: @closed_row.pt}"), ValueError,
     r"closed_row.pt: row 2 \(layer 0, head 0\) has no open entry"),
    ("structure heads", structure("{file: @heads4.pt}"), ValueError,
     r"heads4.pt has 4 heads but the model has 3 \(give 1 to share one pattern across heads\)"),
    # ----------------------------------------------------------------------------------- data files
    ("WikiText folder missing", wikitext("missing_dir"), FileNotFoundError,
     r"no WikiText-2 under \S*missing_dir: expected wiki.train.raw / wiki.valid.raw / wiki.test.raw"),
    ("WikiText undecodable bytes", wikitext("wiki_binary"), ValueError,
     r"WikiText-2 file \S*wiki.valid.raw is not UTF-8 text: byte 0xff at offset 6 cannot be decoded"),
    ("WikiText empty split file", wikitext("wiki_empty"), ValueError,
     r"WikiText-2 validation split is empty: \S*wiki.valid.raw holds no text"),
    ("tokenizer file garbage", wikitext("wiki_good", tokenizer="garbage.json"), ValueError,
     r"tokenizer file \S*garbage.json is not a tokenizer.json of the tokenizers library"),
    ("TinyStories empty file", tinystories("stories_empty"), ValueError,
     r"TinyStories train split is empty: \S*TinyStories-train.txt holds no story"),
    ("TinyStories undecodable bytes", tinystories("stories_binary"), ValueError,
     r"TinyStories file \S*TinyStories-train.txt is not UTF-8 text: byte 0xff"),
    ("CIFAR folder missing", lambda f: CIFARDataModule(root=f["missing_dir"]).setup("fit"), FileNotFoundError,
     r"CIFAR-10 folder \S*missing_dir/cifar-10-batches-py does not exist"),
    ("digits max_train_size negative", lambda f: DigitsDataModule(max_train_size=-1), ValueError,
     r"max_train_size must be a positive number of images, or null for all of them, got -1"),
    ("arithmetic train_fraction", lambda f: ArithmeticDataModule(train_fraction=0.0), ValueError,
     r"train_fraction must be in \(0, 1\), got 0.0"),
    ("arithmetic num_digits", lambda f: ArithmeticDataModule(num_digits=5), ValueError,
     r"num_digits must be 1..4 .*got 5"),
    # ---------------------------------------------------------------------------------- checkpoints
    # Unreadable: read once, right after parsing, before anything is built (MaskPriorCLI.parse_arguments; exit 2).
    ("checkpoint missing", fit_mask("--ckpt_path", "@missing.ckpt"), 2,
     r"ckpt_path \S*missing.ckpt does not exist; expected a .ckpt file"),
    ("checkpoint is a folder", fit_mask("--ckpt_path", "@missing_dir"), 2,
     r"ckpt_path \S*missing_dir is a directory; expected a .ckpt file"),
    ("checkpoint empty", fit_mask("--ckpt_path", "@empty.ckpt"), 2,
     rf"checkpoint \S*empty.ckpt {NOT_READABLE}: the file is empty"),
    ("checkpoint truncated", fit_mask("--ckpt_path", "@truncated.ckpt"), 2,
     rf"checkpoint \S*truncated.ckpt {NOT_READABLE}: it is not a complete zip archive"),
    ("checkpoint garbage", fit_mask("--ckpt_path", "@garbage.ckpt"), 2, rf"checkpoint \S*garbage.ckpt {NOT_READABLE}"),
    ("checkpoint holds a tensor", fit_mask("--ckpt_path", "@tensor.ckpt"), 2,
     r"checkpoint \S*tensor.ckpt holds a Tensor; expected a Lightning checkpoint \(a dict with a 'state_dict'\)"),
    ("checkpoint without state_dict", fit_mask("--ckpt_path", "@weights.ckpt"), 2,
     r"checkpoint \S*weights.ckpt holds a dict with keys \['weight'\]; expected a Lightning checkpoint"),
    ("checkpoint holds an object", fit_mask("--ckpt_path", "@object.ckpt"), 2,
     r"checkpoint \S*object.ckpt holds Python objects a safe load refuses \(datetime.date\)"),
    ("checkpoint in a config file", ["fit", "-c", BOOLEAN, "-c", "@ckpt_config.yaml", *TINY], 2,
     rf"checkpoint \S*garbage.ckpt {NOT_READABLE}"),
    ("checkpoint with --ckpt_path=", fit_mask("--ckpt_path=@empty.ckpt"), 2,
     rf"checkpoint \S*empty.ckpt {NOT_READABLE}"),
    ("validate with garbage checkpoint", ["validate", "-c", BOOLEAN, *TINY, "--ckpt_path", "@garbage.ckpt"], 2,
     rf"checkpoint \S*garbage.ckpt {NOT_READABLE}"),
    ("test with truncated checkpoint", ["test", "-c", BOOLEAN, *TINY, "--ckpt_path", "@truncated.ckpt"], 2,
     rf"checkpoint \S*truncated.ckpt {NOT_READABLE}"),
    ("checkpoint version garbage", fit_mask("--ckpt_path", "@version_garbage.ckpt"), 2,
     r"checkpoint \S*version_garbage.ckpt records Lightning version 'garbage', which is not a version"),
    ("checkpoint version old", fit_mask("--ckpt_path", "@version_old.ckpt"), 2,
     r"checkpoint \S*version_old.ckpt was written by Lightning 0.5.0; expected one of Lightning 2.0 or later"),
    ("checkpoint without a version", fit_mask("--ckpt_path", "@version_none.ckpt"), 2,
     r"checkpoint \S*version_none.ckpt records no Lightning version"),
    ("checkpoint of weights only", fit_mask("--ckpt_path", "@weights_only.ckpt"), 2,
     r"checkpoint \S*weights_only.ckpt holds the model's weights only \(no optimizer state"),
    ("checkpoint beyond max_epochs", fit_mask("--ckpt_path", "@epochs5.ckpt"), 2,
     r"checkpoint \S*epochs5.ckpt has trained 5 epochs, more than trainer.max_epochs 1; expected trainer.max_epochs "
     r">= 5"),
    ("checkpoint prior NaN", fit_mask("--ckpt_path", "@nan_prior.ckpt"), 2,
     r"checkpoint \S*nan_prior.ckpt holds a prior that is not finite: \S*prior_logits \(1 NaN, 0 infinite\)"),
    ("load_from_checkpoint prior NaN", lambda f: MaskPriorModule.load_from_checkpoint(f["nan_prior.ckpt"]),
     CheckpointError, r"the checkpoint holds a prior that is not finite: \S*prior_logits \(1 NaN"),
    ("num_workers negative", fit("--data.init_args.num_workers", "-1"), 2,
     r"num_workers must be a whole number >= 0 \(0: load in the main process\), got -1"),
    # Readable, but of another config: checked against the model in MaskPriorCLI.before_fit.
    ("checkpoint other dim", fit_mask("--model.backbone.init_args.dim", "32", "--ckpt_path", "@tiny.ckpt"),
     CheckpointError, r"checkpoint \S*tiny.ckpt was trained with dim 16, the config asks for dim 32$"),
    ("checkpoint other n", fit_mask("--data.init_args.n", "7", "--ckpt_path", "@tiny.ckpt"), CheckpointError,
     r"checkpoint \S*tiny.ckpt belongs to another run than the config describes: data.init_args.n: checkpoint 6, "
     r"config 7"),
    ("checkpoint other depth", fit_mask("--model.backbone.init_args.depth", "3", "--ckpt_path", "@tiny.ckpt"),
     CheckpointError, r"checkpoint \S*tiny.ckpt was trained with depth 2, the config asks for depth 3$"),
    ("on_load_checkpoint other width",
     lambda f: tiny_module(dim=32).on_load_checkpoint(Checkpoint(f["tiny.ckpt"]).contents), CheckpointError,
     r"the checkpoint was trained with dim 16, .*the config asks for dim 32"),
    ("on_load_checkpoint other init",
     lambda f: tiny_module("default").on_load_checkpoint(Checkpoint(f["tiny.ckpt"]).contents), CheckpointError,
     r"the checkpoint has a prior \(trained with init 'mask'\), the config asks for init 'default'"),
    # ------------------------------------------------------------------------ types, trainer, optimizer
    ("lr not a number", fit("--model.optimizer.init_args.lr", "abc"), 2,
     r"^error: model.optimizer.init_args.lr: expected float or torch.Tensor, got 'abc'"),
    ("max_epochs not a number", fit("--trainer.max_epochs", "abc"), 2,
     r"^error: trainer.max_epochs: expected int or null, got 'abc'"),
    ("warmup_steps not whole", fit("--model.warmup_steps", "1.5"), 2,
     r"^error: model.warmup_steps: expected int, got '1.5'"),
    ("weight_decay negative", fit("--model.optimizer.init_args.weight_decay", "-0.1"), 2,
     r"model.optimizer: torch.optim.Adam refuses its options: Invalid weight_decay value: -0.1"),
    ("betas out of range", fit("--model.optimizer.init_args.betas", "[1.5, 0.999]"), 2,
     r"model.optimizer: torch.optim.Adam refuses its options: Invalid beta parameter at index 0: 1.5"),
    ("devices zero", fit("--trainer.devices", "0"), 2, r"^error: trainer: .*devices"),
    *([("accelerator gpu without a GPU", fit("--trainer.accelerator", "gpu"), 2, r"^error: trainer: .*gpu")]
      if not torch.cuda.is_available() else []),
    ("ckpt_path best", fit_mask("--ckpt_path", "best"), 2,
     r"--ckpt_path best names a checkpoint of a fit in this same process .*expected last .* or a checkpoint file"),
    # ---------------------------------------------------------------------------------- study files
    ("study YAML syntax error", study("study_syntax.yaml"), 2,
     r"study file \S*study_syntax.yaml: YAML syntax error at line 3, column 1: expected ',' or '\]', but got "
     r"'<stream end>' \(while parsing a flow sequence that starts at line 2, column 11\)"),
    ("study init unknown", study("study_init.yaml"), 2, r"study_init.yaml: .*'maks'"),
    ("study config missing", study("study_config.yaml"), 2,
     r"study_config.yaml: tasks\[0\] \(t\): config '\S*missing.yaml' does not exist"),
    ("study seed negative", study("study_seeds.yaml"), 2,
     r"study_seeds.yaml: seeds\[0\]: a seed is a non-negative integer, got -1"),
    ("study seeds empty", study("study_no_seeds.yaml"), 2, r"study_no_seeds.yaml: seeds: give at least one seed"),
    # a dry run checks what each run checks before it trains, not only that its command parses
    ("study dry run structure size", study("study_structure_size.yaml"), 2,
     r"study_structure_size.yaml: task 2parity x init default: pair \[0, 20\] has token 20, outside 0..14"),
    ("study dry run rank", study("study_rank.yaml"), 2,
     r"task 2parity x init default: prior_rank 16 is above the 15 tokens of the prior"),
    ("study dry run builder", study("study_builder.yaml"), 2,
     r"task 2parity x init default: structure builder 'no_such_pkg:builder': module 'no_such_pkg' cannot be imported"),
    ("study dry run estimator", study("study_estimator.yaml"), 2,
     r"task 2parity x init default: discovery method 'no_such_pkg:est': module 'no_such_pkg' cannot be imported"),
    ("study dry run out_dir of another study", study("study_other_out.yaml"), 2,
     r'study_other_out.yaml: out_dir \S*other_study holds another study: "someone else\'s" \(from theirs.yaml\)'),
]  # fmt: skip


def _write_files(root: Path) -> dict[str, Path]:
    f: dict[str, Path] = {"missing_dir": root / "missing_dir", "cache": root / "cache"}
    f["missing_dir"].mkdir()  # holds nothing: a folder where a file or dataset is expected

    def path(name: str) -> Path:
        f[name] = root / name
        return f[name]

    for name in ("missing.yaml", "missing.pt", "missing.ckpt"):
        path(name)
    # YAML
    path("syntax.yaml").write_text("model:\n  init: [mask\n  x: 1\n")
    path("list.yaml").write_text("- model\n- data\n")
    path("empty.yaml").write_text("\n")
    path("binary.yaml").write_bytes(b"model:\n  init: \xff\xfe\n")
    path("unknown_key.yaml").write_text("model:\n  warmup: 5\n")
    # structures
    eye = torch.eye(6, dtype=torch.bool)
    path("structure.txt").write_text("0 1\n1 0\n")
    path("random.pt").write_bytes(bytes(range(256)) * 4)
    torch.save(eye, path("eye.pt"))
    path("truncated.pt").write_bytes(f["eye.pt"].read_bytes()[:200])
    torch.save({"open": eye}, path("dict.pt"))
    torch.save([eye, eye], path("list.pt"))
    torch.save(datetime.date(2024, 1, 1), path("object.pt"))
    path("text.npy").write_text("1 0 0\n0 1 0\n0 0 1\n")
    np.save(path("strings.npy"), np.array([["1", "0"], ["0", "1"]]))
    np.save(path("objects.npy"), np.array([{"open": 1}], dtype=object), allow_pickle=True)
    np.save(path("half.npy"), np.full((6, 6), 0.5))
    torch.save(torch.ones(6, 5), path("rectangle.pt"))
    torch.save(torch.eye(5, dtype=torch.bool), path("eye5.pt"))
    closed = eye.clone()
    closed[2, 2] = False
    torch.save(closed, path("closed_row.pt"))
    torch.save(eye.expand(4, 6, 6).clone(), path("heads4.pt"))
    # text data
    for name, valid in (("wiki_good", b"valid text\n"), ("wiki_binary", b"valid \xff\xfe\n"), ("wiki_empty", b"")):
        folder = path(name)
        folder.mkdir()
        (folder / "wiki.train.raw").write_bytes(b" = Title = \n\n some training text here .\n")
        (folder / "wiki.valid.raw").write_bytes(valid)
        (folder / "wiki.test.raw").write_bytes(b" some test text .\n")
    path("garbage.json").write_text("this is not json")
    for name, train in (("stories_empty", b""), ("stories_binary", b"Once \xff upon a time.<|endoftext|>")):
        folder = path(name)
        folder.mkdir()
        (folder / "TinyStories-train.txt").write_bytes(train)
        (folder / "TinyStories-valid.txt").write_bytes(b"A story.<|endoftext|>")
    # study files
    base = {
        "tasks": [{"name": "2parity", "config": BOOLEAN}],
        "inits": ["default"],
        "seeds": [0],
        "metrics": [{"tag": "val/mse", "label": "MSE"}],
        "out_dir": str(root / "study"),
    }
    path("study_syntax.yaml").write_text("tasks:\n  - name: [2parity\n")
    for name, change in (
        ("study_init.yaml", {"inits": ["default", "maks"]}),
        ("study_config.yaml", {"tasks": [{"name": "t", "config": str(f["missing.yaml"])}]}),
        ("study_seeds.yaml", {"seeds": [-1]}),
        ("study_no_seeds.yaml", {"seeds": []}),
        ("study_structure_size.yaml", {"args": ["--model.structure", "{pairs: [[0, 20]]}"]}),
        ("study_rank.yaml", {"args": ["--model.parameterisation", "low_rank", "--model.prior_rank", "16"]}),
        ("study_builder.yaml", {"args": ["--model.structure", "no_such_pkg:builder"]}),
        ("study_estimator.yaml", {"args": ["--model.structure", "discover:no_such_pkg:est"]}),
        ("study_other_out.yaml", {"out_dir": str(root / "other_study")}),
    ):
        path(name).write_text(yaml.safe_dump({**base, **change}))
    (root / "other_study").mkdir()
    other = {"title": "someone else's", "study_file": "theirs.yaml"}
    (root / "other_study" / "study.json").write_text(json.dumps(other))
    return f


def _write_checkpoints(root: Path, f: dict[str, Path]) -> None:
    """A real tiny checkpoint (mask init, n 6, dim 16, depth 2) and broken ones."""
    main(["fit", "-c", BOOLEAN, "-c", MASK, *[str(root / "made") if a == "@runs" else a for a in TINY],
          "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"])  # fmt: skip
    tiny = f["tiny.ckpt"] = root / "tiny.ckpt"
    shutil.copy(sorted((root / "made").rglob("*.ckpt"))[0], tiny)
    data = tiny.read_bytes()
    (f.setdefault("empty.ckpt", root / "empty.ckpt")).write_bytes(b"")
    (f.setdefault("truncated.ckpt", root / "truncated.ckpt")).write_bytes(data[: len(data) // 2])
    (f.setdefault("garbage.ckpt", root / "garbage.ckpt")).write_bytes(bytes(reversed(data[:4096])))
    f.setdefault("ckpt_config.yaml", root / "ckpt_config.yaml").write_text(f"ckpt_path: {f['garbage.ckpt']}\n")
    torch.save(torch.ones(2), f.setdefault("tensor.ckpt", root / "tensor.ckpt"))
    torch.save({"weight": torch.ones(2)}, f.setdefault("weights.ckpt", root / "weights.ckpt"))
    torch.save({"state_dict": {}, "made": datetime.date(2024, 1, 1)}, f.setdefault("object.ckpt", root / "object.ckpt"))
    checkpoint = torch.load(tiny, map_location="cpu", weights_only=True)
    for name, change in (("version_garbage", {"pytorch-lightning_version": "garbage"}),
                         ("version_old", {"pytorch-lightning_version": "0.5.0"})):
        torch.save({**checkpoint, **change}, f.setdefault(f"{name}.ckpt", root / f"{name}.ckpt"))
    for name, key in (("version_none", "pytorch-lightning_version"), ("weights_only", "optimizer_states"),
                      ("no_loops", "loops")):
        without = {k: v for k, v in checkpoint.items() if k != key}
        torch.save(without, f.setdefault(f"{name}.ckpt", root / f"{name}.ckpt"))
    loops = copy.deepcopy(checkpoint["loops"])
    loops["fit_loop"]["epoch_progress"]["current"]["completed"] = 5
    torch.save({**checkpoint, "loops": loops}, f.setdefault("epochs5.ckpt", root / "epochs5.ckpt"))
    state = dict(checkpoint["state_dict"])
    key = next(k for k in state if k.endswith("prior_logits"))
    state[key] = state[key].clone()
    state[key].view(-1)[0] = float("nan")
    torch.save({**checkpoint, "state_dict": state}, f.setdefault("nan_prior.ckpt", root / "nan_prior.ckpt"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_inputs")
    f = _write_files(root)
    _write_checkpoints(root, f)
    return f


def _resolve(arg: str, f: dict[str, Path]) -> str:
    return re.sub(r"@([\w.\-]+)", lambda m: str(f[m.group(1)]), arg)


@pytest.mark.parametrize("call,expected,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, expected, pattern, files, tmp_path, capsys):
    f = {**files, "runs": tmp_path / "runs"}
    run = (lambda: call(f)) if callable(call) else (lambda: main([_resolve(a, f) for a in call]))
    if isinstance(expected, int) or not callable(call):
        # A command's bad input exits 2 (or the row's code) with the message on stderr, whatever raised it inside.
        with pytest.raises(SystemExit) as info:
            run()
        assert info.value.code == (expected if isinstance(expected, int) else 2)
        message = capsys.readouterr().err
        # One line: the error, not a report of every type jsonargparse tried nor a traceback.
        errors = [line for line in message.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in message, message
        message = errors[0]
    else:
        with pytest.raises(expected) as info:
            run()
        message = str(info.value)
    assert re.search(pattern, message, re.S), message
    # Never advise loading an untrusted file unsafely.
    assert "weights_only=False" not in message and "allow_pickle=True" not in message, message
    # It failed before any run directory was made (nothing for TensorBoard to show as a run).
    assert not list((tmp_path / "runs").rglob("version_*")), list((tmp_path / "runs").rglob("*"))


def test_the_table_is_large_and_ids_are_unique():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


# ------------------------------------------------------------------------------- what must still work
def test_our_own_checkpoint_loads_safely_and_fits(files):
    """maskprior's checkpoints load with weights_only=True, and one fits the model of its own config."""
    checkpoint = Checkpoint(files["tiny.ckpt"]).contents
    assert checks.checkpoint_mismatch(checkpoint, tiny_module()) is None
    assert checks.check_ckpt_path(files["tiny.ckpt"], tiny_module()).path == Path(files["tiny.ckpt"])
    assert checks.check_ckpt_path("last", None) is None  # Lightning resolves these itself


def test_weights_only_false_is_the_users_choice(files):
    """With --weights_only false nothing is unpickled by the check; a broken file still fails, naming it."""
    checks.check_ckpt_path(files["object.ckpt"], None, weights_only=False)
    with pytest.raises(CheckpointError, match="truncated.ckpt is not a readable PyTorch checkpoint"):
        checks.check_ckpt_path(files["truncated.ckpt"], None, weights_only=False)


def test_good_config_and_structure_files_pass(files, tmp_path):
    assert config_files.check_yaml_file(BOOLEAN) and config_files.check_yaml_file(MASK)
    good = tmp_path / "good.npy"
    np.save(good, np.eye(6, dtype=np.int64))
    from lightning_maskprior.priors import load_structure_file

    assert load_structure_file(good).seq_len == 6
    assert load_structure_file(files["eye.pt"]).seq_len == 6


# ------------------------------------------------------------------------------ empty run directories
def _run_dir(root: Path, scalar: bool = False, checkpoint: bool = False) -> Path:
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(str(root), name="lightning_logs")
    logger.log_hyperparams({"lr": 0.1})
    if scalar:
        logger.log_metrics({"train/loss": 1.0}, step=0)
    logger.finalize("failed")
    log_dir = Path(logger.log_dir)
    (log_dir / "config.yaml").write_text("model: {}\n")
    (log_dir / "checkpoints").mkdir()
    if checkpoint:
        (log_dir / "checkpoints" / "last.ckpt").write_bytes(b"x")
    return log_dir


def test_remove_empty_run_dir(tmp_path):
    empty = _run_dir(tmp_path / "a")
    assert RunDir(empty).remove_if_empty() and not empty.exists()
    with_scalar = _run_dir(tmp_path / "b", scalar=True)
    assert not RunDir(with_scalar).remove_if_empty() and with_scalar.is_dir()
    with_checkpoint = _run_dir(tmp_path / "c", checkpoint=True)
    assert not RunDir(with_checkpoint).remove_if_empty() and with_checkpoint.is_dir()
    assert not RunDir(tmp_path / "nowhere").remove_if_empty()


# The real console script, in a subprocess, for a representative row of each kind: the exit code, the message and no
# traceback, as a user sees them (the rows above call main() in-process).
SUBPROCESS_ROWS = ["mask scale negative", "lr zero", "target empty", "test without a checkpoint",
                   "checkpoint other dim", "init option not a number"]


@pytest.mark.parametrize("case", SUBPROCESS_ROWS)
def test_bad_input_through_the_console_script(case, files, tmp_path):
    import os
    import subprocess
    import sys

    _, call, expected, pattern = next(c for c in CASES if c[0] == case)
    f = {**files, "runs": tmp_path / "runs"}
    argv = [_resolve(a, f) for a in call]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == (expected if isinstance(expected, int) else 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert re.search(pattern, proc.stderr, re.S), proc.stderr
    assert not list((tmp_path / "runs").rglob("version_*"))


def test_a_checkpoint_without_loop_state_resumes_with_a_warning(files, tmp_path, capsys):
    """No epoch and batch progress in the checkpoint: the fit resumes, saying it cannot be exact."""
    main([_resolve(a, {**files, "runs": tmp_path / "runs"}) for a in fit_mask("--ckpt_path", "@no_loops.ckpt")])
    err = capsys.readouterr().err
    assert re.search(r"warning: checkpoint \S*no_loops.ckpt holds no loop state .*not exactly where it stopped", err)


# Errors of the machine (a file where a directory is expected, a name too long for the filesystem), through the
# console script: one line naming the path, the OS's reason and what was expected; nothing left behind.
OS_CASES = [
    ("fit root under a file", lambda f: fit("--trainer.default_root_dir", str(f["a_file"] / "runs")),
     r"a_file/runs: Not a directory \(ENOTDIR\); expected a directory, but a part of the path is a file"),
    ("fit root name too long", lambda f: fit("--trainer.default_root_dir", str(f["tmp"] / ("x" * 300))),
     r"x{300}/run.json: File name too long \(ENAMETOOLONG\); expected a shorter name"),
    ("study out_dir under a file", lambda f: ["study", "-c", str(f["study_under_file.yaml"])],
     r"a_file/study\S*: Not a directory \(ENOTDIR\)"),
    # mkdir of a path that is a file says EEXIST; the cause is a file where a directory is expected
    ("study out_dir is a file", lambda f: ["study", "-c", str(f["study_under_file.yaml"]), "--out_dir",
                                           str(f["a_file"])],
     r"a_file: Not a directory: it is a file \(ENOTDIR; the system said File exists, EEXIST\); expected a directory"),
    ("discover out under a file", lambda f: ["discover", "-c", BOOLEAN, "--data.init_args.n", "6", "--out",
                                             str(f["a_file"] / "structure.yaml")],
     r"a_file: Not a directory: it is a file \(ENOTDIR"),
]


@pytest.mark.parametrize("case", [c[1:] for c in OS_CASES], ids=[c[0] for c in OS_CASES])
def test_os_errors_are_one_line_through_the_console_script(case, files, tmp_path):
    import os
    import subprocess
    import sys

    call, pattern = case
    (tmp_path / "a_file").write_text("a file, not a directory\n")
    study_file = tmp_path / "study_under_file.yaml"
    study_file.write_text(yaml.safe_dump({"tasks": [{"name": "2parity", "config": BOOLEAN}], "inits": ["default"],
                                          "seeds": [0], "metrics": [{"tag": "val/mse", "label": "MSE"}],
                                          "out_dir": str(tmp_path / "a_file" / "study")}))
    f = {**files, "runs": tmp_path / "runs", "tmp": tmp_path, "a_file": tmp_path / "a_file",
         "study_under_file.yaml": study_file}
    before = sorted(tmp_path.iterdir())
    argv = [_resolve(a, f) for a in call(f)]
    proc = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(pattern, errors[0]), errors[0]
    assert sorted(tmp_path.iterdir()) == before  # nothing left behind


# A run directory the machine will not let TensorBoard write into (read-only; root ignores file modes, so the event
# writer's own file write is refused): TensorBoard's writer thread hits the error first.
READ_ONLY_EVENTS = """
import errno, sys
from tensorboard.compat.tensorflow_stub.io import gfile

def refused(self, filename, file_content, mode):
    raise OSError(errno.EROFS, "Read-only file system", filename)

gfile.LocalFileSystem._write = refused
from lightning_maskprior.cli import main
main(sys.argv[1:])
"""


def test_a_read_only_run_directory_is_one_line_without_the_writer_threads_traceback(tmp_path):
    import os
    import subprocess
    import sys

    argv = [_resolve(a, {"runs": tmp_path / "runs"}) for a in fit_mask()]
    proc = subprocess.run([sys.executable, "-c", READ_ONLY_EVENTS, *argv], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: \S*/runs/\S*/events\.out\.tfevents\.\S+: Read-only file system \(EROFS\); "
                        r"expected a writable filesystem \(this one is read-only\)", last), last  # a str, not b'...'


def test_a_checkpoint_one_may_not_read_is_named_as_such_not_as_truncated(files, tmp_path, monkeypatch, capsys):
    """A PermissionError reading the checkpoint (root ignores file modes, so it is simulated) is the machine's: one
    line naming the path and EACCES, never "truncated" or "not a zip archive"."""
    import builtins
    import errno

    from lightning_maskprior.run import rundir

    def refused(path, *args, **kwargs):
        if str(path).endswith("tiny.ckpt"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(rundir, "open", refused, raising=False)
    with pytest.raises(SystemExit) as info:
        main([_resolve(a, {**files, "runs": tmp_path / "runs"}) for a in fit_mask("--ckpt_path", "@tiny.ckpt")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert re.search(r"error: \S*tiny.ckpt: Permission denied \(EACCES\); expected permission to read", err), err
    assert "truncated" not in err and "zip" not in err


def test_a_study_dry_run_names_an_out_dir_it_could_not_write(files, tmp_path, monkeypatch, capsys):
    """A read-only or foreign out_dir (root ignores file modes, so the refusal is simulated): the dry run says so,
    as the study would fail at its first run."""
    import os

    from lightning_maskprior.study import cli as study_cli

    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump({"tasks": [{"name": "2parity", "config": BOOLEAN}], "inits": ["default"],
                                          "seeds": [0], "metrics": [{"tag": "val/mse", "label": "MSE"}],
                                          "out_dir": str(tmp_path / "locked" / "study")}))
    (tmp_path / "locked").mkdir()
    access = os.access
    monkeypatch.setattr(study_cli.os, "access",
                        lambda path, mode, **kw: Path(path) != tmp_path / "locked" and access(path, mode, **kw))
    with pytest.raises(SystemExit) as info:
        main(["study", "-c", str(study_file), "--dry_run", "true"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"out_dir {tmp_path}/locked/study: {tmp_path}/locked is not writable" in err, err
    assert os.listdir(tmp_path / "locked") == []


def test_an_os_error_without_a_path_is_named_with_the_path_being_written():
    """A full disk found when a file is closed (TensorBoard's event writer) says no path; the one line names the path
    the failing frame was writing, not only "No space left on device"."""
    import errno

    from lightning_maskprior.run.errors import describe_os_error

    def write(filename: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        write("runs/x/events.out.tfevents.1")
    assert describe_os_error(info.value) == ("runs/x/events.out.tfevents.1: No space left on device (ENOSPC); "
                                             "expected free space on its disk")

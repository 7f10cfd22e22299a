"""Language modelling: data layouts, tokenizers, block packing, the relative-distance prior, causal masking."""

from __future__ import annotations

import functools

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from conftest import CONFIGS
from lightning_maskprior import priors
from lightning_maskprior.attention import attention_layers
from lightning_maskprior.cli import main
from lightning_maskprior.datamodules.language import (
    END_OF_TEXT,
    IGNORE_INDEX,
    PydocDataModule,
    TinyStoriesDataModule,
    WikiText2DataModule,
    bpe_from_vocab_merges,
    load_tokenizer,
    pack_blocks,
    train_bpe,
)
from lightning_maskprior.inits import INIT_METHODS, apply_init
from lightning_maskprior.models import GPT
from lightning_maskprior.module import MaskPriorModule
from lightning_maskprior.objectives import LanguageModelObjective
from lightning_maskprior.run.tensorboard import read_scalars
from lightning_maskprior.task import TaskSpec

WORDS = "the cat sat on a mat while seven quick brown foxes jumped over lazy dogs and sang".split()


def _text(seed: int, lines: int) -> str:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(lines):
        if i % 7 == 0:
            out.append(f" = Heading {i} = \n")
        elif i % 3 == 0:
            out.append("\n")
        else:
            words = torch.randint(len(WORDS), (12,), generator=g).tolist()
            out.append(" " + " ".join(WORDS[w] for w in words) + " .\n")
    return "".join(out)


SPLIT_TEXT = {"train": _text(0, 120), "validation": _text(1, 30), "test": _text(2, 30)}


def _write_raw(folder):
    folder.mkdir(parents=True)
    for split, name in (("train", "train"), ("validation", "valid"), ("test", "test")):
        (folder / f"wiki.{name}.raw").write_text(SPLIT_TEXT[split], encoding="utf-8")


def _write_parquet(folder, rows_per_split):
    folder.mkdir(parents=True)
    for split, rows in rows_per_split.items():
        pq.write_table(pa.table({"text": rows}), folder / f"{split}-00000-of-00001.parquet")


# ------------------------------------------------------------------------------ layouts
def test_wikitext_raw_and_parquet_layouts_give_the_same_tokens(tmp_path):
    _write_raw(tmp_path / "raw" / "wikitext-2-raw")
    # HF's rows are the file's lines, each ending in "\n".
    _write_parquet(tmp_path / "pq" / "wikitext-2-raw-v1",
                   {s: t.splitlines(keepends=True) for s, t in SPLIT_TEXT.items()})
    kwargs = dict(block_size=8, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    raw = WikiText2DataModule(data_dir=str(tmp_path / "raw"), **kwargs)
    parquet = WikiText2DataModule(data_dir=str(tmp_path / "pq"), **kwargs)
    raw.setup(), parquet.setup()
    for split, text in SPLIT_TEXT.items():
        assert raw.decode(raw.ids[split]) == text  # byte-level BPE: the text comes back exactly
        assert torch.equal(raw.ids[split], parquet.ids[split])
    spec = raw.task_spec()
    assert spec.seq_len == 8 and spec.vocab_size == raw.tokenizer.get_vocab_size() <= 300


def test_missing_wikitext_files_say_what_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="wiki.train.raw"):
        WikiText2DataModule(data_dir=str(tmp_path), cache_dir=str(tmp_path / "c")).setup()


def _stories(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [f"Once upon a time story {seed}-{i}: " + " ".join(WORDS[w] for w in torch.randint(16, (9,), generator=g))
            + ".\nThe end." for i in range(n)]


@pytest.mark.parametrize("layout", ["txt", "parquet"])
def test_tinystories_first_stories_split_90_10(tmp_path, layout):
    train, valid = _stories(0, 40), _stories(1, 12)
    folder = tmp_path / "TinyStories"
    if layout == "txt":
        folder.mkdir()
        for name, stories in (("train", train), ("valid", valid)):
            (folder / f"TinyStories-{name}.txt").write_text(f"\n{END_OF_TEXT}\n".join(stories) + "\n",
                                                            encoding="utf-8")
    else:
        _write_parquet(folder / "data", {"train": train, "validation": valid})
    dm = TinyStoriesDataModule(data_dir=str(folder), num_stories=30, num_test_stories=5, block_size=16,
                               vocab_size=320, cache_dir=str(tmp_path / "cache"))
    docs = dm.documents()
    assert docs["train"] == train[:27] and docs["validation"] == train[27:30] and docs["test"] == valid[:5]
    dm.setup()
    eot = dm.tokenizer.token_to_id(END_OF_TEXT)
    assert int((dm.ids["train"] == eot).sum()) == 27  # one separator after each story
    assert dm.decode(dm.ids["validation"]).split(END_OF_TEXT)[:-1] == train[27:30]


# ------------------------------------------------------------------------------ tokenizers
def test_tokenizer_training_is_deterministic_and_cached(tmp_path):
    a, b = train_bpe([SPLIT_TEXT["train"]], 300), train_bpe([SPLIT_TEXT["train"]], 300)
    assert a.to_str() == b.to_str()  # every DDP rank trains or loads the same tokenizer
    assert a.token_to_id(END_OF_TEXT) == 0
    _write_raw(tmp_path / "raw")
    dm = WikiText2DataModule(data_dir=str(tmp_path / "raw"), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    dm.setup()
    cached = list((tmp_path / "cache").glob("bpe-300-*.json"))
    assert len(cached) == 1 and len(list((tmp_path / "cache").glob("ids-wikitext2-*.pt"))) == 3
    again = WikiText2DataModule(data_dir=str(tmp_path / "raw"), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    again.setup()
    assert all(torch.equal(dm.ids[s], again.ids[s]) for s in dm.ids)


def test_tokenizer_loads_from_json_and_from_vocab_merges(tmp_path):
    trained = train_bpe([SPLIT_TEXT["train"]], 300)
    trained.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "gpt2").mkdir()
    trained.model.save(str(tmp_path / "gpt2"))  # vocab.json + merges.txt, GPT-2's file layout
    text = SPLIT_TEXT["test"]
    expected = trained.encode(text).ids
    assert load_tokenizer(tmp_path / "tokenizer.json").encode(text).ids == expected
    assert load_tokenizer(tmp_path).encode(text).ids == expected
    from_files = bpe_from_vocab_merges(tmp_path / "gpt2/vocab.json", tmp_path / "gpt2/merges.txt")
    assert from_files.encode(text).ids == expected
    _write_raw(tmp_path / "raw")
    dm = WikiText2DataModule(data_dir=str(tmp_path / "raw"), tokenizer=str(tmp_path / "gpt2"),
                             cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert dm.ids["test"].tolist() == expected
    with pytest.raises(ValueError, match="download"):
        WikiText2DataModule(data_dir=str(tmp_path / "raw"), tokenizer="gpt2", cache_dir=str(tmp_path / "c")).setup()


# ------------------------------------------------------------------------------ packing
@pytest.mark.parametrize("length", [2, 64, 65, 1000])
def test_block_packing_predicts_every_token_once(length):
    ids = torch.randint(1000, (length,))
    inputs, targets = pack_blocks(ids, 64)
    assert inputs.shape == targets.shape and inputs.shape[1] == 64
    valid = targets != IGNORE_INDEX
    assert torch.equal(targets[valid], ids[1:])  # no token lost, none duplicated, in order
    assert torch.equal(inputs[valid], ids[:-1])  # each target's input is the token before it
    assert len(inputs) == -(-(length - 1) // 64)  # only the last block is padded
    assert valid[:-1].all() and (valid[-1].long().diff() <= 0).all()  # padding only at the end


# ------------------------------------------------------------------------------ the prior
def _task(n=8, vocab=40):
    return TaskSpec("lm", n, vocab, vocab, LanguageModelObjective(), priors.causal_relative_distance(n),
                    init_defaults={m: {"scale": 10.0} for m in ("mask", "fixed")})


def test_relative_distance_prior_values():
    s = priors.causal_relative_distance(5)
    i, j = torch.meshgrid(torch.arange(5), torch.arange(5), indexing="ij")
    assert torch.equal(s.open[0, 0], j <= i)
    assert torch.equal(s.layer_values(0)[0], -(i - j).clamp(min=0).float())
    assert s.graded and not priors.diagonal(5).graded


@pytest.mark.parametrize("init,trainable", [("mask", True), ("fixed", False)])
def test_mask_init_installs_the_language_prior(init, trainable):
    backbone = functools.partial(GPT, dim=16, depth=2, num_heads=2)
    module = MaskPriorModule(backbone=backbone, init=init, task=_task())  # options from the task: scale 10
    for layer in attention_layers(module):
        m = layer.prior_logits[0]
        assert layer.prior_scale == 10.0 and layer.prior_logits.requires_grad == trainable
        assert torch.equal(m, priors.causal_relative_distance(8).layer_values(0)[0])
        bias = layer.prior_bias()[0].detach()
        assert bias[3, 3].item() == pytest.approx(F.logsigmoid(torch.tensor(0.0)).item())  # diagonal
        assert bias[3, 1].item() == pytest.approx(F.logsigmoid(torch.tensor(-20.0)).item())  # distance 2
    default = MaskPriorModule(backbone=backbone, init="default", task=_task())
    assert all(layer.prior_logits is None for layer in attention_layers(default))


# ------------------------------------------------------------------------------ causality
INITS = ["default", "mask", "zero"] + (["mimetic"] if "mimetic" in INIT_METHODS else [])


@pytest.mark.parametrize("init", INITS)
def test_changing_a_future_token_never_changes_an_earlier_prediction(init):
    torch.manual_seed(0)
    task = _task(n=12, vocab=30)
    model = GPT(task, dim=24, depth=2, num_heads=3, dropout=0.0)
    apply_init(init, model, task.structure, **task.init_defaults.get(init, {}))
    if init in ("mask", "zero"):  # a trained prior is not the init's: perturb it, causality must still hold
        for layer in model.modules():
            if getattr(layer, "prior_logits", None) is not None:
                layer.prior_logits.data += torch.randn_like(layer.prior_logits)
    model.eval()
    tokens = torch.randint(30, (4, 12))
    logits = model(tokens)
    for t in (0, 5, 11):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 30
        new = model(changed)
        assert torch.equal(new[:, :t], logits[:, :t]), f"position < {t} changed"
        assert not torch.allclose(new[:, t], logits[:, t])


def test_gpt_rejects_sequences_longer_than_the_block():
    with pytest.raises(ValueError, match="block size 12"):
        GPT(_task(n=12), dim=8, depth=1, num_heads=2)(torch.zeros(1, 13, dtype=torch.long))


# ------------------------------------------------------------------------------ end to end
def test_tiny_pydoc_fit_logs_perplexity_and_saves_the_tokenizer(tmp_path, capsys):
    main(["fit", "-c", str(CONFIGS / "language/pydoc.yaml"), "-c", str(CONFIGS / "init/mask.yaml"),
          "--data.init_args.block_size", "16", "--data.init_args.vocab_size", "300",
          "--data.init_args.batch_size", "8", "--data.init_args.cache_dir", str(tmp_path / "cache"),
          "--model.backbone.init_args.dim", "16", "--model.backbone.init_args.depth", "1",
          "--model.backbone.init_args.num_heads", "2",
          "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
          "--trainer.default_root_dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert "val/ppl " in out and "val/loss " in out
    run = next((tmp_path / "runs").glob("*/version_*"))
    assert (run / "tokenizer.json").is_file()
    scalars = read_scalars(run)
    assert len(scalars["val/ppl"]) == 2 and scalars["val/ppl"][-1][1] < 300  # below uniform over the vocabulary


def test_pydoc_split_is_disjoint_and_fixed(tmp_path):
    a = PydocDataModule(cache_dir=str(tmp_path)).documents()
    b = PydocDataModule(cache_dir=str(tmp_path), seed=7).documents()
    assert a == b
    sizes = {s: sum(map(len, d)) for s, d in a.items()}
    assert min(sizes["validation"], sizes["test"]) >= 0.1 * sum(sizes.values())
    assert not set(a["train"]) & (set(a["validation"]) | set(a["test"]))


@pytest.mark.parametrize("config", ["pydoc.yaml", "paper/wikitext2.yaml", "paper/tinystories.yaml"])
def test_language_configs_set_every_argument_shared_with_the_default_backbone(config):
    # jsonargparse keeps the default backbone's (TokenTransformer's) init_args when the class_path changes:
    # a GPT config that leaves out head_dim or qkv_bias silently gets TokenTransformer's values.
    import inspect

    import yaml

    from lightning_maskprior.models import TokenTransformer

    given = yaml.safe_load((CONFIGS / "language" / config).read_text())["model"]["backbone"]["init_args"]
    ours = inspect.signature(GPT).parameters
    theirs = inspect.signature(TokenTransformer).parameters
    shared = [k for k in ours if k in theirs and k != "task" and ours[k].default != theirs[k].default]
    assert not [k for k in shared if k not in given]

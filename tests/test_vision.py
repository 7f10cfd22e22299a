"""Vision: timm ViT with PriorAttention, impulse structure per head, image datamodules on fixture files."""

from __future__ import annotations

import io
import json
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import CONFIGS
from lightning_maskprior.attention import attention_layers
from lightning_maskprior.datamodules import CIFARDataModule, DigitsDataModule, ImageNet100DataModule
from lightning_maskprior.datamodules.vision import DatasetFilesError
from lightning_maskprior.inits import INIT_METHODS, apply_init
from lightning_maskprior.models import VisionTransformer
from lightning_maskprior.models.vit import map_structure_heads
from lightning_maskprior.priors import IMPULSE_OFFSETS

TINY_VIT = {"embed_dim": 24, "depth": 2, "num_heads": 3}
SMALL = {"img_size": 16, "patch_size": 4, "batch_size": 4, "eval_batch_size": 8}  # a 4x4 patch grid


def tiny_task(**kwargs):
    return DigitsDataModule(**{**SMALL, **kwargs}).task_spec()


def tiny_vit(task, **kwargs):
    return VisionTransformer(task, "vit_tiny_patch16_224", {**TINY_VIT, **kwargs.pop("model_kwargs", {})}, **kwargs)


# ------------------------------------------------------------------------------- fixtures on disk
def write_cifar(root, num_classes: int, per_file: int = 4) -> None:
    rng = np.random.default_rng(0)
    if num_classes == 10:
        folder, files, key = root / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], \
            "labels"
    else:
        folder, files, key = root / "cifar-100-python", ["train", "test"], "fine_labels"
    folder.mkdir(parents=True)
    for name in files:
        entry = {"data": rng.integers(0, 256, (per_file, 3 * 32 * 32), dtype=np.uint8),
                 key: rng.integers(0, num_classes, per_file).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)


def png_bytes(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_image_folder(root) -> None:
    for split in ("train", "val"):
        for c, name in enumerate(("n01", "n02")):
            (root / split / name).mkdir(parents=True)
            for i in range(2):
                (root / split / name / f"img{i}.png").write_bytes(png_bytes(10 * c + i))


def write_parquet(root) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "data").mkdir(parents=True)
    for split, n in (("train", 6), ("validation", 4)):
        table = pa.table({"image": [{"bytes": png_bytes(i), "path": f"{i}.png"} for i in range(n)],
                          "label": [i % 3 for i in range(n)]})
        pq.write_table(table, root / "data" / f"{split}-00000-of-00001.parquet")


# ------------------------------------------------------------------------------------ the model
def test_vit_uses_prior_attention_with_timm_blocks():
    task = tiny_task()
    model = tiny_vit(task)
    layers = attention_layers(model)
    assert len(layers) == 2 and all(layer.num_heads == 3 for layer in layers)
    assert model.patch_grid() == (4, 4) and model.num_prefix_tokens == 1
    out = model(torch.randn(2, 1, 16, 16))
    assert out.shape == (2, 10)
    assert model.positional_embedding().shape == (17, 24)
    assert len(model.attention_norms()) == 2


def test_vit_rejects_geometry_in_model_kwargs():
    with pytest.raises(ValueError, match="come from the datamodule"):
        tiny_vit(tiny_task(), model_kwargs={"img_size": 64})


@pytest.mark.parametrize("init", sorted(INIT_METHODS))
def test_forward_backward_every_init(init):
    torch.manual_seed(0)
    task = tiny_task()
    model = tiny_vit(task)
    structure = model.structure_for_sequence(task.structure)
    options = {**task.init_defaults.get(init, {}), **({"steps": 5} if init == "qk_opt" else {})}
    apply_init(init, model, structure, **options)
    images = torch.randn(4, 1, 16, 16)
    loss = task.objective.loss(model(images), {"target": torch.tensor([0, 1, 2, 3])})
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if init == "mask":
        assert all(layer.prior_logits.grad is not None for layer in attention_layers(model))


def neighbour(patch: int, offset: tuple[int, int], side: int) -> int:
    r, c = divmod(patch, side)
    r2, c2 = r + offset[0], c + offset[1]
    return r2 * side + c2 if 0 <= r2 < side and 0 <= c2 < side else patch


@pytest.mark.parametrize("mode", ["cycle", "split"])
def test_mask_structure_per_head(mode):
    """Each head's open entries in each patch row are exactly that head's 3x3 neighbours (CLS handled)."""
    task = tiny_task()
    model = tiny_vit(task, structure_heads=mode)
    apply_init("mask", model, model.structure_for_sequence(task.structure), open_value=10.0, closed_value=-10.0)
    side, heads = 4, 3
    if mode == "cycle":  # head h: offset h mod 9 (centre, up, right)
        head_offsets = [[IMPULSE_OFFSETS[h]] for h in range(heads)]
    else:  # head h: offsets h, h + 3, h + 6
        head_offsets = [IMPULSE_OFFSETS[h::heads] for h in range(heads)]
    for layer in attention_layers(model):
        prior = layer.prior_logits.detach()
        assert prior.shape == (heads, 1 + side * side, 1 + side * side)
        assert (prior[:, 0, :] == 10).all(), "the CLS token attends to every token"
        assert (prior[:, 1:, 0] == -10).all(), "patches do not attend to the CLS token"
        for h in range(heads):
            for p in range(side * side):
                open_patches = set((prior[h, 1 + p, 1:] == 10).nonzero().flatten().tolist())
                assert open_patches == {neighbour(p, o, side) for o in head_offsets[h]}, (h, p)
    assert mode == "split" or sorted(IMPULSE_OFFSETS[:3]) == sorted(o[0] for o in head_offsets)


def test_avg_pool_vit_has_no_prefix_tokens():
    task = tiny_task()
    model = tiny_vit(task, model_kwargs={"global_pool": "avg", "class_token": False})
    structure = model.structure_for_sequence(task.structure)
    assert model.num_prefix_tokens == 0 and structure.seq_len == 16
    assert model.positional_embedding().shape == (16, 24)


def test_map_structure_heads_keeps_matching_counts():
    task = tiny_task()
    three = map_structure_heads(task.structure, 3, "cycle")
    assert three.num_heads == 3 and map_structure_heads(three, 3, "split") is three
    assert torch.equal(map_structure_heads(task.structure, 12, "cycle").open[:, 9], task.structure.open[:, 0])


# ------------------------------------------------------------------------------------ datamodules
@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_reads_torchvision_layout(tmp_path, num_classes):
    write_cifar(tmp_path, num_classes)
    dm = CIFARDataModule(root=str(tmp_path), num_classes=num_classes, img_size=32, patch_size=8, batch_size=4,
                         eval_batch_size=8)
    dm.setup("fit")
    train_size = 20 if num_classes == 10 else 4
    assert len(dm.train_set) == train_size and len(dm.eval_set) == 4
    task = dm.task_spec()
    assert task.num_outputs == num_classes and task.seq_len == 16 and task.structure.num_heads == 9
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (4, 3, 32, 32) and batch["target"].dtype == torch.long
    # Training batches are mixed (Mixup/CutMix): soft, smoothed targets that sum to one.
    dm.trainer = SimpleNamespace(training=True)
    mixed = dm.on_after_batch_transfer(batch, 0)
    assert mixed["target"].shape == (4, num_classes)
    assert torch.allclose(mixed["target"].sum(-1), torch.ones(4))
    assert torch.isfinite(task.objective.loss(torch.randn(4, num_classes), mixed))
    dm.trainer = SimpleNamespace(training=False)
    assert dm.on_after_batch_transfer(batch, 0)["target"].dtype == torch.long


def test_cifar_missing_and_corrupt_files(tmp_path):
    dm = CIFARDataModule(root=str(tmp_path / "nowhere"), img_size=32, patch_size=8, batch_size=4)
    with pytest.raises(DatasetFilesError, match="nowhere.*download true"):
        dm.setup("fit")
    write_cifar(tmp_path, 10)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    dm = CIFARDataModule(root=str(tmp_path), img_size=32, patch_size=8, batch_size=4)
    with pytest.raises(DatasetFilesError, match="data_batch_3 is corrupt"):
        dm.setup("fit")
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DatasetFilesError, match="test_batch is missing.*cs.toronto.edu"):
        dm.setup("validate")


@pytest.mark.parametrize("layout", ["image_folder", "parquet"])
def test_imagenet100_local_layouts(tmp_path, layout):
    if layout == "image_folder":
        write_image_folder(tmp_path)
        num_classes, sizes = 2, (4, 4)
    else:
        write_parquet(tmp_path)
        num_classes, sizes = 3, (6, 4)
    dm = ImageNet100DataModule(root=str(tmp_path), num_classes=num_classes, img_size=32, patch_size=16,
                               batch_size=2, eval_batch_size=4)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.eval_set)) == sizes
    batch = next(iter(dm.val_dataloader()))
    assert batch["inputs"].shape == (4, 3, 32, 32)
    assert dm.task_spec().seq_len == 4


_MEMORY_PROBE = """
import json, pickle, sys, threading, time
from itertools import islice

import datasets, pyarrow.dataset, timm.data  # noqa: F401 - imported before the baseline, as the datamodule does
from lightning_maskprior.datamodules import ImageNet100DataModule

def status(*fields):  # bytes, from /proc/self/status (kB)
    with open("/proc/self/status") as f:
        found = dict(line.split(":", 1) for line in f)
    return [int(found[field].split()[0]) * 1024 for field in fields]

# Peak RSS is VmHWM: getrusage's ru_maxrss would not do, it keeps the high-water mark of the pytest process
# this one was forked from; writing 5 to clear_refs resets this process's own. RSS also counts the pages of
# the memory-mapped Arrow file that this process touched: page cache, shared by all processes that map the
# file (and mapped up to 2 MB at a time where the kernel caches files in large folios). The private memory
# (RssAnon) is what each DDP rank adds on its own: a thread samples its peak.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base_rss, base_file, base_anon = status("VmRSS", "RssFile", "RssAnon")
peak_anon = base_anon

def sample():
    global peak_anon
    while True:
        peak_anon = max(peak_anon, status("RssAnon")[0])
        time.sleep(0.002)

threading.Thread(target=sample, daemon=True).start()
# auto_augment=None: timm's RandAugment posterize can ask Pillow 13 for 0 bits (ValueError), not our subject here.
dm = ImageNet100DataModule(root=sys.argv[1], num_classes=4, img_size=32, patch_size=16, batch_size=16,
                           eval_batch_size=16, auto_augment=None)
# What every DDP rank does once local rank 0 has made the Arrow copy (prepare_data): open it, read
# batches, pickle the dataset (as for DataLoader workers).
dm.setup("fit")
shapes = [list(b["inputs"].shape) for b in islice(dm.train_dataloader(), 6)]
shapes += [list(b["inputs"].shape) for b in islice(dm.val_dataloader(), 2)]
clone = pickle.loads(pickle.dumps(dm.train_set))
rss, file, anon = status("VmHWM", "RssFile", "RssAnon")
print(json.dumps(dict(
    peak_rss=rss - base_rss, file=file - base_file, peak_private=max(peak_anon, anon) - base_anon, shapes=shapes,
    sizes=[len(dm.train_set), len(dm.eval_set)], pickled=len(pickle.dumps(dm.train_set)),
    same=bool(clone[3]["target"] == dm.train_set[3]["target"]),
    cache=[f["filename"] for f in dm.train_set.images.items.dataset.cache_files])))
"""


def test_imagenet100_parquet_is_memory_mapped(tmp_path):
    """Parquet images stay in a memory-mapped Arrow file, not in each process: reading batches grows a
    process's private memory by far less than the images' size (the former reader, which kept every
    encoded image in a list, grew it by more than the images' size), and the dataset pickles small."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    padding = np.random.default_rng(1).bytes(256 * 1024)  # incompressible: parquet cannot shrink it
    (tmp_path / "data").mkdir()
    for split, n in (("train", 256), ("validation", 64)):
        images = [{"bytes": png_bytes(i) + padding[i:] + padding[:i], "path": f"{i}.png"} for i in range(n)]
        pq.write_table(pa.table({"image": images, "label": [i % 4 for i in range(n)]}),
                       tmp_path / "data" / f"{split}-00000-of-00001.parquet", row_group_size=32)
    size = sum(f.stat().st_size for f in (tmp_path / "data").iterdir())
    assert size > 80 * 2**20
    dm = ImageNet100DataModule(root=str(tmp_path), num_classes=4, img_size=32, patch_size=16)
    dm.prepare_data()  # what local rank 0 does: the parquet -> Arrow copy, into tmp_path / "arrow_cache"
    copies = sorted(map(str, tmp_path.glob("arrow_cache/**/*.arrow")))
    assert len(copies) == 2
    # A fresh interpreter, offline, with Hugging Face's default cache (~/.cache/huggingface) moved to where
    # we can watch it.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "OMP_NUM_THREADS": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    opened = json.loads(out.stdout.strip().splitlines()[-1])
    assert opened["sizes"] == [256, 64] and opened["same"]
    assert opened["shapes"] == [[16, 3, 32, 32]] * 8
    memory = {k: f"{v / 2**20:.0f} MiB" for k, v in opened.items() if k in ("peak_rss", "file", "peak_private")}
    assert opened["peak_private"] < 0.3 * size, f"{memory} for {size / 2**20:.0f} MiB of images"
    assert opened["pickled"] < 100_000
    # setup opened the copy prepare_data made next to the data; nothing went to Hugging Face's default cache.
    assert opened["cache"][0] in copies and sorted(map(str, tmp_path.glob("arrow_cache/**/*.arrow"))) == copies
    assert not (tmp_path / "hf_home").exists()


def test_imagenet100_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DatasetFilesError, match="missing_root does not exist.*ImageFolder.*parquet"):
        ImageNet100DataModule(root=str(tmp_path / "missing_root"), img_size=32, patch_size=16,
                              batch_size=2).setup("fit")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train-00000-of-00001.parquet").write_bytes(b"garbage")
    with pytest.raises(DatasetFilesError, match="cannot read parquet file .*train-00000"):
        ImageNet100DataModule(root=str(tmp_path), img_size=32, patch_size=16, batch_size=2).setup("fit")
    write_image_folder(tmp_path / "folder")
    (tmp_path / "folder" / "val" / "n01" / "img0.png").write_bytes(b"truncated")
    dm = ImageNet100DataModule(root=str(tmp_path / "folder"), num_classes=2, img_size=32, patch_size=16,
                               batch_size=2)
    dm.setup("validate")
    with pytest.raises(DatasetFilesError, match="cannot decode .*img0.png"):
        dm.eval_set[0]


def test_digits_split_and_subset():
    dm = DigitsDataModule(max_train_size=50, **{k: v for k, v in SMALL.items() if k != "batch_size"})
    dm.setup("fit")
    assert len(dm.train_set) == 50 and len(dm.eval_set) == 797
    item = dm.eval_set[0]
    assert item["inputs"].shape == (1, 16, 16)
    assert dm.task_spec().extras["in_chans"] == 1


def test_digits_cli_fit(tmp_path):
    from lightning_maskprior.cli import main

    main(["fit", "-c", str(CONFIGS / "vision" / "digits.yaml"), "-c", str(CONFIGS / "init" / "mask.yaml"),
          "--data.init_args.max_train_size", "16", "--data.init_args.test_size", "16",
          "--data.init_args.img_size", "16", "--data.init_args.batch_size", "8",
          "--model.backbone.init_args.model_kwargs", '{"embed_dim": 24, "depth": 1, "num_heads": 3}',
          "--trainer.max_epochs", "1", "--trainer.check_val_every_n_epoch", "1",
          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
          "--trainer.default_root_dir", str(tmp_path)])
    from lightning_maskprior.run.tensorboard import read_scalars

    scalars = read_scalars(next(tmp_path.rglob("version_0")))
    assert {"val/top1", "val/top5", "val/loss", "persistence/score"} <= set(scalars)


def test_randaugment_zero_bit_posterize_is_black_as_before_pillow_13(tmp_path):
    """The paper's ``rand-m9-mstd0.5-inc1``: when the m9 +- 0.5 magnitude noise reaches 10, timm's
    PosterizeIncreasing keeps ``4 - int(10 / 10 * 4) = 0`` bits. Pillow < 13 turned that into a black image;
    Pillow 13 raises ValueError, which killed training at a random batch. The datamodule keeps the old result."""
    from PIL import ImageOps
    from timm.data.auto_augment import RandAugment

    dm = CIFARDataModule(root=str(tmp_path), img_size=32, patch_size=8, batch_size=4)
    assert dm.auto_augment == "rand-m9-mstd0.5-inc1"
    transform = dm.transform(train=True)
    (rand_augment,) = [t for t in transform.transforms if isinstance(t, RandAugment)]
    (op,) = [op for op in rand_augment.ops if op.name == "PosterizeIncreasing"]
    op.prob, op.magnitude_std = 1.0, 0.0  # apply it, at exactly the magnitude asked for
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))

    op.magnitude = 10  # what the mstd noise clips to: 0 bits
    assert op.level_fn(op.magnitude, op.hparams) == (0,)
    assert not np.asarray(op(image)).any()
    op.magnitude = 9  # 1 bit: Pillow's own posterize, unchanged
    assert np.array_equal(np.asarray(op(image)), np.asarray(ImageOps.posterize(image, 1)))

    # The whole training transform survives it (RandAugment reduced to this op at magnitude 10).
    op.magnitude, rand_augment.ops, rand_augment.num_layers = 10, [op], 1
    assert transform(image).shape == (3, 32, 32)

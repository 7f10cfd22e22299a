"""Vision: timm ViT with PriorAttention, impulse structure per head, image datamodules on fixture files."""

from __future__ import annotations

import io
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
    from lightning_maskprior.tensorboard import read_scalars

    scalars = read_scalars(next(tmp_path.rglob("version_0")))
    assert {"val/top1", "val/top5", "val/loss", "persistence/score"} <= set(scalars)

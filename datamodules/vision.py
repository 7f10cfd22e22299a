"""Image classification: CIFAR-10/100, ImageNet-100 and scikit-learn's digits, with the paper's recipe.

Images go through timm's transforms (RandAugment, colour jitter, random erasing) and, in training,
timm's Mixup/CutMix with label smoothing (soft targets). The task's structure is the 3x3 impulse on
the patch grid, one pattern per offset; the ViT backbone maps the patterns to its heads.
Nothing is downloaded unless ``download`` is set: data is read from local files.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from lightning_maskprior import priors
from lightning_maskprior.data import eval_loader, train_loader
from lightning_maskprior.objectives import ClassificationObjective
from lightning_maskprior.task import TaskSpec

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DatasetFilesError(FileNotFoundError):
    """Dataset files are missing or unreadable; the message says where and how to get them."""


class ImageDataset(Dataset):
    """(image, label) pairs as dict rows ``{"inputs": transformed image, "target": label}``.

    Args:
        images: Any sequence whose items are PIL images (or a callable index -> PIL image).
        labels: Integer class of each image.
        transform: Applied to each PIL image (timm transform).
    """

    def __init__(self, images: Sequence[Any], labels: Sequence[int], transform: Any) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.transform = images, list(labels), transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"inputs": self.transform(self.images[index]), "target": torch.tensor(self.labels[index])}


class _ArrayImages:
    """A uint8 array (N, H, W, C) or (N, H, W) viewed as a sequence of PIL images."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: int) -> Image.Image:
        return Image.fromarray(self.array[index])


class _EncodedImages:
    """A list of encoded image files (bytes, or paths) decoded to RGB PIL images on access."""

    def __init__(self, items: Sequence[bytes | str | Path]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Image.Image:
        item = self.items[index]
        source = io.BytesIO(item) if isinstance(item, bytes) else item
        try:
            with Image.open(source) as image:
                return image.convert("RGB")
        except Exception as err:  # noqa: BLE001 - any decoder error: say which image
            where = item if not isinstance(item, bytes) else f"image {index} (bytes)"
            raise DatasetFilesError(f"cannot decode {where}: {err}") from err


class _ArrowBytes:
    """One column of encoded images in a memory-mapped ``datasets.Dataset``, as ``bytes`` per item.

    Only the item asked for is copied out of the Arrow file; the file's pages live in the page cache,
    which every process mapping it (DDP ranks, DataLoader workers) shares. Pickling sends the dataset,
    which pickles as its file path (a few KB), never the data; the column is looked up again after.
    """

    def __init__(self, dataset: Any, column: str = "image") -> None:
        self.dataset, self.column = dataset, column
        self._values = None  # the pyarrow column: zero-copy views into the mapping, not picklable cheaply

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_values": None}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> bytes:
        if self._values is None:
            self._values = self.dataset.data.table.column(self.column)
        item = self._values[index].as_py()  # {"bytes", "path"} (Hugging Face Image) or raw bytes
        return item["bytes"] if isinstance(item, dict) else item


def _posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's ``posterize`` op, with Pillow < 13's result for ``bits_to_keep == 0``: an all-black image.

    timm's ``PosterizeIncreasing`` (RandAugment ``inc1``) keeps ``4 - int(magnitude / 10 * 4)`` bits, i.e. 0 bits
    at magnitude 10, which ``mstd0.5`` noise around m9 reaches (then clips to) about 2% of the time. Pillow < 13
    built the mask ``~(2 ** (8 - 0) - 1) = -256`` for that and so mapped every value to 0; Pillow 13 raises
    ``ValueError: bits must be between or equal to 1 and 8`` instead. Other bit counts go to Pillow unchanged.
    """
    if bits_to_keep >= 8:
        return img
    if bits_to_keep < 1 and img.mode in ("L", "RGB"):
        return img.point([0] * 256 * len(img.getbands()))
    from PIL import ImageOps

    return ImageOps.posterize(img, bits_to_keep)


def _keep_zero_bit_posterize(transform: Any) -> Any:
    """Swap timm's posterize for :func:`_posterize` in the auto-augment ops of a timm transform (in place)."""
    from timm.data import auto_augment

    for t in getattr(transform, "transforms", [transform]):
        ops = list(getattr(t, "ops", None) or []) + [op for sub in getattr(t, "policy", None) or [] for op in sub]
        for op in ops:
            if isinstance(op, auto_augment.AugmentOp) and op.aug_fn is auto_augment.posterize:
                op.aug_fn = _posterize
    return transform


class ImageClassificationDataModule(L.LightningDataModule):
    """Shared recipe for image classification; subclasses only read their images.

    Args:
        img_size: Side of the (square) image the model sees.
        patch_size: ViT patch side; the structure is a grid of (img_size / patch_size)^2 patches.
        batch_size: Training batch size per device (paper: 512 in all).
        eval_batch_size: Batch size for validation and test.
        max_train_size: Train on a seeded random subset of this many images (default: all).
        augment: Use the training transforms below; False: only resize/crop and normalise.
        auto_augment: timm auto-augment string (paper: RandAugment m9, ``rand-m9-mstd0.5-inc1``), or None.
        color_jitter: timm colour jitter strength (reference code: 0.4 small datasets, 0.3 ImageNet).
        re_prob: Random-erasing probability (reference code: 0.25).
        hflip: Horizontal flip probability (0 for digits).
        scale: RandomResizedCrop scale range.
        crop_pct: Centre-crop fraction for evaluation (reference code: 0.875).
        mixup: Mixup alpha (paper: 0.8; 0 disables).
        cutmix: CutMix alpha (paper: 1.0; 0 disables).
        label_smoothing: Label smoothing (paper: 0.1), in the mixed soft targets or the loss.
        mean: Normalisation mean per channel (default: the dataset's own default).
        std: Normalisation std per channel.
        seed: Seed for the training subset and shuffling.
        num_workers: DataLoader worker processes.
    """

    dataset_name = "images"
    num_classes = 0
    in_chans = 3
    default_mean: tuple[float, ...] = IMAGENET_MEAN
    default_std: tuple[float, ...] = IMAGENET_STD

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        batch_size: int = 512,
        eval_batch_size: int = 512,
        max_train_size: int | None = None,
        augment: bool = True,
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        color_jitter: float = 0.4,
        re_prob: float = 0.25,
        hflip: float = 0.5,
        scale: tuple[float, float] = (0.08, 1.0),
        crop_pct: float = 0.875,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        label_smoothing: float = 0.1,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size={img_size} is not a multiple of patch_size={patch_size}")
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError(f"batch sizes must be positive, got {batch_size} and {eval_batch_size}")
        if max_train_size is not None and (isinstance(max_train_size, bool) or max_train_size < 1):
            raise ValueError(f"max_train_size must be a positive number of images, or null for all of them, "
                             f"got {max_train_size}")
        if (mixup > 0 or cutmix > 0) and batch_size % 2:
            raise ValueError(f"mixup/cutmix mixes pairs within a batch: batch_size must be even, got {batch_size}")
        self.img_size, self.patch_size = img_size, patch_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.max_train_size, self.seed, self.num_workers = max_train_size, seed, num_workers
        self.augment, self.auto_augment, self.color_jitter = augment, auto_augment, color_jitter
        self.re_prob, self.hflip, self.scale, self.crop_pct = re_prob, hflip, tuple(scale), crop_pct
        self.mixup, self.cutmix, self.label_smoothing = mixup, cutmix, label_smoothing
        self.mean = tuple(mean) if mean is not None else self.default_mean
        self.std = tuple(std) if std is not None else self.default_std
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(f"mean/std need {self.in_chans} values, got {self.mean} and {self.std}")
        self.train_set: Dataset | None = None
        self.eval_set: Dataset | None = None
        self.mixup_fn = None

    # ------------------------------------------------------------------ what subclasses provide
    def load_split(self, train: bool) -> tuple[Sequence[Any], Sequence[int]]:
        """Images (PIL-yielding sequence) and labels of the training or evaluation split."""
        raise NotImplementedError

    def resolve_num_classes(self) -> int:
        return self.num_classes

    # ------------------------------------------------------------------ the task, for the model
    @property
    def grid_size(self) -> int:
        return self.img_size // self.patch_size

    def task_spec(self) -> TaskSpec:
        side, num_classes = self.grid_size, self.resolve_num_classes()
        return TaskSpec(
            name=f"vision/{self.dataset_name}",
            seq_len=side * side,
            vocab_size=0,
            num_outputs=num_classes,
            objective=ClassificationObjective(num_classes, self.label_smoothing),
            # One pattern per 3x3 offset (centre, up, right, left, down, up-left, ...); the backbone
            # decides which head takes which (VisionTransformer.structure_heads).
            structure=priors.grid_impulse(side, side, name=f"3x3 impulse on {side}x{side} patches"),
            # arXiv 2608.00418: vision masks open = +10, closed = -10.
            init_defaults={m: {"open_value": 10.0, "closed_value": -10.0} for m in ("mask", "fixed", "mask_impulse")},
            extras={"img_size": self.img_size, "patch_size": self.patch_size, "in_chans": self.in_chans,
                    "num_classes": num_classes, "grid_size": (side, side)},
        )

    # ------------------------------------------------------------------------------ the data
    def transform(self, train: bool):
        from timm.data import create_transform

        common = dict(input_size=(self.in_chans, self.img_size, self.img_size), mean=self.mean, std=self.std,
                      interpolation="bicubic", crop_pct=self.crop_pct)
        if not (train and self.augment):
            return create_transform(is_training=False, **common)
        # Pillow 13 rejects the 0-bit posterize that timm's RandAugment (rand-...-inc1) sometimes asks for.
        return _keep_zero_bit_posterize(create_transform(
            is_training=True, scale=self.scale, hflip=self.hflip, color_jitter=self.color_jitter or None,
            auto_augment=self.auto_augment, re_prob=self.re_prob, **common,
        ))

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None and stage in (None, "fit"):
            images, labels = self.load_split(train=True)
            index = np.arange(len(labels))
            if self.max_train_size is not None and self.max_train_size < len(index):
                rng = np.random.default_rng(self.seed)
                index = np.sort(rng.permutation(len(index))[: self.max_train_size])
                images, labels = _Subset(images, index), [labels[i] for i in index]
            self.train_set = ImageDataset(images, labels, self.transform(train=True))
        if self.eval_set is None:
            self.eval_set = ImageDataset(*self.load_split(train=False), self.transform(train=False))
        if self.mixup_fn is None and (self.mixup > 0 or self.cutmix > 0):
            from timm.data import Mixup

            self.mixup_fn = Mixup(mixup_alpha=self.mixup, cutmix_alpha=self.cutmix,
                                  label_smoothing=self.label_smoothing, num_classes=self.resolve_num_classes())

    def on_after_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        """In training, mix pairs of images (Mixup/CutMix): targets become smoothed soft labels (B, classes)."""
        trainer = getattr(self, "trainer", None)
        if self.mixup_fn is not None and trainer is not None and trainer.training:
            inputs, target = self.mixup_fn(batch["inputs"], batch["target"])
            batch = {**batch, "inputs": inputs, "target": target}
        return batch

    def train_dataloader(self):
        # Mixup pairs images within a batch: drop a ragged last batch so every batch is even.
        return train_loader(self.train_set, self.batch_size, self.seed, self.num_workers,
                            drop_last=self.mixup_fn is not None)

    def val_dataloader(self):
        return eval_loader(self.eval_set, self.eval_batch_size, self.num_workers)

    def test_dataloader(self):
        return eval_loader(self.eval_set, self.eval_batch_size, self.num_workers)

    def predict_dataloader(self):
        """The evaluation set: ``maskprior predict``."""
        return self.test_dataloader()


class _Subset:
    def __init__(self, items: Sequence[Any], index: np.ndarray) -> None:
        self.items, self.index = items, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        return self.items[int(self.index[i])]


# ----------------------------------------------------------------------------------- CIFAR
_CIFAR = {
    10: dict(folder="cifar-10-batches-py", train=[f"data_batch_{i}" for i in range(1, 6)], test=["test_batch"],
             label="labels", torchvision="CIFAR10"),
    100: dict(folder="cifar-100-python", train=["train"], test=["test"], label="fine_labels",
              torchvision="CIFAR100"),
}


def read_cifar_batches(folder: Path, files: Sequence[str], label_key: str, how_to_get: str) -> tuple[np.ndarray,
                                                                                                      list[int]]:
    """Read torchvision's on-disk CIFAR pickles: images (N, 32, 32, 3) uint8 and labels."""
    images, labels = [], []
    for name in files:
        path = folder / name
        if not path.is_file():
            raise DatasetFilesError(f"CIFAR file {path} is missing. {how_to_get}")
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
            data = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            batch_labels = [int(y) for y in entry[label_key]]
        except Exception as err:  # noqa: BLE001 - truncated pickle, wrong keys, wrong size
            raise DatasetFilesError(f"CIFAR file {path} is corrupt or not in CIFAR format ({err!r}). "
                                    f"{how_to_get}") from err
        if len(batch_labels) != len(data):
            raise DatasetFilesError(f"CIFAR file {path} has {len(data)} images but {len(batch_labels)} labels. "
                                    f"{how_to_get}")
        images.append(data.transpose(0, 2, 3, 1))
        labels += batch_labels
    return np.concatenate(images), labels


class CIFARDataModule(ImageClassificationDataModule):
    """CIFAR-10 or CIFAR-100 from ``root`` in torchvision's layout (``root/cifar-10-batches-py/...``).

    Validation and test both use the official test set (as the reference training script does).
    The paper's recipe: 224 px ViT-Tiny/16, batch 512, 400 epochs (see configs/vision/paper/).

    Args:
        root: Folder that holds ``cifar-10-batches-py/`` or ``cifar-100-python/``.
        num_classes: 10 or 100.
        download: Let torchvision download the archive into ``root`` if it is missing.
        **recipe: See ImageClassificationDataModule.
    """

    default_mean, default_std = IMAGENET_MEAN, IMAGENET_STD  # the reference script normalises with these

    def __init__(self, root: str = "data", num_classes: int = 10, download: bool = False, **recipe: Any) -> None:
        if num_classes not in _CIFAR:
            raise ValueError(f"CIFAR has 10 or 100 classes, got num_classes={num_classes}")
        self.num_classes = num_classes
        self.dataset_name = f"cifar{num_classes}"
        super().__init__(**recipe)
        self.root, self.download = Path(root), download

    def prepare_data(self) -> None:
        spec = _CIFAR[self.num_classes]
        if self.download and not (self.root / spec["folder"]).is_dir():
            import torchvision

            getattr(torchvision.datasets, spec["torchvision"])(str(self.root), train=True, download=True)

    def load_split(self, train: bool):
        spec = _CIFAR[self.num_classes]
        folder = self.root / spec["folder"]
        how = (f"Expected torchvision's CIFAR-{self.num_classes} layout in {folder}: get it with "
               f"--data.init_args.download true (needs internet), or unpack cifar-{self.num_classes}-python.tar.gz "
               f"from https://www.cs.toronto.edu/~kriz/cifar.html into {self.root}.")
        if not folder.is_dir():
            raise DatasetFilesError(f"CIFAR-{self.num_classes} folder {folder} does not exist. {how}")
        images, labels = read_cifar_batches(folder, spec["train" if train else "test"], spec["label"], how)
        bad = [y for y in set(labels) if not 0 <= y < self.num_classes]
        if bad:
            raise DatasetFilesError(f"CIFAR-{self.num_classes} labels {sorted(bad)[:5]} in {folder} are out of "
                                    f"range 0..{self.num_classes - 1}. {how}")
        return _ArrayImages(images), labels


# ----------------------------------------------------------------------------------- ImageNet-100
_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
_SPLIT_NAMES = {True: ("train",), False: ("val", "validation", "test")}


class ImageNet100DataModule(ImageClassificationDataModule):
    """ImageNet-100 (or any ImageFolder / parquet image set) from local files.

    Two layouts under ``root``:

    - ImageFolder: ``root/train/<class>/*.JPEG`` and ``root/val/<class>/*.JPEG`` (classes sorted by name).
    - Hugging Face parquet: ``root/**/train-*.parquet`` and ``root/**/validation-*.parquet`` (or ``val``,
      ``test``) with an ``image`` column (``{"bytes": ...}`` or raw bytes) and an integer ``label`` column.

    Validation and test both use the validation split. Parquet splits are copied once into an Arrow
    cache (``cache_dir``, as large as the parquet files: ~7 GB for ImageNet-100) with Hugging Face
    ``datasets``, then memory-mapped: each process holds only the labels and the images it decodes,
    and all processes on a machine share the mapped file's page cache. A parquet file changed later
    (new modification time) gets a fresh copy; delete ``cache_dir`` to reclaim old copies.

    Args:
        root: The dataset folder.
        num_classes: Number of classes (ImageNet-100: 100); checked against the labels found.
        cache_dir: Where the Arrow copy of parquet splits goes (default: ``root/arrow_cache``; set it
            when ``root`` is read-only). Nothing is written under ``~/.cache`` and nothing is downloaded.
        **recipe: See ImageClassificationDataModule (paper: 224 px, average pooling, 300 epochs).
    """

    dataset_name = "imagenet100"

    def __init__(self, root: str = "data/imagenet100", num_classes: int = 100, cache_dir: str | None = None,
                 **recipe: Any) -> None:
        self.num_classes = num_classes
        super().__init__(**recipe)
        self.root = Path(root)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else self.root / "arrow_cache"

    def _how_to_get(self) -> str:
        return (f"Expected {self.root}/train/<class>/<image> and {self.root}/val/<class>/<image> (ImageFolder), "
                f"or parquet files {self.root}/**/train-*.parquet and validation-*.parquet with 'image' and "
                "'label' columns (e.g. a Hugging Face ImageNet-100 dataset fetched with `huggingface-cli "
                f"download <dataset> --repo-type dataset --local-dir {self.root}`).")

    def prepare_data(self) -> None:
        # Parquet splits are copied to Arrow here, not in setup: Lightning calls prepare_data once per
        # node (local rank 0) before any rank's setup, so under DDP one process writes the copy and
        # setup on every rank only memory-maps the finished file. datasets also holds a file lock
        # (<cache_dir>/..._builder.lock) while it writes, so setup without prepare_data (scripts,
        # tests) or several nodes sharing one cache_dir wait for the writer instead of racing it.
        for train in (True, False):
            folder = any((self.root / name).is_dir() and not list((self.root / name).glob("*.parquet"))
                         for name in _SPLIT_NAMES[train])
            if self.root.is_dir() and not folder:
                self._parquet(train)

    def load_split(self, train: bool):
        if not self.root.is_dir():
            raise DatasetFilesError(f"dataset folder {self.root} does not exist. {self._how_to_get()}")
        for name in _SPLIT_NAMES[train]:
            if (self.root / name).is_dir() and not list((self.root / name).glob("*.parquet")):
                images, labels = self._image_folder(self.root / name)
                break
        else:
            images, labels = self._parquet(train)
        bad = sorted({y for y in labels if not 0 <= y < self.num_classes})
        if bad:
            raise DatasetFilesError(f"labels {bad[:5]} in {self.root} are outside 0..{self.num_classes - 1} "
                                    f"(num_classes={self.num_classes}). {self._how_to_get()}")
        return images, labels

    def _image_folder(self, folder: Path):
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if getattr(self, "_classes", classes) != classes:
            raise DatasetFilesError(f"{folder} has different class folders from the training split")
        self._classes = classes
        paths, labels = [], []
        for label, name in enumerate(classes):
            files = sorted(p for p in (folder / name).iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
            paths += files
            labels += [label] * len(files)
        if not paths:
            raise DatasetFilesError(f"no images found in class folders under {folder}. {self._how_to_get()}")
        return _EncodedImages(paths), labels

    def _parquet(self, train: bool):
        """The split's parquet files as a memory-mapped Arrow dataset: images decoded per item, numpy labels."""
        import datasets
        import pyarrow.dataset
        import pyarrow.parquet as pq

        files = sorted(p for p in self.root.rglob("*.parquet")
                       if any(p.name.startswith(s) or p.parent.name == s for s in _SPLIT_NAMES[train]))
        split = "train" if train else "val"
        if not files:
            raise DatasetFilesError(f"no {split} images found under {self.root}. {self._how_to_get()}")
        for path in files:  # footers only: name a bad file here, before datasets' less specific errors
            try:
                missing = {"image", "label"} - set(pq.read_schema(path).names)
            except Exception as err:  # noqa: BLE001 - not parquet
                raise DatasetFilesError(f"cannot read parquet file {path} ({err}). {self._how_to_get()}") from err
            if missing:
                raise DatasetFilesError(f"cannot read parquet file {path} (no column {sorted(missing)}). "
                                        f"{self._how_to_get()}")
        # The first call copies the two columns into <cache_dir>/parquet/default-<hash of the files' paths
        # and modification times>/.../parquet-<split>.arrow; later calls (and other processes) find it
        # there and only map it. No network: the packaged parquet builder reads local files only.
        # pre_buffer=False: by default Arrow prefetches a whole parquet file before its first batch, so
        # the copy would briefly hold each file in memory (measured: +1.3 GB for a 1 GB file; +0.15 GB so).
        try:
            dataset = datasets.Dataset.from_parquet(
                [str(p.resolve()) for p in files], split="train" if train else "validation",
                cache_dir=str(self.cache_dir), columns=["image", "label"], keep_in_memory=False,
                fragment_scan_options=pyarrow.dataset.ParquetFragmentScanOptions(pre_buffer=False))
        except Exception as err:  # noqa: BLE001 - unreadable row groups, cache_dir not writable, disk full
            raise DatasetFilesError(f"cannot copy the {split} parquet files under {self.root} to Arrow in "
                                    f"{self.cache_dir} ({err}); cache_dir must be a writable folder. "
                                    f"{self._how_to_get()}") from err
        labels = dataset.data.table.column("label").to_numpy()
        return _EncodedImages(_ArrowBytes(dataset)), labels


# ----------------------------------------------------------------------------------- digits
class DigitsDataModule(ImageClassificationDataModule):
    """scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels; shipped with the package), upscaled.

    An offline, CPU-scale image task: a seeded ``test_size`` images are held out (validation = test),
    and the model trains on ``max_train_size`` of the rest. Grey-scale, one channel, no flips.

    The other arguments are ImageClassificationDataModule's (defaults here: 32 px, 4 px patches, light crop
    augmentation, no flips, RandAugment, mixup or label smoothing).

    Args:
        test_size: Held-out images (the rest, 1797 - test_size, is the training pool).
    """

    dataset_name = "digits"
    num_classes = 10
    in_chans = 1
    default_mean, default_std = (0.5,), (0.5,)

    def __init__(
        self,
        test_size: int = 797,
        img_size: int = 32,
        patch_size: int = 4,
        batch_size: int = 64,
        eval_batch_size: int = 400,
        max_train_size: int | None = None,
        augment: bool = True,
        auto_augment: str | None = None,
        color_jitter: float = 0.0,
        re_prob: float = 0.0,
        hflip: float = 0.0,
        scale: tuple[float, float] = (0.7, 1.0),
        crop_pct: float = 1.0,
        mixup: float = 0.0,
        cutmix: float = 0.0,
        label_smoothing: float = 0.0,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            img_size=img_size, patch_size=patch_size, batch_size=batch_size, eval_batch_size=eval_batch_size,
            max_train_size=max_train_size, augment=augment, auto_augment=auto_augment, color_jitter=color_jitter,
            re_prob=re_prob, hflip=hflip, scale=scale, crop_pct=crop_pct, mixup=mixup, cutmix=cutmix,
            label_smoothing=label_smoothing, mean=mean, std=std, seed=seed, num_workers=num_workers,
        )
        self.test_size = test_size

    def load_split(self, train: bool):
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:
            raise DatasetFilesError("the digits task reads scikit-learn's bundled digits: pip install scikit-learn")\
                from err
        digits = load_digits()
        if not 0 < self.test_size < len(digits.target):
            raise ValueError(f"test_size must be in 1..{len(digits.target) - 1}, got {self.test_size}")
        order = np.random.default_rng(1234).permutation(len(digits.target))  # fixed split, whatever the seed
        index = order[self.test_size:] if train else order[: self.test_size]
        pixels = (digits.images[index] * (255 / 16)).round().astype(np.uint8)
        return _ArrayImages(pixels), [int(y) for y in digits.target[index]]

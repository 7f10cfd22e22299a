"""The image-classification recipe shared by every vision benchmark: timm's transforms and Mixup/CutMix, the
impulse structure on the patch grid, and the image containers the datasets use.

Images go through timm's transforms (RandAugment, colour jitter, random erasing) and, in training, timm's
Mixup/CutMix with label smoothing (soft targets). The task's structure is the 3x3 impulse on the patch grid, one
pattern per offset; the ViT backbone maps the patterns to its heads.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from lightning_maskprior import priors
from lightning_maskprior.datamodules.base import MaskPriorDataModule
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


class ArrayImages:
    """A uint8 array (N, H, W, C) or (N, H, W) viewed as a sequence of PIL images."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: int) -> Image.Image:
        return Image.fromarray(self.array[index])


class EncodedImages:
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


class ArrowBytes:
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


class ImageClassificationDataModule(MaskPriorDataModule):
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

    def dataset(self, split: str) -> Dataset:
        """The augmented training images; the evaluation images for val, test and predict."""
        return self.train_set if split == "train" else self.eval_set

    def train_loader_options(self) -> dict[str, Any]:
        # Mixup pairs images within a batch: drop a ragged last batch so every batch is even.
        return {"drop_last": self.mixup_fn is not None}


class _Subset:
    def __init__(self, items: Sequence[Any], index: np.ndarray) -> None:
        self.items, self.index = items, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        return self.items[int(self.index[i])]


# ----------------------------------------------------------------------------------- CIFAR

"""CIFAR-10 / CIFAR-100 from the python-version archives on disk (downloaded only with ``download``)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_maskprior.datamodules.vision.recipe import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ArrayImages,
    DatasetFilesError,
    ImageClassificationDataModule,
)

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
        return ArrayImages(images), labels


# ----------------------------------------------------------------------------------- ImageNet-100

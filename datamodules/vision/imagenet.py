"""ImageNet-100 from class folders on disk (or a Hugging Face dataset saved to disk)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_maskprior.datamodules.vision.recipe import (
    ArrowBytes,
    DatasetFilesError,
    EncodedImages,
    ImageClassificationDataModule,
)

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
        return EncodedImages(paths), labels

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
        return EncodedImages(ArrowBytes(dataset)), labels


# ----------------------------------------------------------------------------------- digits

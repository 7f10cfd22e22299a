"""scikit-learn's 8x8 digits, upscaled: the offline stand-in for the paper's vision runs."""

from __future__ import annotations

import numpy as np

from lightning_maskprior.datamodules.vision.recipe import ArrayImages, DatasetFilesError, ImageClassificationDataModule


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
        return ArrayImages(pixels), [int(y) for y in digits.target[index]]

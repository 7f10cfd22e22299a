"""Image classification: CIFAR-10/100, ImageNet-100 and scikit-learn's digits, with the paper's recipe
(``recipe.py``). Nothing is downloaded unless ``download`` is set: data is read from local files."""

from lightning_maskprior.datamodules.vision.cifar import CIFARDataModule, read_cifar_batches
from lightning_maskprior.datamodules.vision.digits import DigitsDataModule
from lightning_maskprior.datamodules.vision.imagenet import ImageNet100DataModule
from lightning_maskprior.datamodules.vision.recipe import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DatasetFilesError,
    ImageClassificationDataModule,
    ImageDataset,
)

__all__ = ["CIFARDataModule", "DatasetFilesError", "DigitsDataModule", "IMAGENET_MEAN", "IMAGENET_STD",
           "ImageClassificationDataModule", "ImageDataset", "ImageNet100DataModule", "read_cifar_batches"]

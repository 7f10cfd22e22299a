"""LightningDataModules, one per benchmark (installed as ``lightning_maskprior.datamodules``)."""

from lightning_maskprior.datamodules.arithmetic import ArithmeticDataModule
from lightning_maskprior.datamodules.boolean import BooleanGOTUDataModule
from lightning_maskprior.datamodules.language import (
    LanguageModelDataModule,
    PydocDataModule,
    TinyStoriesDataModule,
    WikiText2DataModule,
)
from lightning_maskprior.datamodules.vision import (
    CIFARDataModule,
    DigitsDataModule,
    ImageClassificationDataModule,
    ImageNet100DataModule,
)

__all__ = [
    "ArithmeticDataModule",
    "BooleanGOTUDataModule",
    "CIFARDataModule",
    "DigitsDataModule",
    "ImageClassificationDataModule",
    "ImageNet100DataModule",
    "LanguageModelDataModule",
    "PydocDataModule",
    "TinyStoriesDataModule",
    "WikiText2DataModule",
]

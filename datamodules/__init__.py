"""LightningDataModules, one per benchmark (installed as ``lightning_maskprior.datamodules``), all subclasses of
:class:`~lightning_maskprior.datamodules.base.MaskPriorDataModule`."""

from lightning_maskprior.datamodules.arithmetic import ArithmeticDataModule
from lightning_maskprior.datamodules.base import MaskPriorDataModule
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
    "MaskPriorDataModule",
    "PydocDataModule",
    "TinyStoriesDataModule",
    "WikiText2DataModule",
]

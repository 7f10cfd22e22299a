"""LightningDataModules, one per benchmark (installed as ``lightning_maskprior.datamodules``)."""

from lightning_maskprior.datamodules.arithmetic import ArithmeticDataModule
from lightning_maskprior.datamodules.boolean import BooleanGOTUDataModule
from lightning_maskprior.datamodules.language import (
    LanguageModelDataModule,
    PydocDataModule,
    TinyStoriesDataModule,
    WikiText2DataModule,
)

__all__ = [
    "ArithmeticDataModule",
    "BooleanGOTUDataModule",
    "LanguageModelDataModule",
    "PydocDataModule",
    "TinyStoriesDataModule",
    "WikiText2DataModule",
]

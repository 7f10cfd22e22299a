"""LightningDataModules, one per benchmark (installed as ``lightning_maskprior.datamodules``)."""

from lightning_maskprior.datamodules.arithmetic import ArithmeticDataModule
from lightning_maskprior.datamodules.boolean import BooleanGOTUDataModule

__all__ = ["ArithmeticDataModule", "BooleanGOTUDataModule"]

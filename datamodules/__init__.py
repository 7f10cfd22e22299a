"""LightningDataModules, one per benchmark (installed as ``lightning_maskprior.datamodules``)."""

from lightning_maskprior.datamodules.boolean import BooleanGOTUDataModule

__all__ = ["BooleanGOTUDataModule"]

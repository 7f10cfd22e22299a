"""Lightning callbacks that measure the prior (installed as ``lightning_maskprior.callbacks``)."""

__all__: list[str] = []

"""``python -m lightning_maskprior``: the ``maskprior`` command."""

from lightning_maskprior.cli import main

main()

"""Reopen a finished run and look inside it: python examples/analyse_run.py RUN_DIR

RUN_DIR is a fit's run directory (``runs/2parity-mask-seed0/version_0``) or a study run's. Prints the validation
metrics (the same as the run logged), the attention probabilities of layer 0 on a batch, the prior sigmoid(M)
where the init has one, and for a Boolean task the predictions on the unseen slice.
"""

from __future__ import annotations

import sys

import lightning as L
import torch

from lightning_maskprior import attention_layers, attention_probabilities, load_run, run_precision


def main(run_dir: str) -> dict[str, float]:
    module, datamodule = load_run(run_dir)
    # In the run's precision (bf16-mixed for the CPU configs), so the metrics are the ones it logged.
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        precision=run_precision(run_dir))
    metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    print("validation:", {k: round(v, 6) for k, v in sorted(metrics.items())})

    batch = next(iter(datamodule.val_dataloader()))
    probs = attention_probabilities(module, batch["inputs"][:8])
    print(f"layer 0 attention (batch, heads, queries, keys) {tuple(probs[0].shape)}; head 0 of example 0:")
    print(probs[0][0, 0].numpy().round(2))

    layer = attention_layers(module)[0]
    prior = layer.prior_matrix()  # M whatever holds it (full, relative, low_rank)
    if prior is not None:
        print(f"prior sigmoid(M) of layer 0, head 0 (init {module.init_method}):")
        print(torch.sigmoid(prior.detach()).reshape(-1, *prior.shape[-2:])[0].numpy().round(2))

    if "unseen" in batch:  # Boolean: the slice the model never saw in training
        with torch.no_grad():
            rows = module.predict_step(batch, 0)
        unseen = rows["unseen"]
        print(f"unseen slice: {int(unseen.sum())} of {len(unseen)} points in this batch")
        for name in ("prediction", "label", "target", "mdi"):
            print(f"  {name:<10}", rows[name][unseen][:8].tolist())
    return metrics


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

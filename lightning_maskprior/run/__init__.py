"""The run plumbing under the method: the LightningCLI and its checks, the run directory, precision, the allocator,
atomic writes, exit codes and TensorBoard readers. Nothing in here defines the method; ``lightning_maskprior``'s
top level does (attention, priors, inits, models, module, objectives)."""

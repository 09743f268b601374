"""From config to the libraries: each module maps config sections onto one library's typed arguments
(model, parallelism, data, optimizers, schedule, checkpointer, validation)."""

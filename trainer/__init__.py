"""The training program run under torchrun (model, parallelism, precision, loop, checkpoints).

No Dagster imports here: assets launch it as its own processes through a launcher resource.
"""

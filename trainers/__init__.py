"""Training programs built on `jaxlm`: the ``jaxlm`` command line (and, next, the trainer
loop, losses and algorithms)."""

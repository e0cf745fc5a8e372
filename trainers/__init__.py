"""Training programs built on `jaxlm`: one run harness (`trainers.loop.train`) for every
algorithm registered in `trainers.algorithm.ALGORITHMS` (SFT in `trainers.sft`, GRPO and its
variants in `trainers.rl`), typed configs (`trainers.config`) loaded from recipes with
overrides (`trainers.recipes`), and the ``jaxlm`` command line (`trainers.cli`)."""

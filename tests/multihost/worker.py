"""One process of the multi-host check (`tests/test_multihost.py` starts it).

``worker.py ROOT``: the runs of `experiments` through the run harness `trainers.loop.train`,
SFT then GRPO (from ``ROOT/init``).

- Without ``JAX_COORDINATOR_ADDRESS``: the reference, one process with 8 CPU devices, each
  run straight through, in ``ROOT/reference/{sft,grpo}``.
- With ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``: one process
  of a ``trainer.multihost=true`` run with 4 CPU devices per process, in
  ``ROOT/multihost/{sft,grpo}``. Each run stops after ``FIRST`` of its ``STEPS`` steps (its
  checkpoint at that step left behind) and is run again, resuming from that checkpoint.

Each process writes what the test checks to ``<run>/worker.p<process>.json`` (its PID, the
steps its hooks saw, the lock files they saw, the results) and GRPO's prepared rows of every
iteration to ``<run>/rows/<iteration>.p<process>.npz``.
"""

import os
import sys

MULTIHOST = bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={4 if MULTIHOST else 8}")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import FIRST, grpo_config, sft_config  # noqa: E402
from jaxlm.fileio import lock_holder  # noqa: E402
from trainers.loop import train  # noqa: E402
from trainers.rl.loop import GRPOTrainer  # noqa: E402

ROW_KEYS = ("tokens", "loss_mask", "sampler_logp", "old_logp", "ref_logp", "advantages")


def record_rows():
    """Write each iteration's prepared rows (on every process) into ``<run>/rows``."""
    prepare = GRPOTrainer.prepare

    def recorded(self, state, exp):
        rows, metrics = prepare(self, state, exp)
        k = int(np.asarray(state.step.addressable_data(0))) // self.updates_per_iteration
        out = Path(self.cfg.trainer.out_dir) / "rows"
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / f"{k}.p{jax.process_index()}.npz", **{n: rows[n] for n in ROW_KEYS})
        return rows, metrics

    GRPOTrainer.prepare = recorded


def run(cfg, stops) -> dict:
    """``train(cfg)`` once per entry of ``stops`` (``trainer.stop_after``), recording what
    the hooks see."""
    out_dir = Path(cfg.trainer.out_dir)
    seen: dict = {"pid": os.getpid(), "runs": []}
    for stop_after in stops:
        steps, locks = [], set()

        def hook(end):
            steps.append(end.step)
            locks.update(i for i in range(jax.process_count()) if lock_holder(out_dir, process_index=i))

        result = train(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, stop_after=stop_after)),
                       hooks=[hook])
        seen["runs"].append({"steps": steps, "locks": sorted(locks), "step": result.step,
                             "stopped_early": result.stopped_early, "final_eval": result.final_eval})
    (out_dir / f"worker.p{jax.process_index()}.json").write_text(json.dumps(seen, indent=1))
    return seen


def main():
    root = Path(sys.argv[1])
    record_rows()
    base = root / ("multihost" if MULTIHOST else "reference")
    stops = (FIRST, None) if MULTIHOST else (None,)
    for cfg in (sft_config(base / "sft", MULTIHOST), grpo_config(base / "grpo", MULTIHOST, root / "init")):
        seen = run(cfg, stops)
        print(f"{cfg.algorithm.name}: process {jax.process_index()} of {jax.process_count()}: {seen['runs']}",
              flush=True)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()

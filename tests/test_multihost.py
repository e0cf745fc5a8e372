"""Multi-host for real: two processes with 4 CPU devices each, joined by
``jax.distributed.initialize`` (a localhost coordinator, gloo collectives), run SFT and GRPO
through `trainers.loop.train` with ``trainer.multihost=true`` (checkpoint at step 2, resumed
to step 4, final model saved) and give the runs of one process with 8 CPU devices on the same
(2, 2, 2) mesh (`tests/multihost/worker.py`, `tests/multihost/experiments.py`).

Tolerances. Both runs compile the same programs for the same mesh; what differs is how the
cross-device sums are taken (gloo's allreduce between the processes, XLA's in-process
collectives in the reference) and, for SFT, the order of the rows in each global batch
(process p holds examples p, p + 2, ...), so float32 results differ by rounding: one ulp
(~1e-7 relative) per reduction, compounded over 4 optimizer steps with lr = 1. Measured:
losses within 2e-7 relative, parameters within 2e-7 of steps of 6e-2 (SFT) and 4e-2 (GRPO),
log-probs within 5e-7. The bounds are 1e-5 relative for losses and metrics, 1e-5 for
log-probs (magnitude ~6) and 1e-4 of the largest parameter change for parameters; the
sampled tokens, rewards and advantages must be identical, and the two processes' rows
bit-identical (each process gathers the same global arrays).
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent / "multihost"
WORKER = HERE / "worker.py"
TIMEOUT = 1500  # s; about 3 minutes of CPU per process on a 2-core machine


def _experiments():
    spec = importlib.util.spec_from_file_location("multihost_experiments", HERE / "experiments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _by_step(records, kind):
    return {r["step"]: r for r in records if r["kind"] == kind}


def _params(path: Path) -> dict[str, np.ndarray]:
    import jaxlm
    from jaxlm.models.params import flat_params

    return {k: np.asarray(v) for k, v in flat_params(jaxlm.load_checkpoint(path)).items()}


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


@pytest.mark.multidevice
def test_two_processes_match_one_process(tmp_path):
    if not _gloo_available():
        # jax.distributed can join CPU processes only through gloo; a jaxlib built without it
        # cannot run this test at all
        pytest.skip("this jaxlib has no gloo CPU collectives (jax.distributed cannot join CPU processes)")
    import jaxlm

    exp = _experiments()
    jaxlm.save_checkpoint(jaxlm.build_model(exp.MODEL, seed=exp.INIT_SEED), tmp_path / "init")

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    base_env["JAX_PLATFORMS"] = "cpu"
    base_env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as the suite (tests/conftest.py)
    port = _free_port()
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("reference", "p0", "p1")}
    envs = {"reference": base_env}
    for i in (0, 1):
        envs[f"p{i}"] = {**base_env, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                         "JAX_PROCESS_ID": str(i)}
    start = time.perf_counter()
    procs = {name: subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], env=env, stdout=logs[name],
                                    stderr=subprocess.STDOUT, text=True) for name, env in envs.items()}
    try:
        deadline = start + TIMEOUT
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.perf_counter(), 1))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in logs.values():
            f.close()
    print(f"workers: {time.perf_counter() - start:.0f} s")
    outputs = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    for name, proc in procs.items():
        tail = "\n".join(line for line in outputs[name].splitlines() if "Gloo" not in line)[-6000:]
        assert proc.returncode == 0 and "WORKER DONE" in outputs[name], f"{name} failed:\n{tail}"

    ref, mh = tmp_path / "reference", tmp_path / "multihost"
    _check_harness(mh, exp)
    _check_sft(ref / "sft", mh / "sft")
    _check_grpo(ref / "grpo", mh / "grpo")


def _check_harness(mh: Path, exp):
    """The resume, the locks, and which process wrote the run's files."""
    for algo in ("sft", "grpo"):
        run = mh / algo
        seen = [json.loads((run / f"worker.p{i}.json").read_text()) for i in (0, 1)]
        for s in seen:
            first, resumed = s["runs"]
            assert first["stopped_early"] and first["step"] == exp.FIRST and first["steps"] == [1, 2], s
            # the second run started from the step-2 checkpoint, not from scratch
            assert not resumed["stopped_early"] and resumed["steps"] == [3, 4] and resumed["step"] == exp.STEPS, s
            assert first["locks"] == resumed["locks"] == [0, 1], s  # each process held its own lock file
        assert not list(run.glob(".jaxlm.lock*")), "a lock file outlived its run"
        assert seen[0]["runs"][1]["final_eval"] == seen[1]["runs"][1]["final_eval"]
        assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
        # process 0 alone wrote the metrics: one record per (step, kind) and its own event files
        records = _records(run)
        keys = [(r["step"], r["kind"]) for r in records]
        assert len(keys) == len(set(keys)), keys
        assert sorted(s for s, k in keys if k == "train") == [1, 2, 3, 4]
        events = list((run / "tensorboard").glob("events.out.tfevents.*"))
        assert len(events) == 2 and all(f".{seen[0]['pid']}." in e.name for e in events), events
        for name in ("model", "curves.png", "config.json"):
            assert (run / name).exists(), name


def _check_metrics(ref: Path, mh: Path, keys: tuple[str, ...], exact: tuple[str, ...] = ()):
    a, b = _records(ref), _records(mh)
    for kind in ("train", "eval"):
        ra, rb = _by_step(a, kind), _by_step(b, kind)
        assert sorted(ra) == sorted(rb), (kind, sorted(ra), sorted(rb))
        for step in ra:
            for k in keys:
                if k in ra[step]:
                    assert _close(ra[step][k], rb[step][k], 1e-5), (kind, step, k, ra[step][k], rb[step][k])
            for k in exact:
                if k in ra[step]:
                    assert ra[step][k] == rb[step][k], (kind, step, k, ra[step][k], rb[step][k])


def _check_params(ref_model: Path, mh_model: Path, start: dict[str, np.ndarray]):
    a, b = _params(ref_model), _params(mh_model)
    assert sorted(a) == sorted(b)
    moved = max(float(np.abs(a[k] - start[k]).max()) for k in a)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    print(f"    {ref_model.parent.name}: parameters moved up to {moved:.2e}, runs differ by up to {worst:.2e}")
    assert moved > 1e-3 and worst <= 1e-4 * moved, (moved, worst)


def _check_sft(ref: Path, mh: Path):
    _check_metrics(ref, mh, ("loss", "grad_norm", "lr"), exact=("tokens", "accuracy", "exact_match"))
    import jaxlm
    from jaxlm.models.params import flat_params

    exp = _experiments()
    start = {k: np.asarray(v) for k, v in flat_params(jaxlm.build_model(exp.MODEL, seed=0)).items()}
    _check_params(ref / "model", mh / "model", start)


def _check_grpo(ref: Path, mh: Path):
    _check_metrics(ref, mh, ("loss", "grad_norm", "kl", "entropy", "ratio_mean"),
                   exact=("reward", "completion_len", "policy_tokens", "accuracy"))
    worst = 0.0
    for k in range(4):
        r = np.load(ref / "rows" / f"{k}.p0.npz")
        p0, p1 = np.load(mh / "rows" / f"{k}.p0.npz"), np.load(mh / "rows" / f"{k}.p1.npz")
        for name in r.files:
            assert np.array_equal(p0[name], p1[name]), f"iteration {k}: the processes' {name} differ"
        for name in ("tokens", "loss_mask", "advantages"):
            assert np.array_equal(r[name], p0[name]), f"iteration {k}: {name} differ from one process's"
        for name in ("sampler_logp", "old_logp", "ref_logp"):
            worst = max(worst, float(np.abs(r[name] - p0[name]).max()))
        assert np.abs(r["advantages"]).max() > 0, "advantages all zero: the update would test nothing"
    print(f"    grpo: log-probs differ by up to {worst:.1e}")
    assert worst <= 1e-5, worst
    _check_params(ref / "model", mh / "model", _params(ref.parent.parent / "init"))

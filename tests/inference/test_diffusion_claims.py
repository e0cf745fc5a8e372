"""dLLM-Cache's claim in miniature: on a 6-layer masked diffusion model decoding 16-token
responses, the cache cuts the counted forward FLOPs by >= 3x at the uncached sampler's
accuracy (within 1 point). The bench runs in a subprocess (`bench_runner`)."""

import pytest

from bench_runner import run_bench
from trainers.loop import train
from trainers.recipes import load_config


@pytest.mark.slow  # trains a 6-layer diffusion LM for 2000 steps (about 6 minutes on 2 cores)
def test_dllm_cache_cuts_flops_3x_at_the_same_accuracy(tmp_path):
    out = tmp_path / "diffusion_sort8"
    train(load_config("diffusion_sort", [
        "model.n_layers=6", "data.source.length=8", "data.seq_len=48", "trainer.steps=2000",
        f"trainer.out_dir={out}", "trainer.eval_max_new_tokens=16", "trainer.eval_every=0",
        "trainer.progress=False"]))
    rows = run_bench("diffusion.py", "--model", str(out / "model"), "--sort-length", "8", "--n", "200",
                     "--gen-length", "16", "--block-length", "16", "--repeats", "1", "--dllm-cache", "16,8,0.1",
                     "--json")
    by_name = {r["method"]: r for r in rows}
    base, cached = by_name["LLaDA (1 token/step)"], by_name["dLLM-Cache K_p=16 K_r=8 rho=0.1"]
    assert base["accuracy"] > 0.8, rows  # a model that sorts: the comparison means something
    assert cached["flops_reduction"] >= 3.0, rows
    assert cached["accuracy"] >= base["accuracy"] - 0.01, rows

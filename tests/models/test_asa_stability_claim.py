"""Affine-Scaled Attention's stability claim in miniature (`bench/asa_stability.py`, the
numbers docs/architectures.md reports): at a high learning rate, softmax attention's
pretraining has many gradient-norm spikes and ends at a higher loss; affine-scaled attention
with the free bias has few and ends lower."""

import pytest

from bench_runner import run_bench


@pytest.mark.slow  # pretrains two 4-layer models for 300 steps (about 4 minutes on 2 cores)
def test_affine_scaled_attention_trains_stably_where_softmax_spikes(tmp_path):
    rows = run_bench("asa_stability.py", "--out", str(tmp_path), "--lrs", "3e-2", "--seeds", "0",
                     "--arms", "softmax,affine_free")
    got = {r["arm"]: r for r in rows}
    softmax, asa = got["softmax"], got["affine_free"]
    assert not softmax["diverged"] and not asa["diverged"], rows
    assert softmax["grad_spikes"] >= 3 * max(asa["grad_spikes"], 1), rows
    assert asa["final_loss"] < softmax["final_loss"] - 0.05, rows
    assert asa["loss_spikes"] <= softmax["loss_spikes"], rows

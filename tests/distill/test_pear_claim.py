"""PEAR's claim in miniature (`bench/pear_claim.py`, docs/benchmarks.md): SFT on a weak teacher's
off-policy samples with PEAR weights (target: the base policy) followed by GRPO ends above
plain SFT followed by the same GRPO, in greedy accuracy and in pass@1. About ten minutes."""

import pytest
from bench_runner import run_bench


@pytest.mark.slow
def test_pear_sft_then_grpo_beats_plain_sft_then_grpo(tmp_path):
    got = run_bench("pear_claim.py", "--out", str(tmp_path), "--teacher-steps", "250", "--rl-iterations", "100",
                    "--target", "fixed", "--seed", "0")
    plain, pear = got["SFT"]["after_rl"], got["PEAR token gamma=0.9 clip=1.0 target=fixed"]["after_rl"]
    assert got["teacher"]["greedy"] < got["base"]["greedy"]  # the SFT data is off-policy and worse than the student
    assert pear["greedy"] > plain["greedy"], (pear, plain)  # measured 72.2% vs 70.8%
    assert pear["pass@1"] > plain["pass@1"] + 0.02, (pear, plain)  # measured 66.7% vs 62.4%

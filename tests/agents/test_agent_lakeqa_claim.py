"""Multi-turn GRPO improves a tool-use agent over its SFT start (`bench/agent_lakeqa_claim.py`,
in a subprocess with XLA's default optimisation; the numbers docs/multimodal_agents.md
reports)."""

import pytest

from bench_runner import run_bench


@pytest.mark.slow  # SFT from scratch, then 40 GRPO iterations (about 13 minutes on 2 cores)
def test_grpo_learns_to_search_where_sft_imitated_abstaining(tmp_path):
    got = run_bench("agent_lakeqa_claim.py", "--out", str(tmp_path), "--abstain-rate", "0.6", "--sft-steps", "500",
                    "--grpo-iterations", "40", "--lr", "1e-4", "--temperature", "1.0")
    sft, grpo = got["sft"], got["grpo"]
    # SFT imitates the majority of the demonstrations: answer "unknown" without searching
    assert sft["tool_calls"] < 0.1 and sft["exact_match"] < 0.1, got
    # GRPO on exact match learns to search and to copy the found answer
    assert grpo["tool_calls"] > 0.9 and grpo["exact_match"] > sft["exact_match"] + 0.5, got
    assert got["grpo_rollout_reward"]["last"] > got["grpo_rollout_reward"]["first"], got

"""A jaxlm judge as a GRPO reward (``judge``): each rollout is scored by the judge model's
P(yes) for (prompt, completion) under the pointwise template (`jaxlm.eval.judge.judge_points`,
one batched call). The judge is any jaxlm checkpoint or HF directory,
``GRPOConfig.judge_model``, read once per directory (again if it is rewritten) and kept."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from jaxlm.checkpoint import load_model
from jaxlm.eval.judge import judge_points
from trainers.reward_model import directory_stamp
from trainers.rl.rewards import REWARDS, question_and_answer


@functools.lru_cache(maxsize=4)
def _cached_judge(path: str, stamp: tuple[int, int]):
    model = load_model(path)
    if model.tokenizer is None:
        raise ValueError(f"GRPOConfig.judge_model={path!r} has no tokenizer: the judge reads text")
    return model


@REWARDS.register("judge")
def judge_reward(prompts, completions, *, config=None, examples=None, **_) -> np.ndarray:
    """``P(yes | "Question: {prompt}\\nAnswer: {completion}\\nCorrect: ")`` from the judge; a
    PrefixRL example's prefix belongs to the answer, not the question."""
    path = getattr(config, "judge_model", None)
    if path is None:
        raise ValueError("the reward 'judge' needs GRPOConfig.judge_model=<a jaxlm checkpoint or HF directory>")
    path = str(Path(path).absolute())
    if not Path(path).is_dir():
        raise ValueError(f"GRPOConfig.judge_model={path!r} is not a directory (a jaxlm checkpoint or HF directory)")
    judge = _cached_judge(path, directory_stamp(path))
    prompts, completions = question_and_answer(prompts, completions, examples)
    return np.asarray(judge_points(judge, prompts, completions).p_yes, np.float32)

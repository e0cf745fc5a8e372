"""Every RL registry in one place, and the validation of a `GRPOConfig` against them."""

from __future__ import annotations

import math

import trainers.rl.agent  # noqa: F401  (registers the agent collector)
import trainers.rl.camel  # noqa: F401  (registers the camel collector)
import trainers.rl.ccc  # noqa: F401  (registers the CCC-GRPO rewards)
import trainers.rl.counterfactual  # noqa: F401  (registers counterfactual_bonus)
import trainers.rl.memopilot  # noqa: F401  (registers the rps_memory collector)
import trainers.reward_model  # noqa: F401  (registers the reward_model reward)
import trainers.rl.judge_reward  # noqa: F401  (registers the judge reward)
from trainers.rl.advantages import ADVANTAGES
from trainers.rl.aggregation import AGGREGATORS
from trainers.rl.buffer import BUFFER_SAMPLERS
from trainers.rl.collectors import COLLECTORS, SingleTurnCollector
from trainers.rl.kl import KL_ESTIMATORS
from trainers.rl.policy_losses import POLICY_LOSSES
from trainers.rl.prefix import PrefixRLCollector
from trainers.rl.rewards import REWARDS

__all__ = ["ADVANTAGES", "AGGREGATORS", "BUFFER_SAMPLERS", "COLLECTORS", "KL_ESTIMATORS", "POLICY_LOSSES", "REWARDS",
           "check_grpo_config"]


@COLLECTORS.register("single_turn")
def single_turn(cfg, graphdef, tokenizer, *, base_params):
    """The data source's prompts, G samples each; with ``algorithm.prefix`` set, PrefixRL's
    prefixed hard problems (method card B.1), built from the base policy ``base_params``."""
    if getattr(cfg.algorithm, "prefix", None) is not None:
        return PrefixRLCollector(cfg, graphdef, tokenizer, base_params=base_params)
    return SingleTurnCollector(cfg, graphdef, tokenizer)


def check_grpo_config(c) -> None:
    """Raise ``ValueError`` naming the field and the allowed values."""
    for field, registry in (("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES),
                            ("aggregation", AGGREGATORS), ("kl_estimator", KL_ESTIMATORS),
                            ("buffer_sampler", BUFFER_SAMPLERS), ("collector", COLLECTORS)):
        value = getattr(c, field)
        if value not in registry:
            raise ValueError(f"GRPOConfig.{field}={value!r} is invalid: must be one of {sorted(registry)}")
    for name in c.rewards:
        if name not in REWARDS:
            raise ValueError(f"GRPOConfig.rewards has {name!r}: must be one of {sorted(REWARDS)}")
    if "reward_model" in c.rewards and c.reward_model is None:
        raise ValueError("GRPOConfig.rewards has 'reward_model' but GRPOConfig.reward_model is None: set it to a "
                         "directory written by trainers.reward_model.save_reward_model")
    if "judge" in c.rewards and c.judge_model is None:
        raise ValueError("GRPOConfig.rewards has 'judge' but GRPOConfig.judge_model is None: set it to a jaxlm "
                         "checkpoint or HF directory")
    if c.reward_model_output not in ("score", "probability"):
        raise ValueError(f"GRPOConfig.reward_model_output={c.reward_model_output!r} is invalid: must be one of "
                         "('score', 'probability')")
    if len(c.rewards) != len(c.reward_weights) or not c.rewards:
        raise ValueError(
            f"GRPOConfig.rewards={c.rewards!r} and reward_weights={c.reward_weights!r} must be "
            f"non-empty and of equal length"
        )
    bad_weights = [w for w in c.reward_weights if isinstance(w, bool) or not isinstance(w, (int, float))
                   or not math.isfinite(w)]
    if bad_weights:
        raise ValueError(f"GRPOConfig.reward_weights={c.reward_weights!r} must be finite numbers")
    if not any(c.reward_weights):  # every reward logged only: every rollout would be "no opinion"
        raise ValueError(f"GRPOConfig.reward_weights={c.reward_weights!r}: at least one weight must be non-zero "
                         "(weight 0 logs a reward without training on it)")
    for name in ("cf_quality", "ccc_invalid_reward"):  # NaN would pass every comparison's negation
        v = getattr(c, name, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"GRPOConfig.{name}={v!r} is invalid: must be a finite number")
    for name in ("num_generations", "max_new_tokens", "mu", "minibatches", "logprob_chunk"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"GRPOConfig.{name}={v!r} is invalid: must be a positive int")
    if c.num_generations < 2:
        raise ValueError(f"GRPOConfig.num_generations={c.num_generations} must be >= 2 (a group baseline)")
    # finite numbers: NaN passes every "< 0"-style check below (adv_eps=-1 flipped the advantages' sign)
    for name in ("temperature", "eps_low", "eps_high", "beta", "adv_eps", "dual_clip", "tis_cap", "top_p"):
        v = getattr(c, name, 0.0)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"GRPOConfig.{name}={v!r} is invalid: must be a finite number")
    if getattr(c, "adv_eps", 0.0) < 0:
        raise ValueError(f"GRPOConfig.adv_eps={c.adv_eps!r} must be >= 0 (it is added to the group's std)")
    if c.temperature < 0:
        raise ValueError(f"GRPOConfig.temperature={c.temperature!r} must be >= 0")
    if c.top_p is not None and not 0 < c.top_p <= 1:
        raise ValueError(f"GRPOConfig.top_p={c.top_p!r} must be in (0, 1]")
    if not (0 <= c.eps_low < 1 and c.eps_high >= 0):
        raise ValueError(f"GRPOConfig.eps_low={c.eps_low!r} must be in [0, 1) and eps_high={c.eps_high!r} >= 0")
    if c.dual_clip is not None and c.dual_clip <= 1:
        raise ValueError(f"GRPOConfig.dual_clip={c.dual_clip!r} must be > 1 (or None)")
    if c.beta < 0:
        raise ValueError(f"GRPOConfig.beta={c.beta!r} must be >= 0")
    if c.tis_cap is not None and c.tis_cap <= 0:
        raise ValueError(f"GRPOConfig.tis_cap={c.tis_cap!r} must be > 0 (or None)")
    if c.turn_gamma is not None and not 0 <= c.turn_gamma <= 1:
        raise ValueError(f"GRPOConfig.turn_gamma={c.turn_gamma!r} must be in [0, 1]")
    if c.turn_gamma is not None and c.advantage != "turn_level":
        raise ValueError(f"GRPOConfig.turn_gamma={c.turn_gamma!r} is read only by advantage='turn_level', "
                         f"got advantage={c.advantage!r}")
    if getattr(c, "environment", None) is not None and c.collector != "rps_memory":
        raise ValueError(f"GRPOConfig.environment (MemoPilot's game) is read only by collector='rps_memory', "
                         f"got collector={c.collector!r}")
    if not 0 <= c.qpas_quantile < 1:
        raise ValueError(f"GRPOConfig.qpas_quantile={c.qpas_quantile!r} must be in [0, 1)")
    if not 0 <= c.qpas_alpha < float("inf"):  # alpha < 0 would prefer the smallest |A|
        raise ValueError(f"GRPOConfig.qpas_alpha={c.qpas_alpha!r} must be a finite number >= 0")
    if not 0 <= c.qpas_beta <= 1:
        raise ValueError(f"GRPOConfig.qpas_beta={c.qpas_beta!r} must be in [0, 1] (0: no importance correction)")
    if getattr(c, "prefix", None) is not None and c.collector != "single_turn":
        raise ValueError(f"GRPOConfig.prefix (PrefixRL) needs collector='single_turn', got {c.collector!r}")
    camel = getattr(c, "camel", None)
    if camel is not None and not isinstance(camel, trainers.rl.camel.CamelConfig):
        raise ValueError(f"GRPOConfig.camel must be a CamelConfig or None, got {type(camel).__name__}")
    if camel is not None and c.collector != "camel":
        raise ValueError(f"GRPOConfig.camel (CAMEL's verdict prefixes) needs collector='camel', got {c.collector!r}")
    if c.collector == "agent" and getattr(c, "agent", None) is None:
        raise ValueError("GRPOConfig.collector='agent' needs GRPOConfig.agent=AgentTaskConfig(...) (the task and budgets)")

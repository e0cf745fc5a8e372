"""Experiment configs: typed frozen dataclasses, each field validated on construction (a bad
value raises ``ValueError`` naming the field and what is allowed).

An `ExperimentConfig` is a model, data, optimizer, trainer and algorithm section plus the
tokenizer and the initial weights. Recipes (``configs/*.py``) build one; `trainers.recipes`
loads them and applies ``key=value`` overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Literal

from jaxlm.agents.tasks import AgentTaskConfig
from jaxlm.data.audiovisual import AVTaskConfig
from jaxlm.data.pipeline import DataConfig
from jaxlm.inference.diffusion.sampler import check_schedule
from jaxlm.models.config import ModelConfig
from trainers.distill.config import DistillConfig
from trainers.losses import TOKEN_WEIGHTS
from trainers.pear import PEARConfig
from trainers.schedule.config import ScheduleConfig
from trainers.rl.camel import CamelConfig
from trainers.rl.environments import RPSConfig
from trainers.rl.registries import check_grpo_config


class ConfigError(ValueError):
    """A config file or an override is invalid."""


def _positive(owner: str, **values: Any) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{owner}.{name}={v!r} is invalid: must be a positive int")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (Loshchilov & Hutter 2019) with linear warmup, then cosine decay to
    ``min_lr_ratio * lr``; global-norm clipping at ``clip_norm`` (None = off)."""

    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 100
    """Linear warmup from 0 to lr over this many steps."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warmup: cosine decay to min_lr_ratio * lr, or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    weight_decay: float = 0.01
    """Decoupled weight decay on matrices (not norms, biases or buffers)."""
    b1: float = 0.9
    """Adam's first-moment decay."""
    b2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_norm: float | None = 1.0
    """Clip the gradient to this global norm (None: no clipping)."""
    trainable: str = ""
    """Regex over parameter names (e.g. 'meta_gate' to train only MeGan's hypernetwork);
    empty = everything. Frozen parameters get no update and no optimizer state."""

    def __post_init__(self):
        if self.trainable:
            try:
                re.compile(self.trainable)
            except re.error as e:
                raise ValueError(f"OptimizerConfig.trainable={self.trainable!r} is not a valid regex: {e}") from None
        for name in ("lr", "b1", "b2", "eps", "weight_decay", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"OptimizerConfig.{name}={value!r} is invalid: must be a finite number")
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr={self.lr!r} is invalid: must be > 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"OptimizerConfig.b1={self.b1!r}, b2={self.b2!r} are invalid: each must be in [0, 1)")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.eps={self.eps!r} must be > 0 and weight_decay={self.weight_decay!r} >= 0")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps={self.warmup_steps!r} must be an int >= 0")
        if self.schedule not in ("cosine", "constant"):  # anything else read as cosine
            raise ValueError(f"OptimizerConfig.schedule={self.schedule!r} is invalid: must be 'cosine' or 'constant'")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimizerConfig.min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if self.clip_norm is not None and (isinstance(self.clip_norm, bool) or not isinstance(self.clip_norm, (int, float))
                                           or not (self.clip_norm > 0 and math.isfinite(self.clip_norm))):
            raise ValueError(f"OptimizerConfig.clip_norm={self.clip_norm!r} must be > 0 or None")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; one may be -1 (= all remaining devices)."""

    data: int = -1
    """Data-parallel replicas (rows of each batch split over them)."""
    fsdp: int = 1
    """Fully sharded data parallelism: rows split and parameters sharded over the model width."""
    tensor: int = 1
    """Tensor parallelism: heads, MLP width and vocabulary sharded."""

    def __post_init__(self):
        for name in ("data", "fsdp", "tensor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (v <= 0 and v != -1):  # True read as 1
                raise ValueError(f"trainer.mesh.{name}={v!r} is invalid: must be a positive int or -1")
        if [getattr(self, n) for n in ("data", "fsdp", "tensor")].count(-1) > 1:
            raise ValueError(f"trainer.mesh: at most one axis may be -1, got {self}")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """How a run proceeds: its length, logging, evaluation, checkpoints and devices."""

    steps: int = 1000
    """Optimizer steps (SFT) or iterations (GRPO) of the whole run."""
    grad_accum: int = 1
    """Micro-batches per step; data.batch_size must be divisible by it."""
    seed: int = 0
    """Seed of the initial weights, the training RNG and the samplers."""
    out_dir: str = "runs/default"
    """Run directory: checkpoints, the final model, metrics.jsonl, TensorBoard, curves.png."""
    log_every: int = 10
    """Log training metrics every N steps."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    eval_generate: int = 64
    """Held-out examples decoded greedily for task accuracy (0: loss only)."""
    eval_max_new_tokens: int = 16
    """Tokens generated per held-out example for task accuracy."""
    eval_attention_stats: bool = False
    """Also report attention entropy and first-token mass on the held-out batches."""
    save_every: int = 100
    """Save a checkpoint every N steps (and at the end)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept on disk."""
    async_checkpoint: bool = True
    """Write checkpoints in the background while training continues."""
    mesh: MeshConfig = MeshConfig()
    """The device mesh the state and the batches are split over."""
    multihost: bool = False
    """Call jax.distributed.initialize() first (one process per host)."""
    progress: bool = True
    """Show a progress bar."""
    stop_after: int | None = None
    """End this invocation after N steps without a final checkpoint (a preemption, for tests)."""

    @classmethod
    def quiet(cls, steps: int, out_dir: str = "runs/default", **overrides: Any) -> "TrainerConfig":
        """A run that only trains and saves its final model: no progress bar, no periodic
        logging, evaluation, generation or checkpoints (benchmarks, claim miniatures)."""
        return cls(**{"steps": steps, "out_dir": out_dir, "progress": False, "log_every": 1000, "eval_every": 0,
                      "save_every": 100_000, "eval_generate": 0, **overrides})

    def __post_init__(self):
        _positive("TrainerConfig", steps=self.steps, grad_accum=self.grad_accum,
                  log_every=self.log_every, save_every=self.save_every,
                  keep_checkpoints=self.keep_checkpoints,
                  eval_max_new_tokens=self.eval_max_new_tokens)
        for name in ("eval_every", "eval_generate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainerConfig.{name}={v!r} must be an int >= 0")
        if not isinstance(self.out_dir, str) or not self.out_dir.strip():
            raise ValueError(f"TrainerConfig.out_dir={self.out_dir!r} is invalid: name the run's directory "
                             "(an empty value would train into the current directory)")
        s = self.stop_after
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"TrainerConfig.stop_after={s!r} is invalid: must be an int >= 1 or None")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            # numpy's and grain's seeding take non-negative integers only
            raise ValueError(f"TrainerConfig.seed={self.seed!r} is invalid: must be an int >= 0")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning: next-token cross-entropy on trained tokens, each weighted
    by ``TOKEN_WEIGHTS[token_weights](batch, logits)`` (`trainers.losses`)."""

    name: Literal["sft"] = "sft"
    """The algorithm's registered name (`trainers.algorithm.ALGORITHMS`)."""
    token_weights: str = "uniform"
    """How each trained token counts in the loss (`trainers.losses.TOKEN_WEIGHTS`)."""
    beta_l1: float = 0.0
    """MeGan regulariser: adds beta_l1 * sum |beta| (per real token) to the loss."""
    sem_lambda: float = 0.0
    """Selective entropy minimisation (ReQAT): adds sem_lambda * (1/N) sum_t w_t H_t (reference 0.01; README 0.1)."""
    sem_threshold: float = 0.25
    """SEM: tau is the floor(N * sem_threshold)-th smallest token entropy (reference 0.25; README 0.75)."""
    distill: DistillConfig | None = None
    """Distil a frozen teacher in the same step (`trainers.distill`; None: off)."""
    pear: PEARConfig | None = None
    """PEAR importance weights toward the RL policy (`trainers.pear`; None: off)."""
    schedule: ScheduleConfig | None = None
    """Reorder upcoming batches with the live model (D^3 and baselines, `trainers.schedule`; None: data order)."""

    def __post_init__(self):
        for name in ("sem_lambda", "beta_l1"):  # NaN and inf pass a plain ">= 0"
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise ValueError(f"algorithm.{name}={v!r} is invalid: must be a finite number >= 0")
        if isinstance(self.sem_threshold, bool) or not isinstance(self.sem_threshold, (int, float)) \
                or not 0 < self.sem_threshold <= 1:
            raise ValueError(f"algorithm.sem_threshold={self.sem_threshold!r} is invalid: must be in (0, 1]")
        for name, kind in (("distill", DistillConfig), ("pear", PEARConfig), ("schedule", ScheduleConfig)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, kind):
                raise ValueError(f"algorithm.{name} must be a {kind.__name__} or None, got {type(v).__name__}")
        if self.distill is not None or self.pear is not None:
            used = [f"{k}={getattr(self, k)!r}" for k, off in (("token_weights", "uniform"), ("sem_lambda", 0.0),
                                                               ("beta_l1", 0.0)) if getattr(self, k) != off]
            if used:
                raise ValueError(f"algorithm.distill / algorithm.pear replace the SFT loss and do not combine with "
                                 f"{', '.join(used)}")


@dataclasses.dataclass(frozen=True)
class DiffusionConfig:
    """Masked-diffusion training (LLaDA, Nie et al. 2025; `trainers.diffusion`) of a
    ``model.mode="diffusion"`` model: each document draws ``t ~ U(0, 1)``, each eligible token
    is masked with ``p_mask = (1 - eps) t + eps`` and the loss is the cross-entropy on masked
    tokens divided by ``p_mask``. Optional SPEED sharpened-teacher distillation. ``objective="edit"``
    is ME-DLM's mask + edit training (`trainers.edit_batches`)."""

    name: Literal["diffusion"] = "diffusion"
    """The algorithm's registered name (`trainers.algorithm.ALGORITHMS`)."""
    objective: Literal["pretrain", "sft", "edit"] = "sft"
    """pretrain: every real token may be masked, loss / (B L); sft: the prompt is never masked and
    each document's loss is divided by its answer length, then averaged over documents; edit
    (ME-DLM, needs model.next_token_head and delete_token_id): batches of masked answers or of
    the model's own intermediate outputs, loss (CE(current head) + CE(next head)) / t."""
    eps: float = 1e-3
    """Smallest masking probability."""
    pad_answers: bool = True
    """sft: each row's padding becomes EOS tokens counted as answer (LLaDA), so the model learns to
    end a fixed-length response; needs data.pack=False."""
    eval_steps: int | None = None
    """Denoising steps of the held-out accuracy sampler (None: one token per step)."""
    eval_block_length: int | None = None
    """Block length of the held-out accuracy sampler (None: one block)."""
    teacher: str | None = None
    """SPEED: a diffusion checkpoint (jaxlm or HF directory) whose logits the student is distilled from."""
    distill_weight: float = 1.0
    """SPEED: lambda, the weight of the KL term."""
    teacher_temperature: float = 0.5
    """SPEED: tau_T < 1 sharpens the teacher's distribution."""
    student_temperature: float = 1.0
    """SPEED: tau, the student's temperature (the KL is scaled by tau^2)."""
    edit_intermediate_ratio: float = 0.5
    """edit: probability that a batch is built from the model's own outputs (mask diffusion of a
    masked answer, then self edit rounds) instead of masked answers (0: ME-DLM's stage 2)."""
    edit_fill_per_step: tuple[int, ...] = (2, 4, 8)
    """edit: tokens committed per step when the model fills an intermediate batch's masks (one
    value drawn per batch)."""
    edit_fill_order: Literal["random", "confidence"] = "random"
    """edit: which masked tokens the fill commits first (ME-DLM's trainer: random)."""
    edit_max_rounds: int = 32
    """edit: self edit rounds after the fill grow as floor(progress * edit_max_rounds), progress
    being the fraction of the current cycle of edit_round_cycle steps (ME-DLM: of the epoch)."""
    edit_round_cycle: int | None = None
    """edit: steps per cycle of the self-edit schedule (None: trainer.steps)."""
    edit_swap_rule: Literal["reference", "safe"] = "reference"
    """edit: `jaxlm.data.edit_labels.edit_labels`'s swap rule for the labels."""
    edit_target: Literal["answer", "nearest"] = "answer"
    """edit: what an intermediate output is labelled against: the row's own answer (ME-DLM), or
    the nearest by edit distance of the answers the task accepts for the prompt
    (`Task.accepted_completions`; ties go to the row's own). For tasks with several right
    answers, where the model's fill may have taken another one than the row's."""
    eval_edit_rounds: int = 0
    """Edit rounds of the held-out accuracy sampler after mask diffusion (0: none)."""

    def __post_init__(self):
        if self.objective not in ("pretrain", "sft", "edit"):  # anything else took the SFT branches
            raise ValueError(f"algorithm.objective={self.objective!r} is invalid: must be 'pretrain', 'sft' or 'edit'")
        if not 0 < self.eps < 1:
            raise ValueError(f"algorithm.eps={self.eps!r} is invalid: must be in (0, 1)")
        for name in ("eval_steps", "eval_block_length"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"algorithm.{name}={v!r} is invalid: must be a positive int or None")
        if not 0 <= self.distill_weight < math.inf:
            raise ValueError(f"algorithm.distill_weight={self.distill_weight!r} is invalid: must be a finite number >= 0")
        for name in ("teacher_temperature", "student_temperature"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"algorithm.{name}={getattr(self, name)!r} is invalid: must be a finite number > 0")
        if not 0 <= self.edit_intermediate_ratio <= 1:
            raise ValueError(f"algorithm.edit_intermediate_ratio={self.edit_intermediate_ratio!r} is invalid: "
                             "must be in [0, 1]")
        k = self.edit_fill_per_step
        if not isinstance(k, tuple) or not k or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in k):
            raise ValueError(f"algorithm.edit_fill_per_step={k!r} is invalid: must be a non-empty tuple of "
                             "positive ints")
        for name in ("edit_max_rounds", "eval_edit_rounds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"algorithm.{name}={v!r} is invalid: must be an int >= 0")
        c = self.edit_round_cycle
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c <= 0):
            raise ValueError(f"algorithm.edit_round_cycle={c!r} is invalid: must be a positive int or None")
        if self.edit_fill_order not in ("random", "confidence"):
            raise ValueError(f"algorithm.edit_fill_order={self.edit_fill_order!r} is invalid: must be 'random' or "
                             "'confidence'")
        if self.edit_target not in ("answer", "nearest"):
            raise ValueError(f"algorithm.edit_target={self.edit_target!r} is invalid: must be 'answer' or 'nearest'")
        if self.edit_swap_rule not in ("reference", "safe"):
            raise ValueError(f"algorithm.edit_swap_rule={self.edit_swap_rule!r} is invalid: must be 'reference' "
                             "or 'safe'")


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """PrefixRL (Setlur et al. 2026, method card B.1; `trainers.rl.prefix`): GRPO on hard
    problems prefixed with the start of a correct trace. Setting ``GRPOConfig.prefix`` makes
    the single_turn collector build the trace pool and choose the prefixes with the base
    policy before the first iteration."""

    problems: int = 64
    """Hard training problems: train examples 0 .. problems-1 of data.source."""
    trace_source: Literal["policy", "reference", "both"] = "policy"
    """Correct traces: rejection-sampled from the base policy, the task's reference solution
    (a trace from another source, which the paper allows), or both."""
    pool_samples: int = 64
    """Rejection-sampling budget per problem (trace_source policy/both)."""
    pass_rate_samples: int = 16
    """Samples per (problem, prefix) for the base pass-rate estimate."""
    fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    """Candidate cut points, as fractions of the trace's tokens [INFERRED]."""
    band_lo: float = 0.2
    band_hi: float = 0.8
    """Keep the cut whose base pass rate lies in [band_lo, band_hi], closest to the band's
    centre [INFERRED]; problems without one are dropped."""
    recalibrate_every: int = 0
    """Re-choose the cuts with the current policy every N iterations, a curriculum toward
    shorter prefixes as it improves (card B.1, optional [INFERRED]); 0 = never."""
    rows_per_call: int = 256
    """Sequences per sampler call while building the pool and estimating pass rates."""

    def __post_init__(self):
        if self.trace_source not in ("policy", "reference", "both"):
            raise ValueError(f"PrefixConfig.trace_source={self.trace_source!r} must be policy | reference | both")
        _positive("PrefixConfig", problems=self.problems, pass_rate_samples=self.pass_rate_samples,
                  rows_per_call=self.rows_per_call)
        if self.trace_source != "reference":
            _positive("PrefixConfig", pool_samples=self.pool_samples)
        if isinstance(self.recalibrate_every, bool) or not isinstance(self.recalibrate_every, int) \
                or self.recalibrate_every < 0:
            raise ValueError(f"PrefixConfig.recalibrate_every={self.recalibrate_every!r} must be an int >= 0")
        if not self.fractions or not all(0 < f < 1 for f in self.fractions):
            raise ValueError(f"PrefixConfig.fractions={self.fractions!r} must be non-empty, each in (0, 1)")
        if not 0 <= self.band_lo <= self.band_hi <= 1:
            raise ValueError(
                f"PrefixConfig.band_lo={self.band_lo!r}, band_hi={self.band_hi!r}: need 0 <= band_lo <= band_hi <= 1"
            )


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Group-relative policy optimisation (Shao et al. 2024) and its variants, assembled from
    the registries in `trainers.rl` by name. One iteration: ``data.batch_size`` prompts x
    ``num_generations`` rollouts, rewards, advantages, then ``mu`` epochs of ``minibatches``
    optimizer steps over the rollouts with the log-probs recorded before the first update."""

    name: Literal["grpo"] = "grpo"
    """The algorithm's registered name (`trainers.algorithm.ALGORITHMS`)."""
    collector: str = "single_turn"
    """Where rollouts come from (`trainers.rl.collectors.COLLECTORS`): single_turn samples the
    data source's prompts; multi-turn environments register their own."""
    num_generations: int = 8
    """Rollouts per prompt (the group G)."""
    max_new_tokens: int = 16
    """Tokens sampled per rollout."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    top_p: float | None = None
    """Nucleus sampling of the rollouts (None: off)."""
    advantage: str = "grpo"
    """grpo | dr_grpo | rloo | turn_level (`trainers.rl.advantages.ADVANTAGES`)."""
    adv_eps: float = 1e-6
    """Added to the group std: (r - mean) / (std + adv_eps)."""
    turn_gamma: float | None = None
    """turn_level only: per-turn rewards -> returns-to-go with this discount (None: per-turn reward)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip | gspo (`POLICY_LOSSES`)."""
    eps_low: float = 0.2
    """PPO clip: ratios below 1 - eps_low are clipped."""
    eps_high: float = 0.2
    """PPO clip: ratios above 1 + eps_high are clipped (DAPO's clip-higher when larger)."""
    dual_clip: float | None = None
    """Dual-clip PPO: negative-advantage losses are capped at dual_clip * |A| (None: off)."""
    aggregation: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (`AGGREGATORS`)."""
    beta: float = 0.0
    """KL-to-reference coefficient (0: no reference model is kept)."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 | k3+ (`KL_ESTIMATORS`)."""
    mu: int = 1
    """Optimisation epochs over each batch of rollouts."""
    minibatches: int = 1
    """Optimizer steps per epoch (the rollouts are split into this many minibatches)."""
    rewards: tuple[str, ...] = ("verifier",)
    """Reward functions (`trainers.rl.rewards.REWARDS`), summed with ``reward_weights``."""
    reward_weights: tuple[float, ...] = (1.0,)
    reward_model: str | None = None
    """reward ``reward_model``: a directory written by `trainers.reward_model.save_reward_model`."""
    reward_model_output: str = "probability"
    """reward ``reward_model``: score (the raw head output) | probability (sigmoid(score - offset))."""
    judge_model: str | None = None
    """reward ``judge``: the judge (a jaxlm checkpoint or HF directory); the reward is its P(yes)."""
    filter_zero_variance: bool = False
    """Dynamic sampling (DAPO): groups whose rewards are all equal carry no loss."""
    use_sampler_logprobs: bool = False
    """Use the sampler's log-probs as the old policy's (skip the recompute), as Tunix allows."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight tokens by min(pi_old/pi_sampler, cap)."""
    buffer_sampler: str = "uniform"
    """How minibatches are drawn from the rollouts (`trainers.rl.buffer.BUFFER_SAMPLERS`)."""
    qpas_quantile: float = 0.25
    """buffer_sampler=q_pas: rollouts whose |advantage| is below this quantile are dropped."""
    qpas_alpha: float = 1.0
    """buffer_sampler=q_pas: slots drawn with probability proportional to |A|^qpas_alpha."""
    qpas_beta: float = 1.0
    """buffer_sampler=q_pas: prioritized-replay weight exponent (0: no correction)."""
    ccc_invalid_reward: float = -1.0
    """CCC-GRPO (reward ``ccc``): the reward of a rollout whose answer does not parse, r_min
    ([INFERRED] in the method card B.2; -1 is the worst CCC)."""
    cf_quality: float = 1.0
    """counterfactual_bonus: only rollouts whose verifier reward is >= this get the bonus."""
    logprob_chunk: int = 256
    """Rows of logits materialised at a time in the log-prob / entropy computation."""
    shared_prompt_forward: bool = True
    """Log-probs and gradients run each distinct prompt once (its keys/values gathered into the
    G rollouts that continue it) instead of once per rollout; the same loss, less compute.
    Used when the collector's rows share a prompt block (single-turn and PrefixRL)."""
    prefix: PrefixConfig | None = None
    """PrefixRL (B.1): train on problems prefixed with part of a correct trace (None: off)."""
    environment: RPSConfig | None = None
    """Multi-turn collectors' environment (rps_memory: MemoPilot's Rock-Paper-Scissors)."""
    agent: AgentTaskConfig | None = None
    """collector='agent': the tool-use task (`jaxlm.agents.tasks`) and the loop's budgets."""
    camel: CamelConfig | None = None
    """collector='camel': CAMEL's counterfactual verdict prefixes (None: CamelConfig())."""

    def __post_init__(self):
        check_grpo_config(self)


@dataclasses.dataclass(frozen=True)
class OmniTrainConfig:
    """Training an omni (video + audio + text) model (`jaxlm.models.omni`; `trainers.omni`) on
    the synthetic audio-visual task (`jaxlm.data.audiovisual`): the language model is
    ``cfg.model`` (``rope="mrope"`` for three-axis positions), the video and audio encoders are
    trained with it, and the loss is the next-token cross-entropy on the answer (and EOS) after
    ``[BOS] clip question``. Batch ``k`` holds clips drawn from ``(trainer.seed, k)``; held-out
    clips come from a disjoint index range. ``optimizer.trainable`` selects what trains by
    parameter name (``"encoder"``: the encoders alone, e.g. over an ``init_from`` language model)."""

    name: Literal["omni"] = "omni"
    """The algorithm's registered name (`trainers.algorithm.ALGORITHMS`)."""
    task: AVTaskConfig = AVTaskConfig()
    """The synthetic clips and the questions asked about them."""
    encoder_hidden: int = 128
    """Width of the video and audio encoders' MLPs."""
    video_token_id: int | None = None
    """The video placeholder's token id (None: the first id past the tokenizer's vocabulary)."""
    audio_token_id: int | None = None
    """The audio placeholder's token id (None: the second id past the tokenizer's vocabulary)."""
    frames_per_chunk: int = 2
    """Video frames per time chunk, each followed by the audio of its span (Qwen2.5-Omni's layout)."""
    frame_ticks: int = 2
    """Time-axis position ids per video frame."""
    audio_ticks: int = 1
    """Time-axis position ids per audio frame."""
    eval_examples: int = 256
    """Held-out clips per evaluation (rounded up to whole batches of data.batch_size)."""

    def __post_init__(self):
        if not isinstance(self.task, AVTaskConfig):
            raise ValueError(f"algorithm.task must be an AVTaskConfig, got {type(self.task).__name__}")
        _positive("algorithm", encoder_hidden=self.encoder_hidden, frames_per_chunk=self.frames_per_chunk,
                  frame_ticks=self.frame_ticks, audio_ticks=self.audio_ticks, eval_examples=self.eval_examples)
        for name in ("video_token_id", "audio_token_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"algorithm.{name}={v!r} is invalid: must be a token id >= 0 or None")
        if self.video_token_id is not None and self.video_token_id == self.audio_token_id:
            raise ValueError("algorithm.video_token_id and algorithm.audio_token_id must differ")


def _is_algorithm_config(value: Any) -> bool:
    """A frozen dataclass instance with a string ``name`` (the algorithm's registered name)."""
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and isinstance(getattr(value, "name", None), str) and type(value).__dataclass_params__.frozen)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: the model, its data, the optimizer, the run and the algorithm."""

    model: ModelConfig = ModelConfig.tiny()
    """The model trained (its shape and variants; with init_from, the shape of those weights)."""
    data: DataConfig = DataConfig()
    """What it is trained on and how batches are made."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer and its learning-rate schedule."""
    trainer: TrainerConfig = TrainerConfig()
    """The run: length, logging, evaluation, checkpoints, devices."""
    algorithm: SFTConfig | GRPOConfig | DiffusionConfig | OmniTrainConfig = SFTConfig()
    """The training algorithm and its settings: SFT, GRPO, masked diffusion or omni training (any frozen dataclass
    whose ``name`` is registered in `trainers.algorithm.ALGORITHMS` plugs in from Python)."""
    tokenizer: str = "byte"
    """'byte' (the embedded default) or a directory holding tokenizer.json."""
    init_from: str | None = None
    """Start from the weights of a HF directory or jaxlm checkpoint, loaded into `model` (which
    may add variant parameters, e.g. meta_swiglu; those start at their neutral init)."""

    def __post_init__(self):
        for name, kinds in (("model", ModelConfig), ("data", DataConfig), ("optimizer", OptimizerConfig),
                            ("trainer", TrainerConfig), ("algorithm", (SFTConfig, GRPOConfig, DiffusionConfig, OmniTrainConfig))):
            value = getattr(self, name)
            if name == "algorithm" and _is_algorithm_config(value):
                continue
            if not isinstance(value, kinds):
                allowed = " | ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
                raise ValueError(
                    f"ExperimentConfig.{name} must be a {allowed}, got {type(value).__name__} "
                    f"(e.g. {name}={allowed.split(' | ')[0]}(...), not {name}=dict(...))"
                )
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ValueError(f"ExperimentConfig.tokenizer={self.tokenizer!r} must be 'byte' or a directory (str)")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from.strip()):
            raise ValueError(f"ExperimentConfig.init_from={self.init_from!r} must be a path (str) or None (an empty "
                             "value, e.g. an unset shell variable, would silently start from random weights)")
        if isinstance(self.algorithm, OmniTrainConfig) and (self.model.rope != "mrope" or self.model.mode != "causal"):
            raise ValueError(f"algorithm.name='omni' needs model.rope='mrope' (three-axis positions) and "
                             f"model.mode='causal', got rope={self.model.rope!r}, mode={self.model.mode!r}")
        if isinstance(self.algorithm, DiffusionConfig):
            if self.model.mode != "diffusion":
                raise ValueError(f"algorithm.name='diffusion' needs model.mode='diffusion' (got {self.model.mode!r}) "
                                 "and a model.mask_token_id")
            if self.algorithm.objective == "sft" and self.algorithm.pad_answers and self.data.pack:
                raise ValueError("algorithm.pad_answers=True needs data.pack=False (one example per row, its "
                                 "padding turned into EOS answer tokens)")
            if self.algorithm.objective == "edit":
                if not self.model.next_token_head or self.model.delete_token_id is None:
                    raise ValueError("algorithm.objective='edit' (ME-DLM) needs model.next_token_head=True and "
                                     "model.delete_token_id")
                if self.data.pack:
                    raise ValueError("algorithm.objective='edit' needs data.pack=False (one example per row)")
            if self.algorithm.eval_edit_rounds and (not self.model.next_token_head
                                                    or self.model.delete_token_id is None):
                raise ValueError("algorithm.eval_edit_rounds needs model.next_token_head=True and "
                                 "model.delete_token_id")
            n = self.trainer.eval_max_new_tokens  # the held-out sampler's schedule, checked before training
            try:
                check_schedule(n, self.algorithm.eval_block_length, self.algorithm.eval_steps or n)
            except ValueError as e:
                raise ValueError(f"algorithm.eval_steps={self.algorithm.eval_steps} / algorithm.eval_block_length="
                                 f"{self.algorithm.eval_block_length} with trainer.eval_max_new_tokens={n}: {e}") from None
        elif self.model.mode == "diffusion":
            raise ValueError(f"model.mode='diffusion' is trained with algorithm=DiffusionConfig(), not "
                             f"{self.algorithm.name!r}")
        if isinstance(self.algorithm, SFTConfig) and self.algorithm.distill is not None \
                and self.algorithm.distill.on_policy:
            if self.data.pack:
                raise ValueError("algorithm.distill.on_policy needs data.pack=False (one example per row, its "
                                 "completion resampled by the student)")
            if self.algorithm.pear is not None:
                raise ValueError("algorithm.distill.on_policy does not combine with algorithm.pear: PEAR's "
                                 "behaviour log-probs are those of the data's tokens, not the student's samples")
        # GRPO splits its rollouts (checked below); every other algorithm splits the batch's rows
        if not isinstance(self.algorithm, GRPOConfig) and self.data.batch_size % self.trainer.grad_accum:
            raise ValueError(
                f"data.batch_size={self.data.batch_size} is not divisible by "
                f"trainer.grad_accum={self.trainer.grad_accum}"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        if isinstance(self.algorithm, GRPOConfig):
            if self.data.batch_size * self.algorithm.num_generations % (
                self.algorithm.minibatches * self.trainer.grad_accum
            ):
                raise ValueError(
                    f"data.batch_size x algorithm.num_generations = "
                    f"{self.data.batch_size * self.algorithm.num_generations} rollouts are not divisible "
                    f"by algorithm.minibatches x trainer.grad_accum = "
                    f"{self.algorithm.minibatches * self.trainer.grad_accum}"
                )
        elif isinstance(self.algorithm, SFTConfig) and self.algorithm.token_weights not in TOKEN_WEIGHTS:
            raise ValueError(
                f"algorithm.token_weights={self.algorithm.token_weights!r} is invalid: must be one of "
                f"{sorted(TOKEN_WEIGHTS)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

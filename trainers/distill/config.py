"""`DistillConfig`: the teacher, the divergence and how the teacher's log-probs are obtained,
for distillation inside the SFT step (``SFTConfig.distill``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from trainers.distill.divergences import DIVERGENCES

TEACHER_LOGPROBS = ("full", "topk", "offline")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Distil a frozen teacher into the student during SFT (`trainers.distill.loss`): each
    trained token's loss is ``ce_weight * CE + weight * tau^2 * D(p_teacher^tau || q_student^tau)
    + tpa_weight * tau^2 * TPA``, summed like the cross-entropy, so gradient accumulation
    stays exact."""

    teacher: str | None = None
    """A jaxlm checkpoint or HF directory (frozen; may be a `jaxlm quantize` output). Not needed
    with teacher_logprobs='offline'."""
    divergence: str = "forward_kl"
    """forward_kl | reverse_kl | jsd | tail_aware (`trainers.distill.divergences.DIVERGENCES`)."""
    teacher_logprobs: Literal["full", "topk", "offline"] = "full"
    """full: the teacher's whole distribution (row chunks when the float32 logits are large);
    topk: its top_k log-probs plus one tail bucket, computed in row chunks; offline: top-K log-probs
    stored in the data rows (``teacher_topk_ids`` / ``teacher_topk_logprobs``, `jaxlm logprobs`)."""
    top_k: int = 10
    """K: the teacher's head for tail_aware, and the bins kept with teacher_logprobs=topk."""
    tail_beta: float = 1.0
    """tail_aware: beta, the weight of the renormalised-tail KL (beta = p_T is plain KL)."""
    jsd_beta: float = 0.5
    """jsd: the mixture weight beta in (0, 1)."""
    temperature: float = 1.0
    """tau: both distributions are softmax(logits / tau); the divergence is scaled by tau^2."""
    weight: float = 1.0
    """Weight of the divergence term."""
    ce_weight: float = 0.0
    """Weight of the cross-entropy on the data tokens kept beside the divergence."""
    tpa_weight: float = 0.0
    """Align-TI's token-transition alignment (two-step joints along the data): its weight."""
    tpa_form: Literal["joint_bucket", "product"] = "joint_bucket"
    """TPA's divergence: joint_bucket is the KL of the two-step joint distributions, the pairs whose
    first token is not the data token lumped into one bin; product is the card's literal
    sum over v of P(y, v) log P(y, v) / Q(y, v) (no bin for other first tokens) [INFERRED]."""
    on_policy: float = 0.0
    """lambda: the probability that a batch's completions are replaced by the live student's own
    samples (GKD, Agarwal et al. 2024; `trainers.distill.on_policy`), so the divergence and TPA run
    along the student's tokens; 0: along the data only. Needs data.pack=False and ce_weight=0."""
    on_policy_temperature: float = 1.0
    """Sampling temperature of the on-policy completions (0: greedy)."""
    on_policy_max_new_tokens: int | None = None
    """Longest on-policy completion (None: the slots a row leaves after its prompt)."""
    chunk_rows: int = 512
    """Rows (tokens) of logits per chunk when the float32 [B, T, V] logits exceed
    trainers.step.CHUNKED_LOSS_BYTES."""

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"algorithm.distill.divergence={self.divergence!r} is invalid: must be one of "
                             f"{sorted(DIVERGENCES)}")
        if self.teacher_logprobs not in TEACHER_LOGPROBS:
            raise ValueError(f"algorithm.distill.teacher_logprobs={self.teacher_logprobs!r} is invalid: must be one "
                             f"of {list(TEACHER_LOGPROBS)}")
        if self.teacher_logprobs != "offline" and not isinstance(self.teacher, str):
            raise ValueError(f"algorithm.distill.teacher={self.teacher!r}: a teacher checkpoint path is needed unless "
                             "teacher_logprobs='offline'")
        for name in ("top_k", "chunk_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "top_k" else 1):
                raise ValueError(f"algorithm.distill.{name}={v!r} is invalid: must be an int >= "
                                 f"{0 if name == 'top_k' else 1}")
        for name in ("tail_beta", "weight", "ce_weight", "tpa_weight", "temperature", "jsd_beta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"algorithm.distill.{name}={v!r} is invalid: must be a finite number >= 0")
        for name in ("on_policy", "on_policy_temperature"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"algorithm.distill.{name}={v!r} is invalid: must be a finite number >= 0")
        if self.on_policy > 1:
            raise ValueError(f"algorithm.distill.on_policy={self.on_policy!r} is invalid: a probability in [0, 1]")
        m = self.on_policy_max_new_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"algorithm.distill.on_policy_max_new_tokens={m!r} is invalid: must be an int >= 1 or "
                             "None")
        if self.on_policy and self.teacher_logprobs == "offline":
            raise ValueError("algorithm.distill.on_policy needs a live teacher: stored top-K log-probs "
                             "(teacher_logprobs='offline') cover only the data's tokens, not the student's samples")
        if self.on_policy and self.ce_weight:
            raise ValueError(f"algorithm.distill.on_policy={self.on_policy} with ce_weight={self.ce_weight}: the "
                             "cross-entropy would train the student on its own samples; use ce_weight=0")
        if not self.temperature > 0:
            raise ValueError(f"algorithm.distill.temperature={self.temperature!r} is invalid: must be > 0")
        if not 0 < self.jsd_beta < 1:
            raise ValueError(f"algorithm.distill.jsd_beta={self.jsd_beta!r} is invalid: must be in (0, 1)")
        if self.tpa_form not in ("joint_bucket", "product"):
            raise ValueError(f"algorithm.distill.tpa_form={self.tpa_form!r} is invalid: must be joint_bucket | product")
        if self.teacher_logprobs in ("topk", "offline"):
            if self.top_k < 1 and self.teacher_logprobs == "topk":
                raise ValueError("algorithm.distill.teacher_logprobs='topk' needs top_k >= 1")
            if self.divergence == "tail_aware" and self.tail_beta:
                raise ValueError(
                    f"algorithm.distill.divergence='tail_aware' with tail_beta={self.tail_beta} needs the teacher's "
                    f"whole tail: use teacher_logprobs='full', or tail_beta=0 (the head + bucket KL, which is what "
                    f"forward_kl gives on top-K log-probs)")
        if self.weight == 0 and self.ce_weight == 0 and self.tpa_weight == 0:
            raise ValueError("algorithm.distill: weight, ce_weight and tpa_weight are all 0, so the loss is 0 and "
                             "nothing trains; give one of them a positive weight")
        if self.divergence == "tail_aware" and self.top_k == 0 and self.tail_beta == 0 and not self.ce_weight \
                and not self.tpa_weight:
            raise ValueError("algorithm.distill.divergence='tail_aware' with top_k=0 and tail_beta=0 weighs neither "
                             "the head nor the tail: the loss is 0 and nothing trains")
        if self.teacher_logprobs == "offline" and self.temperature != 1:
            raise ValueError(f"algorithm.distill.temperature={self.temperature}: stored top-K log-probs are at "
                             "temperature 1 and cannot be re-tempered without the tail; use temperature=1")

"""`diffusion_generate`: block-wise denoising of a masked diffusion LM inside one `jit`.

The response starts as ``gen_length`` [MASK] tokens after the (left-padded) prompt and is
decoded block by block, left to right (LLaDA's semi-autoregressive sampler, Nie et al. 2025).
Each iteration of one `lax.while_loop` runs a forward, proposes a token for every masked
position of the current block (`commit.predict`) and commits some of them:

* ``rule="schedule"``: LLaDA low-confidence remasking, ``steps / n_blocks`` steps per block
  committing `commit.num_transfer_tokens` tokens each;
* ``threshold=``: Fast-dLLM's confidence-aware parallel decoding (a block takes as many
  steps as it needs);
* ``slow_fast=`` (`SlowFast`): SPEED's Slow-Fast decoding, one extra forward per step with
  the preceding block masked to measure each token's sensitivity (JSD).

With ``edit_rounds=R`` (a model with ``next_token_head`` and ``delete_token_id``), ME-DLM's edit
rounds (`edit`) follow in the same `jit`: the response's stop tokens are dropped, one EOS closes
it, and up to R rounds delete, replace and insert tokens (one forward each, stopping early
once no row changes), so the response may grow to ``edit_max_length`` tokens.

How each forward is computed is ``cache=``: None (the full sequence every step), ``"prefix"``
/ ``"dual"`` (Fast-dLLM's block-wise prefix and dual KV caches) or a `DLLMCache` (dLLM-Cache).
Classifier-free guidance (``cfg_scale = w``): ``un + (w + 1) (cond - un)``, ``un`` the logits
with the prompt masked. The result reports the forwards, the steps and the matmul FLOPs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.inference.diffusion import forward as fw
from jaxlm.inference.diffusion import edit
from jaxlm.inference.diffusion.commit import (
    FAST_GROUPS,
    commit_slow_fast,
    commit_threshold,
    commit_top_k,
    jensen_shannon,
    num_transfer_tokens,
    predict,
)
from jaxlm.inference.diffusion.forward import DLLMCache
from jaxlm.inference.sampler import (
    _as_token_lists,
    _check_bucket,
    _check_rng,
    _is_number,
    _token_ids,
    default_stop_tokens,
)

CACHES = (None, "prefix", "dual")


@dataclasses.dataclass(frozen=True)
class SlowFast:
    """SPEED's Slow-Fast decoding (`commit.commit_slow_fast`)."""

    jsd_threshold: float = 0.05
    """delta: a token with JSD < delta is low-sensitivity."""
    confidence: float = 0.5
    """gamma: fast-group tokens at or above this confidence are committed together."""
    fast: str = "low"
    """Which group is decoded jointly: low (the seed abstract) | high (the ICML page)."""

    def __post_init__(self):
        if self.fast not in FAST_GROUPS:
            raise ValueError(f"SlowFast.fast={self.fast!r} is invalid: must be one of {FAST_GROUPS}")
        for name in ("jsd_threshold", "confidence"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:  # NaN passed "< 0"
                raise ValueError(f"SlowFast.{name}={v!r} is invalid: must be a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static settings of one compiled sampler."""

    prompt_len: int
    gen_length: int
    block_length: int
    steps_per_block: int | None
    temperature: float
    remasking: str
    cfg_scale: float
    threshold: float | None
    slow_fast: SlowFast | None
    cache: Any
    mask_id: int
    banned: tuple[int, ...]
    edit_rounds: int = 0
    edit_max_length: int = 0
    edits_per_round: int | None = None
    edit_threshold: float | None = None
    delete_id: int = -1
    eos_id: int = -1
    stops: tuple[int, ...] = ()

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_length


@dataclasses.dataclass
class DiffusionResult:
    tokens: np.ndarray  # [B, gen_length] the decoded response (EOS and what follows included);
    # after edit rounds [B, edit_max_length + 1], each response closed by EOS and EOS-filled
    completions: list[list[int]]  # per row: the response up to its first stop token (excluded)
    texts: list[str] | None  # decoded completions when a tokenizer is known
    prompt_tokens: np.ndarray  # [B, P] left-padded prompts
    steps: int  # denoising iterations (all rows advance together)
    forwards: int  # model forwards (a guided or Slow-Fast step counts two)
    flops: float  # matmul FLOPs of all forwards, the whole batch
    tokens_per_step: float  # response tokens committed per iteration, mean over rows
    row_steps: np.ndarray | None = None  # [B] iterations each row had masked tokens in its current
    # block: the steps the row would take decoded alone (a batch waits, block by block, for its
    # slowest row, so ``steps`` >= every row's)
    edit_rounds: int = 0  # edit rounds run (forwards included in ``forwards``)
    edits: np.ndarray | None = None  # [B] edit rounds that changed each row
    mask_completions: list[list[int]] | None = None  # with edit rounds: the completions before them


def _logits(model, plan: _Plan, x, valid, caches, step_in_block, block, step):
    """The current block's logits ``[B, L, V]`` (and the caches, FLOPs) for one step; ``step``
    (0-based, over all blocks) drives dLLM-Cache's refresh schedule: one cached model call per
    step, a guided step's conditional and unconditional rows batched in it."""
    P, L, c = plan.prompt_len, plan.block_length, model.config
    B, T = x.shape
    if plan.cfg_scale:
        prompt_slot = (jnp.arange(T) < P)[None] & valid
        x = jnp.concatenate([x, jnp.where(prompt_slot, plan.mask_id, x)])
        valid = jnp.concatenate([valid, valid])
    rows = x.shape[0]
    start = P + block * L

    def block_of(gen_logits):
        return jax.lax.dynamic_slice_in_dim(gen_logits, block * L, L, axis=1)

    if plan.cache is None:
        logits, _ = fw.full_forward(model, x, valid, start=P, collect=False)
        out, flops = block_of(logits), fw.full_flops(c, rows, T, T - P)
    elif isinstance(plan.cache, DLLMCache):
        d = plan.cache
        mode = d.mode(step)

        def full(caches):
            logits, new = fw.full_forward(model, x, valid, start=P, collect=True)
            return logits, new

        def partial(m):
            return lambda caches: fw.dllm_cache_forward(model, x, valid, caches, m, prompt_len=P,
                                                        transfer_ratio=d.transfer_ratio)

        logits, caches = jax.lax.switch(mode, [full, partial(1), partial(2), partial(3)], caches)
        costs = jnp.asarray([fw.dllm_cache_flops(c, rows, T, P, m, d.transfer_ratio) for m in range(4)], jnp.float32)
        out, flops = block_of(logits), costs[mode]
    else:  # Fast-dLLM: a full forward at each block's first step, then the span only
        def full(caches):
            logits, new = fw.full_forward(model, x, valid, start=P, collect=True)
            return block_of(logits), {"k": new["k"], "v": new["v"]}

        if plan.cache == "dual":
            def span(caches):
                return fw.span_forward(model, x, valid, caches, start=start, size=L), caches
            span_cost = fw.span_flops(c, rows, T, L)
        else:  # prefix: the block and everything after it, a static size per block
            def span_at(b):
                size = T - (P + b * L)
                return lambda caches: (fw.span_forward(model, x, valid, caches, start=P + b * L, size=size)[:, :L],
                                       caches)

            def span(caches):
                return jax.lax.switch(block, [span_at(b) for b in range(plan.n_blocks)], caches)
            span_cost = jnp.asarray([fw.span_flops(c, rows, T, T - (P + b * L)) for b in range(plan.n_blocks)],
                                    jnp.float32)[block]
        out, caches = jax.lax.cond(step_in_block == 0, full, span, caches)
        flops = jnp.where(step_in_block == 0, fw.full_flops(c, rows, T, T - P), span_cost)
    if plan.cfg_scale:
        cond, un = out[:B], out[B:]
        out = un + (plan.cfg_scale + 1.0) * (cond - un)
    return out, caches, jnp.asarray(flops, jnp.float32)


def _init_caches(model, plan: _Plan, batch: int, length: int):
    if plan.cache is None:
        return None
    c = model.config
    rows = batch * (2 if plan.cfg_scale else 1)
    dt = c.compute_dtype
    caches = {
        "k": jnp.zeros((c.n_layers, rows, length, c.n_kv_heads, c.qk_head_dim), dt),
        "v": jnp.zeros((c.n_layers, rows, length, c.n_kv_heads, c.v_head_dim), dt),
    }
    if isinstance(plan.cache, DLLMCache):
        caches["attn"] = jnp.zeros((c.n_layers, rows, length, c.d_model), dt)
        caches["mlp"] = jnp.zeros((c.n_layers, rows, length, c.d_model), dt)
    return caches


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"))
def diffusion_tokens(graphdef, params, prompt_tokens, prompt_mask, rng, *, plan: _Plan):
    """The jittable core: left-padded prompts ``[B, P]`` -> ``(tokens [B, G], steps, forwards,
    flops, committed [B], mask-diffusion tokens, edits [B], edit rounds, row steps [B])``."""
    model = nnx.merge(graphdef, params)
    B, P = prompt_tokens.shape
    G, L = plan.gen_length, plan.block_length
    x = jnp.concatenate([prompt_tokens.astype(jnp.int32), jnp.full((B, G), plan.mask_id, jnp.int32)], axis=1)
    valid = jnp.concatenate([prompt_mask.astype(bool), jnp.ones((B, G), bool)], axis=1)
    T = P + G
    schedule = None
    if plan.steps_per_block is not None and plan.threshold is None and plan.slow_fast is None:
        schedule = jnp.asarray(num_transfer_tokens(L, plan.steps_per_block))
    banned = jnp.asarray(plan.banned, jnp.int32) if plan.banned else None
    sensitivity_width = L

    def block_logits(x, caches, j, b, n):
        logits, caches, flops = _logits(model, plan, x, valid, caches, j, b, n)
        if banned is not None:
            logits = logits.at[..., banned].set(-jnp.inf)
        return logits, caches, flops

    def cond(carry):
        return carry["block"] < plan.n_blocks

    def body(carry):
        x, b, j = carry["x"], carry["block"], carry["step_in_block"]
        start = P + b * L
        blk = jax.lax.dynamic_slice_in_dim(x, start, L, axis=1)
        masked = blk == plan.mask_id
        logits, caches, flops = block_logits(x, carry["caches"], j, b, carry["steps"])
        key = jax.random.fold_in(rng, carry["steps"])
        proposal, conf = predict(logits, key, temperature=plan.temperature, remasking=plan.remasking)
        forwards = carry["forwards"] + (2 if plan.cfg_scale else 1)
        if plan.slow_fast is not None:
            # the same step with the preceding block (the prompt's last L tokens for the first) masked
            hidden_from = start - sensitivity_width
            slot = jnp.arange(T)[None]
            hide = (slot >= hidden_from) & (slot < start) & valid
            blind, _, blind_flops = _logits(model, plan, jnp.where(hide, plan.mask_id, x), valid, None, j, b, 0)
            if banned is not None:
                blind = blind.at[..., banned].set(-jnp.inf)
            jsd = jensen_shannon(logits, blind)
            sf = plan.slow_fast
            new_blk, select = commit_slow_fast(blk, masked, proposal, conf, jsd, jsd_threshold=sf.jsd_threshold,
                                               confidence=sf.confidence, fast=sf.fast)
            flops, forwards = flops + blind_flops, forwards + 1
        elif plan.threshold is not None:
            new_blk, select = commit_threshold(blk, masked, proposal, conf, plan.threshold)
        else:
            new_blk, select = commit_top_k(blk, masked, proposal, conf, schedule[j])
        x = jax.lax.dynamic_update_slice_in_dim(x, new_blk, start, axis=1)
        if schedule is not None:
            block_done = j + 1 >= plan.steps_per_block
        else:
            block_done = ~jnp.any(new_blk == plan.mask_id)
        return {
            "x": x, "caches": caches, "block": jnp.where(block_done, b + 1, b),
            "step_in_block": jnp.where(block_done, 0, j + 1), "steps": carry["steps"] + 1,
            "forwards": forwards, "flops": carry["flops"] + flops,
            "committed": carry["committed"] + select.sum(-1, dtype=jnp.int32),
            "row_steps": carry["row_steps"] + jnp.any(masked, -1).astype(jnp.int32),
        }

    carry = {
        "x": x, "caches": _init_caches(model, plan, B, T), "block": jnp.zeros((), jnp.int32),
        "step_in_block": jnp.zeros((), jnp.int32), "steps": jnp.zeros((), jnp.int32),
        "forwards": jnp.zeros((), jnp.int32), "flops": jnp.zeros((), jnp.float32),
        "committed": jnp.zeros((B,), jnp.int32), "row_steps": jnp.zeros((B,), jnp.int32),
    }
    out = jax.lax.while_loop(cond, body, carry)
    tokens, forwards, flops = out["x"][:, P:], out["forwards"], out["flops"]
    mask_tokens, edits, rounds = tokens, jnp.zeros((B,), jnp.int32), jnp.zeros((), jnp.int32)
    if plan.edit_rounds:
        W = plan.edit_max_length + 1
        stop = jnp.isin(tokens, jnp.asarray(plan.stops or (plan.eos_id,), jnp.int32))
        response, lengths = edit.close_response(tokens, stop, eos_id=plan.eos_id, width=W)
        tokens, _, edits, rounds = edit.edit_rounds(
            model, prompt_tokens, prompt_mask, response, lengths, rounds=plan.edit_rounds, del_id=plan.delete_id,
            eos_id=plan.eos_id, max_len=plan.edit_max_length, banned=(plan.mask_id,),
            edits_per_round=plan.edits_per_round, edit_threshold=plan.edit_threshold)
        c = model.config
        round_flops = fw.full_flops(c, B, P + W, W) + fw.head_flops(c, W) * B  # + the next-token head
        forwards, flops = forwards + rounds, flops + rounds.astype(jnp.float32) * round_flops
    return tokens, out["steps"], forwards, flops, out["committed"], mask_tokens, edits, rounds, out["row_steps"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: must be a positive int")
    return int(value)


def check_diffusion_model(model) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "mode", None) != "diffusion":
        raise ValueError(
            f"diffusion_generate needs a masked diffusion LM (ModelConfig.mode='diffusion'), got "
            f"mode={getattr(config, 'mode', None)!r}: a causal checkpoint decodes left to right with jaxlm.generate"
        )


def check_schedule(gen_length, block_length, steps) -> tuple[int, int, int | None]:
    """``(gen_length, block_length, steps per block)`` of LLaDA's semi-autoregressive schedule
    (``block_length`` None: one block; ``steps`` None: no fixed step count), or a ValueError
    naming what does not divide: ``gen_length`` into blocks, ``steps`` over the blocks, or more
    than one step per token."""
    gen_length = _positive_int("gen_length", gen_length)
    block_length = gen_length if block_length is None else _positive_int("block_length", block_length)
    if gen_length % block_length:
        raise ValueError(f"gen_length={gen_length} is not divisible by block_length={block_length}")
    if steps is None:
        return gen_length, block_length, None
    n_blocks = gen_length // block_length
    steps = _positive_int("steps", steps)
    if steps % n_blocks:
        raise ValueError(f"steps={steps} is not divisible by the number of blocks gen_length/block_length = "
                         f"{n_blocks}")
    steps_per_block = steps // n_blocks
    if steps_per_block > block_length:
        raise ValueError(f"steps={steps} gives {steps_per_block} steps per block of {block_length} tokens: "
                         f"at most one step per token (steps <= gen_length={gen_length})")
    return gen_length, block_length, steps_per_block


def diffusion_generate(
    model,
    prompts: Sequence[Sequence[int]] | Sequence[str] | str,
    *,
    gen_length: int,
    steps: int | None = None,
    block_length: int | None = None,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    threshold: float | None = None,
    slow_fast: SlowFast | None = None,
    cache: str | DLLMCache | None = None,
    rng: jax.Array | int | None = None,
    tokenizer: Any = None,
    add_bos: bool = True,
    stop_tokens: Sequence[int] | None = None,
    banned_tokens: Sequence[int] = (),
    logits_eos_inf: bool = False,
    edit_rounds: int = 0,
    edit_max_length: int | None = None,
    edits_per_round: int | None = None,
    edit_threshold: float | None = None,
    bucket: int = 8,
) -> DiffusionResult:
    """Decode ``gen_length`` response tokens per prompt with a masked diffusion LM.

    gen_length / block_length: the response and the blocks it is decoded in, left to right
      (default one block); gen_length must be a multiple of block_length.
    steps: denoising steps of the fixed schedule (a multiple of the number of blocks); not
      used with ``threshold`` or ``slow_fast``, whose blocks take as many steps as they need.
    temperature: 0 is argmax (deterministic); else Gumbel-max sampling.
    remasking: low_confidence | random (which proposals the schedule keeps).
    cache: None | "prefix" | "dual" (Fast-dLLM) | `DLLMCache` (dLLM-Cache).
    banned_tokens: ids never proposed (e.g. ME-DLM's delete token); ``logits_eos_inf`` bans EOS.
    stop_tokens: where a completion ends (default the tokenizer's EOS).
    edit_rounds: ME-DLM's edit rounds after mask diffusion (see the module docstring); needs
      ``ModelConfig.next_token_head`` and ``delete_token_id`` and a tokenizer with an EOS.
    edit_max_length: the longest response the edits may produce (default gen_length).
    edits_per_round: apply only each row's this many most confident edits per round
      (substitutions, deletions and insertions ranked together; ME-DLM's ``pred_per_step``);
      None applies every predicted edit (the reference's default).
    edit_threshold: make only edits whose prediction has a softmax probability of at least
      this (not in ME-DLM's reference; combines with ``edits_per_round``).
    """
    check_diffusion_model(model)
    config = model.config
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    fixed = threshold is None and slow_fast is None
    if fixed and steps is None:
        raise ValueError("steps is required with the fixed schedule (set steps, threshold= or slow_fast=)")
    if not fixed and steps is not None:  # it would be ignored: those blocks take the steps they need
        raise ValueError(f"steps={steps!r} is not used with threshold= or slow_fast= (each block takes as many steps "
                         "as it needs): leave it out")
    gen_length, block_length, steps_per_block = check_schedule(gen_length, block_length, steps if fixed else None)
    if threshold is not None and (isinstance(threshold, bool) or not 0 <= float(threshold) <= 1):
        raise ValueError(f"threshold={threshold!r} is invalid: must be in [0, 1]")
    if threshold is not None and slow_fast is not None:
        raise ValueError("threshold= and slow_fast= are two commit rules: pass one")
    if slow_fast is not None and not isinstance(slow_fast, SlowFast):
        raise TypeError(f"slow_fast must be a SlowFast, got {type(slow_fast).__name__}")
    if not (cache in CACHES or isinstance(cache, DLLMCache)):
        raise ValueError(f"cache={cache!r} is invalid: must be None, 'prefix', 'dual' or a DLLMCache")
    if cache is not None:
        fw.check_cacheable(config)
    if isinstance(cache, DLLMCache) and threshold is not None and not isinstance(prompts, str) and len(prompts) > 1:
        # dLLM-Cache refreshes on the batch's step count, and threshold blocks take a different
        # number of steps per row: a row's tokens would depend on the rows it is batched with
        raise ValueError("cache=DLLMCache(...) with threshold= decodes one prompt per call (its refresh schedule "
                         "follows the batch's steps, which threshold makes differ per row); use cache='prefix' or "
                         "'dual' for batches, or call once per prompt")
    if slow_fast is not None and (cache is not None or cfg_scale):
        raise ValueError("slow_fast= runs without a cache and without guidance (cache=None, cfg_scale=0)")
    if not _is_number(temperature) or not 0 <= temperature < np.inf:
        raise ValueError(f"temperature={temperature!r} is invalid: must be a finite number >= 0")
    if not _is_number(cfg_scale) or not 0 <= cfg_scale < np.inf:
        raise ValueError(f"cfg_scale={cfg_scale!r} is invalid: must be a finite number >= 0")
    bucket = _check_bucket(bucket)

    token_lists = _as_token_lists(prompts, tokenizer, add_bos)
    for i, p in enumerate(token_lists):
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < config.vocab_size or t == config.mask_token_id]
        if bad:
            raise ValueError(f"prompt {i} has ids {bad[:5]} outside [0, vocab_size={config.vocab_size}) or equal "
                             f"to mask_token_id={config.mask_token_id}")
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and int(eos) == int(config.mask_token_id):  # the mask id is never emitted: no stop
        raise ValueError(f"the tokenizer's EOS id {eos} is the model's mask_token_id: the sampler never emits the "
                         "mask id, so no answer could end; give [MASK] an id of its own")
    if logits_eos_inf and eos is None:
        raise ValueError("logits_eos_inf=True bans EOS, but no tokenizer with an EOS id is known: pass tokenizer= "
                         "(or ban the id with banned_tokens=)")
    banned = _token_ids(banned_tokens, "banned_tokens") + ((int(eos),) if logits_eos_inf else ())
    for t in banned:
        if not 0 <= t < config.vocab_size:
            raise ValueError(f"banned_tokens has {t}, outside [0, vocab_size={config.vocab_size})")
    # [MASK] is never proposed: a committed mask id would read as still masked (a block
    # decoded until no mask is left would never end) and could reach the output
    banned = tuple(sorted(set(banned) | {int(config.mask_token_id)}))
    if config.delete_token_id is not None:  # an edit model's <|del|> is an edit, never a mask-diffusion token
        banned = tuple(sorted(set(banned) | {int(config.delete_token_id)}))
    if len(banned) >= config.vocab_size:  # nothing could be proposed
        raise ValueError(f"banned_tokens (with the mask id{', the delete id' if config.delete_token_id is not None else ''}"
                         f"{' and EOS' if logits_eos_inf else ''}) cover all {config.vocab_size} ids: no token could be "
                         "proposed")
    if isinstance(edit_rounds, bool) or not isinstance(edit_rounds, (int, np.integer)) or edit_rounds < 0:
        raise ValueError(f"edit_rounds={edit_rounds!r} is invalid: must be an int >= 0")
    unused = [name for name, v in (("edit_max_length", edit_max_length), ("edits_per_round", edits_per_round),
                                   ("edit_threshold", edit_threshold)) if v is not None]
    if unused and not edit_rounds:  # plain mask diffusion would run without a word
        raise ValueError(f"{', '.join(unused)} set without edit_rounds: they shape edit rounds, and there are none "
                         "(set edit_rounds >= 1)")
    if edit_rounds:
        if not config.next_token_head or config.delete_token_id is None:
            raise ValueError(f"edit_rounds={edit_rounds} needs an edit model: ModelConfig.next_token_head=True and "
                             f"delete_token_id set (got {config.next_token_head} and {config.delete_token_id})")
        if eos is None:
            raise ValueError("edit_rounds needs a tokenizer with an EOS id (it closes the response)")
        if cfg_scale:
            raise ValueError("edit_rounds run without guidance (cfg_scale=0)")
    edit_max_length = gen_length if edit_max_length is None else _positive_int("edit_max_length", edit_max_length)
    if edits_per_round is not None:
        edits_per_round = _positive_int("edits_per_round", edits_per_round)
    if edit_threshold is not None and (isinstance(edit_threshold, bool)
                                       or not isinstance(edit_threshold, (int, float, np.integer, np.floating))
                                       or not 0 <= edit_threshold <= 1):
        raise ValueError(f"edit_threshold={edit_threshold!r} is invalid: must be a number in [0, 1]")
    if edit_rounds and edit_max_length < gen_length:
        raise ValueError(f"edit_max_length={edit_max_length} is shorter than gen_length={gen_length}")
    longest = max(len(p) for p in token_lists)
    room = config.max_seq_len - gen_length - (edit_max_length + 1 - gen_length if edit_rounds else 0)
    P = max(longest, min(-(-longest // bucket) * bucket, room))  # bucket padding only where it fits
    if edit_rounds and P + edit_max_length + 1 > config.max_seq_len:
        raise ValueError(f"prompt ({longest} tokens, padded to {P}) + edit_max_length={edit_max_length} + the closing "
                         f"EOS exceeds ModelConfig.max_seq_len={config.max_seq_len}")
    if P + gen_length > config.max_seq_len:
        raise ValueError(f"prompt ({longest} tokens, padded to {P}) + gen_length={gen_length} exceeds "
                         f"ModelConfig.max_seq_len={config.max_seq_len}")
    pad = getattr(tokenizer, "pad_id", None) or 0
    if not 0 <= pad < config.vocab_size:
        raise ValueError(f"the tokenizer's pad_id={pad} is outside [0, vocab_size={config.vocab_size})")
    tokens = np.full((len(token_lists), P), pad, np.int32)
    mask = np.zeros((len(token_lists), P), bool)
    for i, p in enumerate(token_lists):
        tokens[i, P - len(p):], mask[i, P - len(p):] = p, True
    plan = _Plan(
        prompt_len=P, gen_length=gen_length, block_length=block_length, steps_per_block=steps_per_block,
        temperature=float(temperature), remasking=remasking, cfg_scale=float(cfg_scale),
        threshold=None if threshold is None else float(threshold), slow_fast=slow_fast, cache=cache,
        mask_id=int(config.mask_token_id), banned=banned,
    )
    if stop_tokens is None:
        stop_tokens = default_stop_tokens(tokenizer)
    stops = tuple(sorted(set(_token_ids(stop_tokens, "stop_tokens"))))
    bad = [t for t in stops if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens {bad} are outside [0, vocab_size={config.vocab_size})")
    if edit_rounds:
        plan = dataclasses.replace(plan, edit_rounds=int(edit_rounds), edit_max_length=edit_max_length,
                                   edits_per_round=edits_per_round,
                                   edit_threshold=None if edit_threshold is None else float(edit_threshold),
                                   delete_id=int(config.delete_token_id), eos_id=int(eos), stops=stops)
    rng = _check_rng(rng)
    graphdef, state = nnx.split(model)
    out, n_steps, n_forwards, flops, committed, mask_out, edits, rounds, row_steps = diffusion_tokens(
        graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), rng, plan=plan)
    out = np.asarray(out)

    def cut(rows: np.ndarray) -> list[list[int]]:
        ends = [next((i for i, t in enumerate(row) if t in stops), len(row)) for row in rows.tolist()]
        return [row[:end] for row, end in zip(rows.tolist(), ends)]

    completions = cut(out)
    texts = [tokenizer.decode(c) for c in completions] if tokenizer is not None else None
    n_steps = int(n_steps)
    return DiffusionResult(
        tokens=out, completions=completions, texts=texts, prompt_tokens=tokens, steps=n_steps,
        forwards=int(n_forwards), flops=float(flops),
        tokens_per_step=float(np.mean(np.asarray(committed))) / max(n_steps, 1),
        edit_rounds=int(rounds), edits=np.asarray(edits) if edit_rounds else None,
        mask_completions=cut(np.asarray(mask_out)) if edit_rounds else None, row_steps=np.asarray(row_steps),
    )

"""Beam search in one compiled loop: `beam_search_tokens` (``jaxlm.generate(..., num_beams=K)``).

Length-normalised beam search as HuggingFace ``generate(num_beams=K, do_sample=False)``
defines it, so the two can be compared token for token:

* each prompt keeps ``K`` running beams with ``s = sum_j log p~(y_j | y_<j)`` (``p~``: the
  model's log-softmax after the logits processors); beam 0 starts at 0 and the others at
  ``-inf``, so the first step expands one beam (the reference starts them at ``-1e9``: where
  fewer than ``K`` continuations have finite log-prob, under a grammar or a top-k
  processor, it returns copies of the best hypotheses scored about ``-1e9 / len``; here those
  slots stay empty: length 0, score ``-inf``);
* at step ``t`` the ``K * V`` continuations are ranked by ``s + log p~(v)`` and the best
  ``C = max(2, 1 + |stop_tokens|) * K`` kept, enough that ``K`` of them have not stopped;
* a candidate that ends in a stop token or reaches ``max_new_tokens`` is *finished*; if it
  ranks among the first ``K`` it competes for the ``K`` finished hypotheses with the
  length-normalised score ``s / (t + 1) ** length_penalty``;
* the best ``K`` unfinished candidates run on (their cache rows follow them);
* a prompt stops taking hypotheses once its ``K`` finished ones cannot be beaten by the best
  running beam: ``early_stopping=True`` as soon as ``K`` are finished; ``False`` when the best
  running score normalised at the current length is no better than the worst finished one;
  ``"never"`` the same with the longest possible length when ``length_penalty > 0`` (the
  exact criterion). Decoding ends when no prompt can improve, or at ``max_new_tokens``.

The large negative constant ``-1e9`` plays minus infinity where the reference uses it, so
ties and exhausted beams order the same way.

Under a grammar (`jaxlm.inference.grammar`, one per prompt) each beam carries its grammar
state: tokens the grammar does not allow get log-prob ``-inf`` (after the log-softmax and
before the logits processors, as in the sampler, so allowed tokens keep the model's own
log-probs and a top-k keeps the best allowed ones), the state follows the chosen token, and a
candidate whose grammar is complete is finished like one that ends in a stop token. As in the
reference, a candidate that reaches ``max_new_tokens`` is finished too, complete or not: its
text is then a prefix of a string of the grammar, as a sampled row cut by the budget is.
"""

from __future__ import annotations

import functools
import math
import numbers

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlm.inference.cache import KVCache
from jaxlm.inference.grammar.decoding import DeviceGrammar, advance, mask_logits
from jaxlm.inference.logits_processors import LogitsProcessor, compose

NEG = -1.0e9  # "minus infinity" for scores, as in the reference implementation
EARLY_STOPPING = (True, False, "never")


@struct.dataclass
class BeamRows:
    """What logits processors receive as ``state`` under beam search: the running beams as
    rows, one per row of logits (row ``b * K + k`` is beam ``k`` of prompt ``b``), with the
    fields of the sampler's `SamplingState` that processors read."""

    step: jax.Array  # [] int32
    tokens: jax.Array  # [B * K, N] each beam's tokens so far (pad after the step)
    logprobs: jax.Array  # [B * K, N]
    sampling_logprobs: jax.Array  # [B * K, N]
    lengths: jax.Array  # [B * K] int32: tokens so far (every running beam has ``step``)
    done: jax.Array  # [B * K] bool: always False (a beam that stops leaves the running set)
    prompt_lengths: jax.Array  # [B * K] int32
    logits: jax.Array  # [B * K, V]
    grammar_state: jax.Array | None = None  # [B * K] with grammar=


@struct.dataclass
class BeamState:
    """The beam loop's carry. Running beams and finished hypotheses of each prompt are
    ``[B, K, ...]``; the model sees ``B * K`` rows (row ``b * K + k`` is beam ``k`` of prompt
    ``b``); logits processors see them as `BeamRows`."""

    step: jax.Array  # [] int32: index of the token being chosen
    tokens: jax.Array  # [B, K, N] running beams' tokens (pad after the step)
    logprobs: jax.Array  # [B, K, N] log p_model of each running token
    sampling_logprobs: jax.Array  # [B, K, N] log p~ (after the processors) of each running token
    scores: jax.Array  # [B, K] running sums of log p~
    logits: jax.Array  # [B * K, V] next-token logits of the running beams
    cache: KVCache
    final_tokens: jax.Array  # [B, K, N] finished hypotheses, best first
    final_logprobs: jax.Array  # [B, K, N]
    final_sampling_logprobs: jax.Array  # [B, K, N]
    final_scores: jax.Array  # [B, K] length-normalised scores (NEG: empty slot)
    final_lengths: jax.Array  # [B, K] int32 tokens per hypothesis (stop token included)
    finished: jax.Array  # [B, K] bool: the slot holds a finished hypothesis
    improvable: jax.Array  # [B] bool: a running beam may still beat a finished one
    stalled: jax.Array  # [] bool: every candidate of the last step stopped
    grammar_state: jax.Array | None = None  # [B, K] int32 with grammar=: each running beam's state


def check_beam_settings(num_beams, length_penalty, early_stopping, num_return_sequences):
    """Clear errors for beam-search settings (field named, allowed values stated); returns
    them as Python values (numpy scalars included: ``np.True_`` is True, not a truthy value
    that the ``is True`` rule would read as False)."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
        raise ValueError(f"num_beams={num_beams!r} is invalid: must be a positive int (1: no beam search)")
    if not isinstance(length_penalty, numbers.Real) or isinstance(length_penalty, (bool, np.bool_)) \
            or not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty={length_penalty!r} is invalid: must be a finite float")
    if isinstance(early_stopping, np.bool_):
        early_stopping = bool(early_stopping)
    if not (early_stopping is True or early_stopping is False
            or (isinstance(early_stopping, str) and early_stopping == "never")):
        raise ValueError(f"early_stopping={early_stopping!r} is invalid: must be True, False or 'never'")
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, (int, np.integer)) \
            or not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"num_return_sequences={num_return_sequences!r} is invalid: must be an int in "
                         f"[1, num_beams={num_beams}]")
    return int(num_beams), float(length_penalty), early_stopping, int(num_return_sequences)


def _along_beams(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x [B, K, ...]`` gathered at ``index [B, C]`` along the beam axis -> ``[B, C, ...]``."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "num_beams", "max_new_tokens", "processors", "pad_id", "stop_tokens",
                     "cache_dtype", "length_penalty", "early_stopping", "num_return_sequences"),
)
def beam_search_tokens(
    graphdef,
    params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    *,
    num_beams: int,
    max_new_tokens: int,
    processors: tuple[LogitsProcessor, ...] = (),
    pad_id: int = 0,
    stop_tokens: tuple[int, ...] = (),
    cache_dtype: str | None = None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    condition=None,
    interventions=(),
    grammar: DeviceGrammar | None = None,
    grammar_start: jax.Array | None = None,
) -> BeamState:
    """Left-padded ``prompt_tokens [B, P]`` with ``prompt_mask`` -> the final `BeamState`; its
    ``final_*`` fields hold each prompt's ``num_beams`` hypotheses, best first (the caller
    keeps the first ``num_return_sequences``). ``condition`` and ``interventions`` are passed
    to every forward, as in `jaxlm.inference.sampler.generate_tokens`; ``grammar`` with
    ``grammar_start [B]`` constrains every beam of prompt ``b`` (module docstring)."""
    num_beams, length_penalty, early_stopping, num_return_sequences = check_beam_settings(
        num_beams, length_penalty, early_stopping, num_return_sequences)
    model = nnx.merge(graphdef, params)
    B, P = prompt_tokens.shape
    K, N = num_beams, max_new_tokens
    chex.assert_shape(prompt_mask, (B, P))
    process = compose(processors)
    stop = jnp.asarray(stop_tokens, jnp.int32) if stop_tokens else None
    C = max(2, 1 + len(stop_tokens)) * K  # candidates kept per step: K of them can always run on
    first_k = jnp.arange(C) < K

    # one buffer per layer for unrolled models, as in the sampler's decode loop
    cache = KVCache.init(model.config, B, P + N, cache_dtype, per_layer=not model.config.scan_layers)
    out = model.backbone(prompt_tokens, None, cache=cache, mask=prompt_mask, condition=condition,
                         interventions=interventions)
    rows = jnp.repeat(jnp.arange(B), K)  # every beam of prompt b starts from its prompt's cache
    prompt_lengths = jnp.repeat(prompt_mask.sum(1, dtype=jnp.int32), K)
    if condition is not None:
        condition = jax.tree.map(lambda x: jnp.repeat(x, K, axis=0), condition)
    zeros = jnp.zeros((B, K, N), jnp.float32)
    state = BeamState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.full((B, K, N), pad_id, jnp.int32),
        logprobs=zeros, sampling_logprobs=zeros,
        scores=jnp.where(jnp.arange(K) == 0, 0.0, -jnp.inf)[None].repeat(B, 0).astype(jnp.float32),
        logits=model.unembed(out.hidden[:, -1])[rows].astype(jnp.float32),
        cache=out.cache.take_rows(rows),
        final_tokens=jnp.full((B, K, N), pad_id, jnp.int32),
        final_logprobs=zeros, final_sampling_logprobs=zeros,
        final_scores=jnp.full((B, K), NEG, jnp.float32),
        final_lengths=jnp.zeros((B, K), jnp.int32),
        finished=jnp.zeros((B, K), bool),
        improvable=jnp.ones((B,), bool),
        stalled=jnp.zeros((), bool),
        grammar_state=None if grammar is None else jnp.repeat(jnp.asarray(grammar_start, jnp.int32)[:, None], K, 1),
    )

    def choose(s: BeamState) -> BeamState:
        t = s.step
        V = s.logits.shape[-1]
        model_lp = jax.nn.log_softmax(s.logits, axis=-1)
        as_rows = lambda x: x.reshape(B * K, *x.shape[2:])  # noqa: E731
        # the grammar masks first, as in the sampler: a processor (top-k) then ranks allowed tokens only
        allowed_lp = model_lp if grammar is None else mask_logits(grammar, s.grammar_state.reshape(-1), model_lp)
        lp = process(allowed_lp, BeamRows(
            step=t, tokens=as_rows(s.tokens), logprobs=as_rows(s.logprobs),
            sampling_logprobs=as_rows(s.sampling_logprobs), lengths=jnp.full((B * K,), t, jnp.int32),
            done=jnp.zeros((B * K,), bool), prompt_lengths=prompt_lengths, logits=s.logits,
            grammar_state=None if s.grammar_state is None else s.grammar_state.reshape(-1)))
        lp = lp.astype(jnp.float32).reshape(B, K, V)
        total = (lp + s.scores[..., None]).reshape(B, K * V)
        cand_scores, flat = jax.lax.top_k(total, C)  # [B, C], best first
        src, tok = flat // V, flat % V
        pick = lambda x: jnp.take_along_axis(x.reshape(B, K * V), flat, axis=1)  # noqa: E731

        def extend(history, new):  # the source beams' histories with column t set to ``new``
            h = _along_beams(history, src)
            return jax.lax.dynamic_update_slice_in_dim(h, new[..., None].astype(h.dtype), t, axis=2)

        cand_tokens = extend(s.tokens, tok)
        cand_lp = extend(s.logprobs, pick(model_lp))
        cand_slp = extend(s.sampling_logprobs, pick(lp))
        hits = jnp.broadcast_to(t + 1 >= N, (B, C))
        if stop is not None:
            hits = hits | jnp.isin(tok, stop)
        if grammar is not None:
            # a candidate drawn from -inf (fewer allowed continuations than C) is dead: its state
            # is clamped to a valid index and its score stays -inf, so it never finishes
            cand_state = jnp.maximum(advance(grammar, _along_beams(s.grammar_state, src), tok), 0)
            hits = hits | grammar.terminal[cand_state]

        # the best K candidates that did not stop run on; where fewer than K did not stop, the
        # rest are dead (-inf), not finished hypotheses extended past their end
        run_scores = jnp.where(hits, -jnp.inf, cand_scores)
        keep = jax.lax.top_k(run_scores, K)[1]
        # finished candidates among the first K compete with the finished hypotheses
        norm = cand_scores / ((t + 1).astype(jnp.float32) ** length_penalty)
        if early_stopping is True:
            norm = norm + NEG * jnp.all(s.finished, axis=1, keepdims=True)
        new_final = hits & first_k[None]
        norm = norm + NEG * ~s.improvable[:, None] + NEG * ~new_final
        merged = jnp.concatenate([s.final_scores, norm], axis=1)
        best = jax.lax.top_k(merged, K)[1]

        def merge(old, new):
            return _along_beams(jnp.concatenate([old, new], axis=1), best)

        scores = _along_beams(run_scores, keep)
        final_scores = merge(s.final_scores, norm)
        finished = merge(s.finished, new_final)
        lengths = merge(s.final_lengths, jnp.broadcast_to(t + 1, (B, C)).astype(jnp.int32))
        # can a running beam still beat the worst finished hypothesis?
        horizon = N if (early_stopping == "never" and length_penalty > 0) else t + 1
        best_running = scores[:, :1] / (jnp.asarray(horizon, jnp.float32) ** length_penalty)
        worst_final = jnp.where(finished, jnp.min(final_scores, axis=1, keepdims=True), NEG)
        improvable = s.improvable & jnp.any(best_running > worst_final, axis=1)
        beam_rows = (jnp.arange(B)[:, None] * K + _along_beams(src, keep)).reshape(-1)
        return s.replace(
            step=t + 1,
            tokens=_along_beams(cand_tokens, keep),
            logprobs=_along_beams(cand_lp, keep),
            sampling_logprobs=_along_beams(cand_slp, keep),
            scores=scores,
            cache=s.cache.take_rows(beam_rows),
            final_tokens=merge(s.final_tokens, cand_tokens),
            final_logprobs=merge(s.final_logprobs, cand_lp),
            final_sampling_logprobs=merge(s.final_sampling_logprobs, cand_slp),
            final_scores=final_scores,
            final_lengths=lengths,
            finished=finished,
            improvable=improvable,
            stalled=jnp.all(hits),
            grammar_state=None if grammar is None else _along_beams(cand_state, keep),
        )

    def cond(s: BeamState):
        going = (s.step < N) & jnp.any(s.improvable) & ~s.stalled
        if early_stopping is True:
            going = going & ~jnp.all(s.finished)
        return going

    def body(s: BeamState) -> BeamState:
        last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=2).reshape(B * K, 1)
        out = model.backbone(last, None, cache=s.cache, condition=condition, interventions=interventions)
        return choose(s.replace(logits=model.unembed(out.hidden[:, 0]).astype(jnp.float32), cache=out.cache))

    return jax.lax.while_loop(cond, body, choose(state))

"""`generate`: batched sampling with a KV cache, prefill then a `lax.while_loop` inside `jit`.

Prompts of different lengths are left-padded into one ``[B, P]`` block and
prefilled in one pass; decoding then writes one token per step into the cache
(`jaxlm.inference.cache.KVCache`) until every sequence has hit a stop token or
``max_new_tokens``. The whole loop is one compiled program over
``(graphdef, params)`` (split once, merged inside `jit`), compiled once per
(shapes, settings) and reused.

Two log-probabilities are returned per generated token:
``logprobs`` under the model's own distribution (raw logits, what a fresh forward
pass gives and what RL ratios need) and ``sampling_logprobs`` under the processed
distribution the token was actually drawn from (temperature/top-k/top-p/masks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlm.dtypes import optional_dtype_name
from jaxlm.inference.beam_search import beam_search_tokens, check_beam_settings
from jaxlm.inference.cache import KVCache, batch_axis
from jaxlm.inference.early_exit import ExitWindow, early_exit_generate_tokens
from jaxlm.inference.grammar.decoding import (
    DeviceGrammar,
    advance,
    check_stop_tokens,
    mask_logits,
    merge_tables,
)
from jaxlm.inference.grammar.tables import BITMASK_LIMIT
from jaxlm.inference.logits_processors import LogitsProcessor, Temperature, TopK, TopP, compose
from jaxlm.inference.sampling import _select, categorical_and_logsumexp, sample_categorical  # noqa: F401
from jaxlm.inference.speculative import check_draft, speculative_generate_tokens


@struct.dataclass
class SamplingState:
    """The decode loop's carry; logits processors receive it as ``state``."""

    step: jax.Array  # [] int32: index of the token being chosen
    tokens: jax.Array  # [B, N] generated so far (pad after stop)
    logprobs: jax.Array  # [B, N] float32
    sampling_logprobs: jax.Array  # [B, N] float32
    lengths: jax.Array  # [B] int32 generated tokens so far (stop token included)
    done: jax.Array  # [B] bool
    prompt_lengths: jax.Array  # [B] int32
    logits: jax.Array  # [B, V] float32 next-token logits
    cache: KVCache | None  # None in a final state from ``return_cache=False``
    rng: jax.Array
    grammar_state: jax.Array | None = None  # [B] int32 with grammar=: each row's grammar state


@dataclasses.dataclass
class GenerateResult:
    tokens: jax.Array  # [B, N] generated ids, pad_id after each sequence's end
    logprobs: jax.Array  # [B, N] log p_model(token | prefix), 0 after the end
    sampling_logprobs: jax.Array  # [B, N] log-prob under the processed sampling distribution
    lengths: jax.Array  # [B] generated tokens per sequence (stop token included)
    prompt_tokens: jax.Array  # [B, P] left-padded prompts
    prompt_lengths: jax.Array  # [B]
    texts: list[str] | None = None  # decoded completions when a tokenizer is known
    accepted_lengths: jax.Array | None = None  # speculative: [B, N] drafts accepted per verify round (-1 after)
    verify_rounds: jax.Array | None = None  # speculative: [B] target verify rounds per row
    exit_layers: jax.Array | None = None  # early exit: [B, N] layers run for each token (0 after the end)
    beam_scores: jax.Array | None = None  # beam search: [B * R] length-normalised score of each hypothesis (-inf: none)

    def completions(self) -> list[list[int]]:
        tokens, lengths = np.asarray(self.tokens), np.asarray(self.lengths)
        return [tokens[b, : lengths[b]].tolist() for b in range(tokens.shape[0])]

    def sequences(self) -> list[list[int]]:
        """Prompt + completion per row, without padding."""
        prompts, plens = np.asarray(self.prompt_tokens), np.asarray(self.prompt_lengths)
        P = prompts.shape[1]
        return [prompts[b, P - plens[b]:].tolist() + c for b, c in enumerate(self.completions())]


#: `auto_decode_segments`: one decode segment per this many bytes of keys and values at full
#: length (below it the whole cache is cheap to read and a split only adds compilation)
SEGMENT_CACHE_BYTES = 4 << 20
#: `auto_decode_segments`: at most this many segments (each is one more compiled loop body),
#: and each at least `MIN_SEGMENT_TOKENS` long
MAX_DECODE_SEGMENTS = 4
MIN_SEGMENT_TOKENS = 32


def segment_ends(max_new_tokens: int, segments: int) -> tuple[int, ...]:
    """Token counts at which each of ``segments`` decode loops ends: ``max_new_tokens`` split
    into equal parts (the last one ends at ``max_new_tokens``), e.g. ``(32, 64, 96, 128)``."""
    if isinstance(segments, (bool, np.bool_)) or not isinstance(segments, (int, np.integer)) or segments < 1:
        raise ValueError(f"decode_segments={segments!r} is invalid: must be a positive int or None (automatic)")
    if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:  # no segment at all: generate_tokens failed on ends[0]
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive int")
    segments = min(int(segments), max_new_tokens)
    return tuple(-(-max_new_tokens * (j + 1) // segments) for j in range(segments))


def auto_decode_segments(config, rows: int, prompt_len: int, max_new_tokens: int, cache_dtype=None) -> int:
    """How many segments `generate_tokens` splits a decode loop into by default: one per
    `SEGMENT_CACHE_BYTES` of keys and values at full length, at most `MAX_DECODE_SEGMENTS`
    and at least `MIN_SEGMENT_TOKENS` tokens each. Small caches (batch 1, tests) keep one
    loop; with ``k`` segments a step reads on average ``(P + N (k + 1) / 2k) / (P + N)`` of
    the cache instead of all of it (decode attention is bound by reading the cache)."""
    itemsize = jnp.dtype(config.dtype if cache_dtype is None else cache_dtype).itemsize
    widths = sum(config.layer_config(i).qk_head_dim + config.layer_config(i).v_head_dim
                 for i in range(config.n_layers))
    cache_bytes = rows * config.n_kv_heads * (prompt_len + max_new_tokens) * widths * itemsize
    by_size = -(-cache_bytes // SEGMENT_CACHE_BYTES)
    return int(max(1, min(MAX_DECODE_SEGMENTS, by_size, max_new_tokens // MIN_SEGMENT_TOKENS)))


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "processors", "greedy", "pad_id", "stop_tokens", "cache_dtype",
                     "samples_per_prompt", "decode_segments", "return_cache"),
)
def generate_tokens(
    graphdef,
    params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    processors: tuple[LogitsProcessor, ...] = (),
    greedy: bool = False,
    pad_id: int = 0,
    stop_tokens: tuple[int, ...] = (),
    cache_dtype: str | None = None,
    condition=None,
    interventions=(),
    samples_per_prompt: int = 1,
    grammar: DeviceGrammar | None = None,
    grammar_start: jax.Array | None = None,
    prompt_embeds: jax.Array | None = None,
    prompt_positions: jax.Array | None = None,
    decode_segments: int | None = None,
    return_cache: bool = True,
) -> SamplingState:
    """The jittable core: left-padded ``prompt_tokens [B, P]`` with ``prompt_mask`` -> final state.
    ``condition`` (ids ``[B, C]`` or ``(ids, mask)``) is passed to every forward (MeGan), and so
    are ``interventions`` (`jaxlm.interp.Intervention`: steering, ablation, head masks).
    ``samples_per_prompt = G``: each prompt is prefilled once and its cache repeated, giving
    ``B * G`` rows (row ``b * G + g`` continues prompt ``b``), e.g. GRPO's groups.
    ``grammar`` (`DeviceGrammar`) with ``grammar_start [B]``: constrained decoding; the mask
    is applied before the processors and a row stops when its grammar is complete.
    ``prompt_embeds [B, P, D]`` (a multimodal front end's spliced inputs, `jaxlm.models.omni`)
    replace the prompt's token lookup; ``prompt_positions [B, P]`` or ``[B, P, 3]``
    (``rope="mrope"``) are the prompt's positions, and generated tokens continue from the
    largest one + 1 on every axis.
    ``decode_segments``: the decode runs as this many consecutive loops (`segment_ends`) and
    the cache grows between them, so a step's attention reads only the slots its segment can
    reach instead of all ``P + max_new_tokens`` (None: `auto_decode_segments`). The tokens
    are the same for any number of segments.
    ``return_cache=False``: the final state's ``cache`` is None, so the program neither
    restacks nor returns the keys and values (`generate` needs only the tokens)."""
    model = nnx.merge(graphdef, params)
    B, P = prompt_tokens.shape
    N = max_new_tokens
    chex.assert_shape(prompt_mask, (B, P))
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt={samples_per_prompt} must be >= 1")
    process = compose(processors)
    stop = jnp.asarray(stop_tokens, jnp.int32) if stop_tokens else None

    # one buffer per layer (unrolled models): each layer's keys/values are updated in place and
    # read by the attention matmuls directly, never sliced out of a stacked [L, ...] array
    per_layer = not model.config.scan_layers
    if decode_segments is None:
        decode_segments = auto_decode_segments(model.config, B * samples_per_prompt, P, N, cache_dtype)
    ends = segment_ends(N, decode_segments)
    # segment j writes tokens up to ends[j] - 2 (the last chosen token is fed in the next one)
    cache = KVCache.init(model.config, B, P + ends[0], cache_dtype, per_layer=per_layer)
    out = model.backbone(
        prompt_tokens, prompt_positions, cache=cache, mask=prompt_mask, condition=condition,
        interventions=interventions, embeds=prompt_embeds,
    )
    last_hidden = out.hidden[:, -1]
    # generated token j of a row sits at position offset + (cache length before it)
    offset = None
    if prompt_positions is not None:
        pos = prompt_positions if prompt_positions.ndim == 3 else prompt_positions[..., None]
        top = jnp.max(jnp.where(prompt_mask[..., None], pos, -1), axis=(1, 2))
        offset = top + 1 - prompt_mask.sum(axis=1, dtype=jnp.int32)
    if samples_per_prompt > 1:
        G = samples_per_prompt
        c = out.cache
        out = out.replace(cache=c.replace(
            k=jax.tree.map(lambda x: jnp.repeat(x, G, axis=batch_axis(x)), c.k),
            v=jax.tree.map(lambda x: jnp.repeat(x, G, axis=batch_axis(x)), c.v),
            valid=jnp.repeat(c.valid, G, axis=0), lengths=jnp.repeat(c.lengths, G, axis=0),
        ))
        last_hidden = jnp.repeat(last_hidden, G, axis=0)
        prompt_mask = jnp.repeat(prompt_mask, G, axis=0)
        if condition is not None:
            condition = jax.tree.map(lambda x: jnp.repeat(x, G, axis=0), condition)
        if grammar_start is not None:
            grammar_start = jnp.repeat(grammar_start, G, axis=0)
        if offset is not None:
            offset = jnp.repeat(offset, G, axis=0)
        B = B * G
    start_state = None if grammar is None else jnp.broadcast_to(jnp.asarray(grammar_start, jnp.int32), (B,))
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.full((B, N), pad_id, jnp.int32),
        logprobs=jnp.zeros((B, N), jnp.float32),
        sampling_logprobs=jnp.zeros((B, N), jnp.float32),
        lengths=jnp.zeros((B,), jnp.int32),
        # a grammar whose start is already complete (its only string is empty) allows no token
        done=jnp.zeros((B,), bool) if grammar is None else grammar.terminal[start_state],
        prompt_lengths=prompt_mask.sum(axis=1, dtype=jnp.int32),
        logits=model.unembed(last_hidden),
        cache=out.cache,
        rng=rng,
        grammar_state=start_state,
    )

    def choose(s: SamplingState) -> SamplingState:
        rng, key = (s.rng, None) if greedy else jax.random.split(s.rng)  # greedy draws nothing
        logits = s.logits if grammar is None else mask_logits(grammar, s.grammar_state, s.logits)
        token, lp, slp = _select(s.logits, process(logits, s), key, greedy, same=not processors and grammar is None)
        token = jnp.where(s.done, pad_id, token)
        lp, slp = jnp.where(s.done, 0.0, lp), jnp.where(s.done, 0.0, slp)
        col = (0, s.step)
        done = s.done if stop is None else s.done | jnp.isin(token, stop)
        grammar_state = s.grammar_state
        if grammar is not None:
            grammar_state = jnp.where(s.done, grammar_state, advance(grammar, grammar_state, token))
            done = done | grammar.terminal[grammar_state]
        return s.replace(
            grammar_state=grammar_state,
            tokens=jax.lax.dynamic_update_slice(s.tokens, token[:, None], col),
            logprobs=jax.lax.dynamic_update_slice(s.logprobs, lp[:, None], col),
            sampling_logprobs=jax.lax.dynamic_update_slice(s.sampling_logprobs, slp[:, None], col),
            lengths=s.lengths + (~s.done).astype(jnp.int32),
            done=done,
            step=s.step + 1,
            rng=rng,
        )

    def cond(s: SamplingState, end: int):
        return (s.step < end) & ~jnp.all(s.done)

    def body(s: SamplingState) -> SamplingState:
        last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
        positions = None
        if offset is not None:
            positions = (s.cache.lengths + offset)[:, None]
            if prompt_positions.ndim == 3:
                positions = jnp.repeat(positions[..., None], prompt_positions.shape[-1], axis=-1)
        out = model.backbone(last, positions, cache=s.cache, condition=condition, interventions=interventions)
        return choose(s.replace(logits=model.unembed(out.hidden[:, 0]), cache=out.cache))

    final = choose(state)
    for j, end in enumerate(ends):
        if j:
            final = final.replace(cache=final.cache.grow(P + end))
        final = jax.lax.while_loop(functools.partial(cond, end=end), body, final)
    if not return_cache:
        return final.replace(cache=None)
    if per_layer and not model.config.per_layer_kv:
        final = final.replace(cache=final.cache.stacked())  # the model's own cache layout
    return final


def _token_id(value, where: str) -> int:
    """An int, a numpy integer or a 0-d integer array (numpy or JAX) as an int."""
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer):
        return int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where} holds {value!r} ({type(value).__name__}): token ids must be ints")
    return int(value)


def _as_token_lists(prompts, tokenizer, add_bos: bool) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray) or isinstance(prompts, jax.Array):
        if prompts.ndim != 2:
            raise ValueError(f"prompts array must be [B, P], got shape {prompts.shape}")
        if not jnp.issubdtype(prompts.dtype, jnp.integer):
            raise TypeError(f"prompts array has dtype {prompts.dtype}: token ids must be integers")
        return [list(map(int, row)) for row in np.asarray(prompts)]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(
                    f"prompt {i} is text but no tokenizer is known: pass tokenizer= or token ids"
                )
            p = tokenizer.encode(p, add_bos=add_bos)
        elif isinstance(p, (int, np.integer)):
            raise TypeError(f"prompts[{i}] is the id {p!r}: prompts is a list of prompts (texts or token-id "
                            "lists); wrap one prompt's ids as [[...]]")
        elif isinstance(p, (np.ndarray, jax.Array)) and not jnp.issubdtype(p.dtype, jnp.integer):
            raise TypeError(f"prompt {i} has dtype {p.dtype}: token ids must be integers")
        out.append([_token_id(t, f"prompt {i}") for t in p])
    return out


def _token_ids(value, name: str) -> tuple[int, ...]:
    """A sequence of token ids (``stop_tokens=``, ``banned_tokens=``) as ints."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name}={value!r} is invalid: must be a sequence of token ids (e.g. ({value!r},))")
    return tuple(_token_id(t, name) for t in value)


def _check_rng(rng):
    """An int seed (Python or numpy) or a JAX key -> a JAX key."""
    if rng is None:
        rng = 0
    if isinstance(rng, (bool, np.bool_)):
        raise TypeError(f"rng={rng!r} is invalid: pass an int seed or a jax.random key")
    if isinstance(rng, (int, np.integer)):
        return jax.random.key(int(rng))
    if isinstance(rng, np.ndarray) and rng.dtype == np.uint32:  # a raw key held in numpy
        return jnp.asarray(rng)
    if not isinstance(rng, jax.Array):
        raise TypeError(f"rng={rng!r} is invalid: pass an int seed or a jax.random key")
    return rng


def _check_bucket(bucket) -> int:
    if isinstance(bucket, (bool, np.bool_)) or not isinstance(bucket, (int, np.integer)) or bucket <= 0:
        raise ValueError(f"bucket={bucket!r} is invalid: must be a positive int")
    return int(bucket)


def _is_number(x) -> bool:
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, float, np.integer, np.floating))


def default_stop_tokens(tokenizer) -> tuple[int, ...]:
    """The ids that end a sequence by default: the tokenizer's ``stop_ids`` (EOS and any
    other end-of-sequence ids its checkpoint lists), else its ``eos_id``, else none."""
    ids = getattr(tokenizer, "stop_ids", None)
    if ids is not None:
        return tuple(int(i) for i in ids)
    eos = getattr(tokenizer, "eos_id", None)
    return () if eos is None else (int(eos),)


def generate(
    model,
    prompts: Sequence[Sequence[int]] | Sequence[str] | str,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: jax.Array | int | None = None,
    stop_tokens: Sequence[int] | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    tokenizer: Any = None,
    add_bos: bool = True,
    pad_id: int | None = None,
    cache_dtype: Any = None,
    bucket: int = 8,
    condition=None,
    interventions=(),
    draft=None,
    num_draft_tokens: int = 4,
    early_exit=None,
    grammar=None,
    decode_segments: int | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
) -> GenerateResult:
    """Sample up to ``max_new_tokens`` for each prompt.

    prompts: token-id lists of any lengths, or text (encoded with ``tokenizer``,
      else ``model.tokenizer``; BOS prepended when ``add_bos`` and the tokenizer has one).
    temperature: 0 means greedy (argmax of the processed logits).
    stop_tokens: ids that end a sequence (default: the tokenizer's `stop_ids`, its EOS and
        any other end-of-sequence ids its checkpoint lists).
    logits_processors: applied first, in order, before temperature, top-k, top-p.
    cache_dtype: the KV cache's dtype, a name or a jnp/numpy dtype (default: the model's).
    bucket: prompt blocks are left-padded to a multiple of this to reuse compilations.
    condition: token ids ``[B, C]`` (or ``(ids, mask)``) of a MeGan model's condition text.
    interventions: `jaxlm.interp.Intervention` s applied in every forward (e.g. steering
      with ``where="last"`` adds at the last prompt token and at each new token).
    draft: speculative decoding (`jaxlm.inference.speculative`): a small jaxlm model sharing
      the tokenizer, or `MedusaHeads` on this model's hidden states. It proposes
      ``num_draft_tokens`` tokens per round and the model verifies them in one forward;
      the output is distributed exactly as without a draft (token for token at
      temperature 0). ``accepted_lengths`` / ``verify_rounds`` report the acceptance.
    early_exit: a `jaxlm.inference.early_exit.ExitWindow` (WAVE): tokens may leave the model
      inside the window through a proxy head; ``exit_layers`` reports the layers each ran.
    grammar: a `jaxlm.inference.grammar.CompiledGrammar` for every row, or a list with one
      per prompt (None: that row is free). Tokens the grammar does not allow are masked
      before the processors; a stop token is allowed only where the grammar is complete (one
      the grammar reads as text before it is complete is refused); a row whose grammar is
      complete stops. The grammar's state lives in the decode loop.
    decode_segments: run the decode loop as this many consecutive loops over a growing KV
      cache, so each step's attention reads only the slots reachable so far (None: chosen
      from the cache's size, `auto_decode_segments`; 1: one loop over the full cache). The
      output does not depend on it.
    num_beams: > 1 decodes by beam search (`jaxlm.inference.beam_search`) instead of
      sampling: deterministic, so ``temperature`` must stay 0 or 1 and ``top_k`` / ``top_p``
      unset; ``logits_processors`` apply to the log-probs the beams are ranked by. Hypotheses
      are scored ``sum log p / len ** length_penalty``; ``early_stopping`` (True, False or
      "never") says when a prompt stops looking for better ones, as in HF ``generate``. The
      result has ``num_return_sequences`` rows per prompt (row ``b * R + r`` is prompt
      ``b``'s ``r``-th best), with their scores in ``beam_scores``; where fewer than ``R``
      hypotheses exist (a grammar or a top-k leaves too few continuations) the remaining
      rows are empty (length 0, score -inf). With ``grammar=``
      disallowed tokens get log-prob -inf before the processors: a hypothesis that ended
      by completing the grammar or by a stop token is in its language, one cut by
      ``max_new_tokens`` is a prefix of a string in it (as a sampled row cut there is).
    """
    config = model.config
    if getattr(config, "mode", "causal") == "diffusion":
        raise ValueError("generate decodes causal models left to right; this model is a masked diffusion LM "
                         "(ModelConfig.mode='diffusion'): use jaxlm.diffusion_generate")
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    token_lists = _as_token_lists(prompts, tokenizer, add_bos)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive int")
    max_new_tokens = int(max_new_tokens)  # a static argument: numpy scalars become Python ints
    for i, p in enumerate(token_lists):
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids {bad[:5]} outside [0, vocab_size={config.vocab_size})"
            )
    longest = max(map(len, token_lists))
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt length {longest} + max_new_tokens {max_new_tokens} = "
            f"{longest + max_new_tokens} exceeds ModelConfig.max_seq_len={config.max_seq_len}"
        )
    cache_dtype = optional_dtype_name(cache_dtype, field="generate(cache_dtype)")
    if not _is_number(temperature) or not 0 <= temperature < np.inf:
        raise ValueError(f"temperature={temperature!r} is invalid: must be a finite number >= 0 (0 = greedy)")
    temperature = float(temperature)
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):  # True == 1 skipped the filter
        raise ValueError(f"top_p={top_p!r} is invalid: must be a number in (0, 1] or None")
    bucket = _check_bucket(bucket)

    if stop_tokens is None:
        stop_tokens = default_stop_tokens(tokenizer)
    stop_tokens = _token_ids(stop_tokens, "stop_tokens")
    bad = [t for t in stop_tokens if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens {bad} are outside [0, vocab_size={config.vocab_size})")
    if pad_id is None:
        pad_id = getattr(tokenizer, "pad_id", None)
        pad_id = 0 if pad_id is None else pad_id
    pad_id = _token_id(pad_id, "pad_id")
    if not 0 <= pad_id < config.vocab_size:  # an id outside the embedding would read NaN into every row
        raise ValueError(f"pad_id={pad_id} is outside [0, vocab_size={config.vocab_size})"
                         + (" (from the tokenizer)" if tokenizer is not None else ""))
    for i, p in enumerate(logits_processors):
        try:
            hash(p)
        except TypeError:
            raise TypeError(f"logits_processors[{i}] ({type(p).__name__}) is not hashable: processors are static "
                            "arguments of the compiled decode loop; make it a frozen dataclass") from None

    processors = list(logits_processors)
    greedy = temperature == 0
    if not greedy and temperature != 1:
        processors.append(Temperature(float(temperature)))
    if top_k is not None:
        processors.append(TopK(top_k))
    if top_p is not None and top_p != 1:
        processors.append(TopP(float(top_p)))

    room = config.max_seq_len - max_new_tokens
    if draft is not None:
        if condition is not None or interventions:
            raise ValueError("draft= does not combine with condition= or interventions= (the draft would not "
                             "see them)")
        # the verify step writes num_draft_tokens slots past the last token, in every model's cache
        room = check_draft(model, draft, num_draft_tokens, longest_prompt=longest, max_new_tokens=max_new_tokens,
                           tokenizer=tokenizer) - max_new_tokens - num_draft_tokens
    P = -(-longest // bucket) * bucket
    P = max(longest, min(P, room))
    B = len(token_lists)
    block = np.full((B, P), pad_id, np.int32)
    mask = np.zeros((B, P), bool)
    for b, p in enumerate(token_lists):
        block[b, P - len(p):] = p
        mask[b, P - len(p):] = True

    interventions = (interventions,) if hasattr(interventions, "site") else tuple(interventions)
    for i, iv in enumerate(interventions):
        if getattr(iv, "where", None) == "mask":
            raise ValueError(
                f"interventions[{i}] uses a [B, T] position mask, which has no meaning while "
                "decoding: use where='last' or where='all' with generate"
            )
    rng = _check_rng(rng)
    num_beams, length_penalty, early_stopping, num_return_sequences = check_beam_settings(
        num_beams, length_penalty, early_stopping, num_return_sequences)
    if num_beams > 1:
        if draft is not None or early_exit is not None or decode_segments is not None:
            raise ValueError("num_beams > 1 does not combine with draft=, early_exit= or decode_segments=")
        if temperature not in (0, 1) or top_k is not None or top_p not in (None, 1):
            raise ValueError(f"num_beams={num_beams} is deterministic beam search: temperature={temperature!r}, "
                             f"top_k={top_k!r} and top_p={top_p!r} would be ignored (leave temperature 0 or 1 "
                             "and top_k / top_p unset)")
    if draft is not None and logits_processors:
        # a round drafts and verifies several positions from one state: a processor reading the
        # tokens so far or the step (a repetition penalty, a ban for the first steps) would see
        # the round's start at every position, and the output would not be distributed as without
        # the draft; temperature, top_k and top_p read no state and combine
        raise ValueError("logits_processors= do not combine with draft= yet (a processor may read the sampler's "
                         "state, which a speculative round does not advance per drafted token); use temperature, "
                         "top_k and top_p, or decode without the draft")
    grammar_kw = {}
    if grammar is not None:
        if draft is not None or early_exit is not None:
            raise ValueError("grammar= does not combine with draft= or early_exit= yet")
        rows = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * B
        if len(rows) != B:
            raise ValueError(f"grammar= has {len(rows)} entries for {B} prompts: pass one grammar or one per prompt")
        check_stop_tokens(rows, stop_tokens)
        device_grammar, starts = merge_tables(rows, config.vocab_size, BITMASK_LIMIT)
        grammar_kw = dict(grammar=device_grammar, grammar_start=jnp.asarray(starts))
    if num_beams > 1:
        return _beam_search(model, block, mask, tokenizer, num_beams=num_beams, max_new_tokens=max_new_tokens,
                            processors=tuple(logits_processors), pad_id=pad_id, stop_tokens=stop_tokens,
                            cache_dtype=cache_dtype, length_penalty=float(length_penalty),
                            early_stopping=early_stopping, num_return_sequences=num_return_sequences,
                            condition=condition, interventions=interventions, **grammar_kw)
    if decode_segments is not None:
        segment_ends(max_new_tokens, decode_segments)  # validates
        decode_segments = int(decode_segments)  # a static argument of the compiled loop
        if draft is not None or early_exit is not None:
            raise ValueError("decode_segments= applies to the plain decode loop, not with draft= or early_exit=")
    if early_exit is not None:
        return _early_exit(model, early_exit, block, mask, rng, tokenizer, draft=draft, condition=condition,
                           interventions=interventions, max_new_tokens=max_new_tokens, processors=tuple(processors),
                           greedy=greedy, pad_id=pad_id, stop_tokens=stop_tokens, cache_dtype=cache_dtype)
    if draft is not None:
        return _speculative(model, draft, num_draft_tokens, block, mask, rng, tokenizer,
                            max_new_tokens=max_new_tokens, processors=tuple(processors), greedy=greedy,
                            pad_id=pad_id, stop_tokens=stop_tokens, cache_dtype=cache_dtype)
    graphdef, params = nnx.split(model)
    final = generate_tokens(
        graphdef, params, jnp.asarray(block), jnp.asarray(mask), rng,
        max_new_tokens=max_new_tokens, processors=tuple(processors), greedy=greedy,
        pad_id=pad_id, stop_tokens=stop_tokens, cache_dtype=cache_dtype, condition=condition,
        interventions=interventions, decode_segments=decode_segments, return_cache=False, **grammar_kw,
    )
    result = GenerateResult(
        tokens=final.tokens,
        logprobs=final.logprobs,
        sampling_logprobs=final.sampling_logprobs,
        lengths=final.lengths,
        prompt_tokens=jnp.asarray(block),
        prompt_lengths=final.prompt_lengths,
    )
    if tokenizer is not None:
        result.texts = [tokenizer.decode(c) for c in result.completions()]
    return _checked(result)


def _checked(result: GenerateResult) -> GenerateResult:
    """Refuse a result holding a token drawn from a distribution with no finite mass: every
    logit of that step was -inf (the logits processors, the grammar or top-k / top-p masked
    every token) or NaN. The sampler would return an arbitrary token with a NaN log-prob there
    (HF's ``generate`` raises in ``torch.multinomial`` for the same reason)."""
    slp, lengths = np.asarray(result.sampling_logprobs), np.asarray(result.lengths)
    live = np.arange(slp.shape[1])[None, :] < lengths[:, None]
    bad = live & ~np.isfinite(slp)
    if bad.any():
        row, step = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"generate: row {row}, generated token {step} was drawn from a distribution with no finite mass: every "
            "next-token logit was -inf (the logits processors, the grammar, or top_k / top_p allowed no token) or NaN "
            f"({int(bad.any(axis=1).sum())} row(s) affected)")
    return result


def _beam_search(model, block, mask, tokenizer, *, num_return_sequences, **kw) -> GenerateResult:
    graphdef, params = nnx.split(model)
    final = beam_search_tokens(graphdef, params, jnp.asarray(block), jnp.asarray(mask),
                               num_return_sequences=num_return_sequences, **kw)
    R = num_return_sequences
    flat = lambda x: x[:, :R].reshape((-1,) + x.shape[2:])  # noqa: E731
    result = GenerateResult(
        tokens=flat(final.final_tokens), logprobs=flat(final.final_logprobs),
        sampling_logprobs=flat(final.final_sampling_logprobs), lengths=flat(final.final_lengths),
        prompt_tokens=jnp.repeat(jnp.asarray(block), R, axis=0),
        prompt_lengths=jnp.repeat(jnp.asarray(mask).sum(axis=1, dtype=jnp.int32), R),
        # a slot no hypothesis reached (fewer strings than beams under a grammar or a top-k) is empty
        beam_scores=flat(jnp.where(final.finished, final.final_scores, -jnp.inf)),
    )
    if tokenizer is not None:
        result.texts = [tokenizer.decode(c) for c in result.completions()]
    return _checked(result)


def _speculative(model, draft, num_draft_tokens, block, mask, rng, tokenizer, *, max_new_tokens,
                 **kw) -> GenerateResult:
    graphdef, params = nnx.split(model)
    draft_graphdef, draft_params = nnx.split(draft)
    final = speculative_generate_tokens(
        graphdef, params, draft_graphdef, draft_params, jnp.asarray(block), jnp.asarray(mask), rng,
        max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, **kw)
    N = max_new_tokens
    result = GenerateResult(
        tokens=final.tokens[:, :N], logprobs=final.logprobs[:, :N], sampling_logprobs=final.sampling_logprobs[:, :N],
        lengths=final.lengths, prompt_tokens=jnp.asarray(block), prompt_lengths=final.prompt_lengths,
        accepted_lengths=final.accepted, verify_rounds=final.rounds,
    )
    if tokenizer is not None:
        result.texts = [tokenizer.decode(c) for c in result.completions()]
    return _checked(result)


def _early_exit(model, window, block, mask, rng, tokenizer, *, draft, condition, interventions, max_new_tokens,
                **kw) -> GenerateResult:
    if not isinstance(window, ExitWindow):
        raise TypeError(f"early_exit must be an ExitWindow, got {type(window).__name__}")
    if draft is not None or condition is not None or interventions:
        raise ValueError("early_exit= does not combine with draft=, condition= or interventions=")
    window.check(model.config)
    graphdef, params = nnx.split(model)
    final = early_exit_generate_tokens(graphdef, params, jnp.asarray(block), jnp.asarray(mask), rng, window=window,
                                       max_new_tokens=max_new_tokens, **kw)
    result = GenerateResult(
        tokens=final.tokens, logprobs=final.logprobs, sampling_logprobs=final.sampling_logprobs,
        lengths=final.lengths, prompt_tokens=jnp.asarray(block), prompt_lengths=final.prompt_lengths,
        exit_layers=final.exit_layers,
    )
    if tokenizer is not None:
        result.texts = [tokenizer.decode(c) for c in result.completions()]
    return _checked(result)

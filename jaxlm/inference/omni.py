"""Generation with media: `omni_generate` encodes an `OmniModel`'s video and audio once,
prefills the spliced sequence at its three-axis positions and decodes text with the plain
KV-cache sampler (`jaxlm.inference.sampler.generate_tokens`), positions continuing from the
largest prompt position + 1 on every axis."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.inference.logits_processors import Temperature
from jaxlm.inference.sampler import GenerateResult, default_stop_tokens, generate_tokens
from jaxlm.models.omni import OmniModel, check_media


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed(graphdef, state, tokens, video, audio):
    model = nnx.merge(graphdef, state)
    v, a = model.encode_media(video, audio)
    return model.embed(tokens, v, a)


def omni_inputs_embeds(model: OmniModel, tokens, video=None, audio=None) -> jax.Array:
    """The spliced input embeddings ``[B, T, D]`` of ``tokens`` with their media."""
    check_media(tokens, video, audio, model.config)
    graphdef, state = nnx.split(model)
    return _embed(graphdef, state, jnp.asarray(tokens), None if video is None else jnp.asarray(video),
                  None if audio is None else jnp.asarray(audio))


def omni_generate(model: OmniModel, batch: dict, *, max_new_tokens: int, temperature: float = 0.0,
                  rng: jax.Array | int = 0, stop_tokens: Sequence[int] | None = None,
                  embeds: jax.Array | None = None) -> GenerateResult:
    """Decode after ``batch`` (`jaxlm.models.omni.batch_sequences`: left-padded ``tokens``,
    ``positions``, ``mask``, ``video``, ``audio``). ``embeds``: precomputed input embeddings
    (e.g. compressed by OmniSIFT, with ``batch`` describing the kept tokens)."""
    tok = model.tokenizer
    if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive int")
    max_new_tokens = int(max_new_tokens)
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.number)) \
            or not 0 <= temperature < np.inf:
        raise ValueError(f"temperature={temperature!r} is invalid: must be a finite number >= 0 (0 = greedy)")
    if stop_tokens is None:
        stop_tokens = default_stop_tokens(tok)
    tokens = jnp.asarray(batch["tokens"])
    limit = model.config.lm.max_seq_len
    if tokens.shape[-1] + max_new_tokens > limit:
        raise ValueError(f"prompt width {tokens.shape[-1]} + max_new_tokens {max_new_tokens} = "
                         f"{tokens.shape[-1] + max_new_tokens} exceeds ModelConfig.max_seq_len={limit}")
    bad = [int(t) for t in stop_tokens if not 0 <= int(t) < model.config.lm.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens {bad} are outside [0, vocab_size={model.config.lm.vocab_size})")
    if embeds is None:
        embeds = omni_inputs_embeds(model, batch["tokens"], batch.get("video"), batch.get("audio"))
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    graphdef, params = nnx.split(model.lm)
    pad = 0 if tok is None or tok.pad_id is None else tok.pad_id
    final = generate_tokens(graphdef, params, tokens, jnp.asarray(batch["mask"]), rng,
                            max_new_tokens=max_new_tokens, greedy=temperature == 0, pad_id=pad,
                            stop_tokens=tuple(int(t) for t in stop_tokens), prompt_embeds=embeds,
                            prompt_positions=jnp.asarray(batch["positions"]),
                            processors=() if temperature in (0, 1) else (Temperature(temperature),),
                            return_cache=False)
    result = GenerateResult(tokens=final.tokens, logprobs=final.logprobs, sampling_logprobs=final.sampling_logprobs,
                            lengths=final.lengths, prompt_tokens=tokens, prompt_lengths=final.prompt_lengths)
    if tok is not None:
        result.texts = [tok.decode(c) for c in result.completions()]
    return result

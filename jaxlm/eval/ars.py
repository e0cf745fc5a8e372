"""ARS: answer-agreement representation shaping for hallucination detection (Zhang et al.
2026, arXiv 2601.17467; method card §7.3, from the authors' code).

1. Counterfactual answers (`counterfactual_answers`): Gaussian noise ``sigma N(0, I)`` is
   added to the last transformer block's output at the last prompt position in the first
   forward only, then decoding proceeds normally (defaults: 4 variants, sigma = 0.05, seeds
   ``seed + 13 v``). That block output at that position feeds only the first generated
   token's logits (no later key or value is computed from it), so the one-shot hook is run
   exactly as a perturbed prefill for the first token and a plain `generate` for the rest.
2. Agreement labels: each variant answer agrees with the original or not (a judge; on a task
   with a verifiable latent, equality of latents).
3. Shaping (`ars_loss`, `fit_shaping`): a bias-free linear map ``W`` (d -> d), ``h =
   normalize(W x)``, ``S = h h^T / tau``; for anchor ``i`` the positives are the other
   samples with the same question id and the same agreement label, the denominator every
   other sample:

       L_i = LSE_{j != i} S_ij - LSE_{j in P(i)} S_ij,    L = mean_i L_i + lambda ||W||_F^2

   (anchors without a positive are left out of the mean). Defaults: tau = 0.1,
   lambda = 1e-3, AdamW lr 1e-3, weight decay 1e-4, 50 epochs, batches of 32.
4. The shaped embeddings ``normalize(W x)`` feed an existing detector (a linear probe here).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlm.eval.scoring import encode_prompts
from jaxlm.inference.logits_processors import TopP
from jaxlm.inference.sampler import default_stop_tokens, generate
from jaxlm.models.interventions import Intervention, layer_mask


def _normalize(x):
    # rsqrt of the clamped squared norm: a zero row gives 0 with a finite gradient (the norm's
    # gradient there is 0/0, which turned every weight NaN after one step)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-24))


def ars_loss(W: jax.Array, x: jax.Array, ids: jax.Array, labels: jax.Array, *, tau: float = 0.1,
             l2: float = 1e-3) -> jax.Array:
    """The shaping loss of a batch ``x [N, D]`` with question ``ids [N]`` and agreement
    ``labels [N]`` (module docstring, step 3)."""
    h = _normalize(x @ W.T)
    S = h @ h.T / tau
    N = x.shape[0]
    other = ~jnp.eye(N, dtype=bool)
    pos = other & (ids[:, None] == ids[None, :]) & (labels[:, None] == labels[None, :])
    neg_inf = jnp.finfo(S.dtype).min
    denom = jax.nn.logsumexp(jnp.where(other, S, neg_inf), axis=1)
    has_pos = pos.any(axis=1)
    numer = jax.nn.logsumexp(jnp.where(pos, S, neg_inf), axis=1)
    per = jnp.where(has_pos, denom - numer, 0.0)
    mean = per.sum() / jnp.maximum(has_pos.sum(), 1)
    return mean + l2 * jnp.sum(W * W)


def shape_embeddings(W, x) -> np.ndarray:
    """``normalize(W x)`` row by row."""
    return np.asarray(_normalize(jnp.asarray(x, jnp.float32) @ jnp.asarray(W, jnp.float32).T))


@dataclasses.dataclass(frozen=True)
class ShapingConfig:
    tau: float = 0.1
    l2: float = 1e-3
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    epochs: int = 50
    batch_size: int = 32
    seed: int = 0

    def __post_init__(self):
        for name in ("tau", "learning_rate", "epochs", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:  # NaN passed "<= 0"
                raise ValueError(f"ShapingConfig.{name}={v!r} must be a finite number > 0")
        for name in ("l2", "weight_decay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"ShapingConfig.{name}={v!r} must be a finite number >= 0")


def _id_batches(ids: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Whole questions per batch (so positives share it), about ``batch_size`` samples each."""
    groups = [np.flatnonzero(ids == q) for q in rng.permutation(np.unique(ids))]
    batches, cur = [], []
    for g in groups:
        cur.extend(g.tolist())
        if len(cur) >= batch_size:
            batches.append(np.asarray(cur))
            cur = []
    if cur:
        batches.append(np.asarray(cur))
    return batches


def fit_shaping(x, ids, labels, config: ShapingConfig = ShapingConfig()) -> tuple[np.ndarray, list[float]]:
    """Train ``W`` (identity at the start) with AdamW on `ars_loss`; returns ``W`` and the
    mean loss of each epoch."""
    x = np.asarray(x, np.float32)
    ids, labels = np.asarray(ids), np.asarray(labels)
    if x.ndim != 2 or ids.shape != (x.shape[0],) or labels.shape != (x.shape[0],):
        raise ValueError(f"x must be [N, D] with ids and labels [N], got {x.shape}, {ids.shape}, {labels.shape}")
    ids = np.unique(ids, return_inverse=True)[1].reshape(ids.shape)  # any hashable question ids ("q1") -> ints
    c = config
    opt = optax.adamw(c.learning_rate, weight_decay=c.weight_decay)
    W = jnp.eye(x.shape[1], dtype=jnp.float32)
    state = opt.init(W)

    @jax.jit
    def step(W, state, xb, ib, lb):
        loss, g = jax.value_and_grad(ars_loss)(W, xb, ib, lb, tau=c.tau, l2=c.l2)
        updates, state = opt.update(g, state, W)
        return optax.apply_updates(W, updates), state, loss

    rng = np.random.default_rng(c.seed)
    history = []
    for _ in range(c.epochs):
        losses = []
        for b in _id_batches(ids, c.batch_size, rng):
            W, state, loss = step(W, state, jnp.asarray(x[b]), jnp.asarray(ids[b]), jnp.asarray(labels[b]))
            losses.append(float(loss))
        history.append(float(np.mean(losses)))
    return np.asarray(W), history


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _perturbed_first_logits(graphdef, state, tokens, mask, noise, layers):
    model = nnx.merge(graphdef, state)
    iv = Intervention(vector=noise, alpha=jnp.ones((), jnp.float32), layers=layers, site="hidden", kind="add",
                      where="last")
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    return model(tokens, positions, mask=mask, interventions=(iv,)).logits[:, -1]


def counterfactual_answers(model, prompts: Sequence[str], *, num_variants: int = 4, noise_scale: float = 0.05,
                           seed: int = 0, max_new_tokens: int = 32, temperature: float = 0.0,
                           top_p: float | None = None) -> list[list[str]]:
    """``[B][num_variants]`` answers decoded after the one-shot perturbation (module
    docstring, step 1); ``temperature`` 0 decodes greedily, and ``top_p`` applies nucleus
    sampling after the temperature (the authors' variants: temperature 0.7, top-p 0.95)."""
    if num_variants < 1 or noise_scale < 0 or max_new_tokens < 1:
        raise ValueError("num_variants and max_new_tokens must be >= 1 and noise_scale >= 0")
    tok = model.tokenizer
    ids = encode_prompts(tok, prompts, vocab_size=model.config.vocab_size)
    L, D = model.config.n_layers, model.config.d_model
    T = -(-max(map(len, ids)) // 8) * 8
    pad = getattr(tok, "pad_id", None) or 0
    tokens = np.full((len(ids), T), pad, np.int32)
    mask = np.zeros((len(ids), T), bool)
    for r, row in enumerate(ids):
        tokens[r, T - len(row):] = row
        mask[r, T - len(row):] = True
    graphdef, state = nnx.split(model)
    layers = layer_mask([L - 1], L)
    out: list[list[str]] = [[] for _ in ids]
    for v in range(num_variants):
        key = jax.random.key(seed + 13 * v)
        noise = noise_scale * jax.random.normal(key, (len(ids), 1, D), jnp.float32)
        vector = jnp.broadcast_to(noise[None], (L, len(ids), 1, D))
        logits = _perturbed_first_logits(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), vector, layers)
        if temperature > 0:
            scaled = logits / temperature
            if top_p is not None and top_p != 1:
                scaled = TopP(float(top_p))(scaled)
            first = np.asarray(jax.random.categorical(jax.random.fold_in(key, 1), scaled))
        else:
            first = np.asarray(jnp.argmax(logits, axis=-1))
        stops = default_stop_tokens(tok)  # every id that ends an answer (EOS and e.g. <|eot_id|>)
        rest = [None] * len(ids)
        live = [r for r in range(len(ids)) if int(first[r]) not in stops]
        if live and max_new_tokens > 1:
            cont = generate(model, [ids[r] + [int(first[r])] for r in live], max_new_tokens=max_new_tokens - 1,
                            temperature=temperature, top_p=top_p if temperature > 0 else None,
                            rng=seed + 13 * v, add_bos=False, stop_tokens=stops or None)
            for k, r in enumerate(live):
                rest[r] = cont.completions()[k]
        for r in range(len(ids)):
            out[r].append(tok.decode([int(first[r])] + (rest[r] or [])))
    return out

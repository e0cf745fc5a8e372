"""WAVE: window-aware, vocabulary-efficient early exit (training-free; ICML 2026, Kim, Lee, Kim).

Calibration (`calibrate_exit_window`, offline, teacher-forced): for every token the layer
where its prediction settles, ``l*(t) = min{l : argmax W_U norm(h_l') = argmax W_U norm(h_L)
for all l' >= l}`` (layers counted 1..L); the exit window ``[l_s, l_e]`` is a pair of
quantiles of ``l*``, and the confidence threshold is the smallest one on a grid whose
simulated exits agree with the full model on at least ``agreement`` of the tokens.

Decoding (`jaxlm.generate(..., early_exit=window)`): layers ``1..l_s`` run as usual; after
layer ``l_s`` the full LM head runs once and its top-``K`` tokens form a proxy vocabulary;
after each layer ``l`` of the window only those ``K`` rows of the head are applied
(``z_K = W_U[V_K] norm(h_l)``) and a row exits when ``max softmax(z_K) >= threshold``. Its
token is chosen from ``z_K`` (scattered into the full vocabulary, -inf elsewhere, then the
usual logits processors). Rows that never exit run to layer ``L`` and the full head.

Skipped layers' keys/values (state propagation, CALM, Schuster et al. 2022): every layer
after a row's exit still writes that row's key/value, computed from the exit layer's hidden
state (the row's hidden state is frozen at exit and fed to the remaining layers' attention),
so later tokens attend to a complete cache. When every row of the batch has exited, a layer
runs only its attention (for the cache write) and skips the MLP.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlm.inference.cache import KVCache, LayerKV
from jaxlm.inference.logits_processors import LogitsProcessor, compose
from jaxlm.inference.sampling import _select


@dataclasses.dataclass(frozen=True)
class ExitWindow:
    """Exits are checked after layers ``start..end`` (1-based counts of layers run) when the
    top probability over the ``proxy_vocab`` tokens chosen after layer ``start`` reaches
    ``threshold``. A threshold above 1 never exits; 0 always exits at ``start``."""

    start: int
    end: int
    threshold: float
    proxy_vocab: int = 64

    def __post_init__(self):
        for name in ("start", "end", "proxy_vocab"):
            v = getattr(self, name)
            if isinstance(v, np.integer) and not isinstance(v, np.bool_):  # numpy ints: stored as Python ints
                v = int(v)
                object.__setattr__(self, name, v)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ExitWindow.{name}={v!r} is invalid: must be an int >= 1")
        if self.end < self.start:
            raise ValueError(f"ExitWindow.end={self.end} is invalid: must be >= start={self.start}")
        if isinstance(self.threshold, np.floating):
            object.__setattr__(self, "threshold", float(self.threshold))
        if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool) or not self.threshold >= 0:
            raise ValueError(f"ExitWindow.threshold={self.threshold!r} is invalid: must be a number >= 0 (not NaN)")

    def check(self, config) -> None:
        """The window must lie inside the model's layers and the proxy inside its vocabulary."""
        if self.end > config.n_layers:
            raise ValueError(f"ExitWindow.end={self.end} is outside the model's layers [1, n_layers={config.n_layers}]")
        if self.proxy_vocab > config.vocab_size:
            raise ValueError(f"ExitWindow.proxy_vocab={self.proxy_vocab} exceeds vocab_size={config.vocab_size}")
        if config.scan_layers:
            raise ValueError("early_exit needs unrolled layers (ModelConfig.scan_layers=False)")


def _head_rows(model) -> jax.Array:
    """The unembedding as ``[V, D]`` rows (a quantized head dequantized, as its matmul reads it)."""
    if model.lm_head is None:
        return model.embed[...]
    kernel = model.lm_head.kernel.get_value()
    if isinstance(kernel, jax.Array):
        return kernel.T
    if hasattr(kernel, "dequantize"):
        return kernel.dequantize().T
    raise TypeError(f"early exit reads the LM head's rows; a {type(kernel).__name__} head has none: keep lm_head "
                    "dense or quantized (QArray)")


def layer_predictions(model, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced logits of the head applied after every layer: ``[L, B, T, V]`` float32
    (layer ``l`` at index ``l - 1``; the last equals the model's logits) and the hidden
    states ``[L, B, T, D]`` after the final norm."""
    out = model.backbone(tokens, mask=mask, collect=("hidden",))
    hidden = model.final_norm(out.collected["hidden"])
    return model.unembed(hidden), hidden


def settled_layers(layer_argmax: np.ndarray) -> np.ndarray:
    """``layer_argmax [L, ...]`` -> the 1-based layer from which every later layer's argmax
    equals the last layer's, per position."""
    agree = layer_argmax == layer_argmax[-1:]
    L = agree.shape[0]
    # the last layer index (0-based) that disagrees, -1 if none; settled = that + 2 (1-based next)
    disagree = ~agree
    last_bad = np.where(disagree.any(0), L - 1 - np.argmax(disagree[::-1], axis=0), -1)
    return last_bad + 2


@dataclasses.dataclass
class Calibration:
    window: ExitWindow
    settled: np.ndarray  # per calibration token
    agreement: float  # simulated exit predictions equal to the full model's
    mean_layers: float  # simulated layers run per token
    sweep: list[dict]  # per threshold: agreement, mean layers


def simulate_exits(logits: np.ndarray, start: int, end: int, threshold: float, proxy_vocab: int):
    """Teacher-forced WAVE on per-layer logits ``[L, N, V]`` (N tokens): predictions and
    layers run per token."""
    L, N, V = logits.shape
    proxy = np.argsort(-logits[start - 1], axis=-1, kind="stable")[:, :proxy_vocab]  # [N, K]
    pred = logits[-1].argmax(-1)
    layers = np.full(N, L)
    open_ = np.ones(N, bool)
    for layer in range(start, end + 1):
        z = np.take_along_axis(logits[layer - 1], proxy, axis=-1)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        go = open_ & (p.max(-1) >= threshold)
        pred = np.where(go, proxy[np.arange(N), p.argmax(-1)], pred)
        layers = np.where(go, layer, layers)
        open_ &= ~go
    return pred, layers


# Exit confidences of a trained model crowd towards 1, so the grid is finer there.
DEFAULT_THRESHOLDS = tuple(float(x) for x in np.round(np.arange(0.5, 0.9751, 0.025), 3)) + (
    0.99, 0.995, 0.998, 0.999, 0.9995, 1.0)


def calibrate_from_logits(logits: np.ndarray, *, quantiles: tuple[float, float] = (0.1, 0.9),
                          agreement: float = 0.99, proxy_vocab: int = 64,
                          thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> Calibration:
    """WAVE's calibration on per-layer logits ``[L, N, V]`` of ``N`` calibration tokens:
    window = the ``quantiles`` of the settled layers (the smallest layer by which that fraction
    of the tokens has settled), threshold = the smallest
    in ``thresholds`` whose simulated exits agree with the last layer's argmax on at least
    ``agreement`` of the tokens (the largest threshold if none does)."""
    q1, q2 = quantiles
    if not 0 <= q1 <= q2 <= 1:
        raise ValueError(f"quantiles={quantiles!r} is invalid: need 0 <= q1 <= q2 <= 1")
    if not 0 <= agreement <= 1:
        raise ValueError(f"agreement={agreement!r} is invalid: must be in [0, 1]")
    if not len(thresholds):
        raise ValueError("thresholds is empty: give at least one candidate threshold")
    if isinstance(proxy_vocab, bool) or not isinstance(proxy_vocab, (int, np.integer)) or proxy_vocab < 1:
        raise ValueError(f"proxy_vocab={proxy_vocab!r} is invalid: must be an int >= 1")
    logits = np.asarray(logits)
    if logits.ndim != 3 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [L, N, V] with N >= 1 calibration tokens, got shape {logits.shape}")
    L, _, V = logits.shape
    settled = settled_layers(logits.argmax(-1))
    # discrete quantiles: the smallest layer by which a fraction >= q of the tokens settled
    start = int(np.clip(np.quantile(settled, q1, method="inverted_cdf"), 1, L))
    end = int(np.clip(np.quantile(settled, q2, method="inverted_cdf"), start, L))
    K = min(proxy_vocab, V)
    full = logits[-1].argmax(-1)
    sweep = []
    for t in sorted(float(x) for x in thresholds):
        pred, layers = simulate_exits(logits, start, end, t, K)
        sweep.append({"threshold": t, "agreement": float(np.mean(pred == full)), "mean_layers": float(layers.mean())})
    ok = [s for s in sweep if s["agreement"] >= agreement]
    best = ok[0] if ok else sweep[-1]
    return Calibration(window=ExitWindow(start, end, best["threshold"], K), settled=settled,
                       agreement=best["agreement"], mean_layers=best["mean_layers"], sweep=sweep)


def calibrate_exit_window(model, tokens, mask, *, score_mask=None, **kw) -> Calibration:
    """`calibrate_from_logits` on a model's teacher-forced per-layer logits over calibration
    text ``tokens [B, T]`` (``mask``: real tokens), at the positions ``score_mask`` selects
    (default: every real token; e.g. only the positions that predict an answer, where
    decoding happens). Teacher forcing sees full-depth context;
    at decode time earlier exits change later tokens' context through the propagated keys
    and values, which this calibration does not model."""
    logits, _ = layer_predictions(model, jnp.asarray(tokens), jnp.asarray(mask))
    select = np.asarray(mask if score_mask is None else score_mask, bool) & np.asarray(mask, bool)
    return calibrate_from_logits(np.asarray(logits)[:, select], **kw)


@struct.dataclass
class ExitState:
    step: jax.Array
    tokens: jax.Array  # [B, N]
    logprobs: jax.Array  # [B, N] under the distribution the token was chosen from (raw)
    sampling_logprobs: jax.Array
    lengths: jax.Array
    done: jax.Array
    prompt_lengths: jax.Array
    exit_layers: jax.Array  # [B, N] layers run for each token (0 after the end)
    cache: KVCache
    rng: jax.Array


def _decode_step(model, token, cache: KVCache, window: ExitWindow):
    """One token through the layers with exits: (logits [B, V], exit layer [B], cache)."""
    c = model.config
    B = token.shape[0]
    end = cache.end_index
    x, positions, mask, kv_valid = model.layer_inputs(token[:, None], cache)
    rows = _head_rows(model)
    k_all, v_all = list(cache.k), list(cache.v)
    exited = jnp.zeros((B,), bool)
    exit_layer = jnp.full((B,), c.n_layers, jnp.int32)
    exit_logits = jnp.zeros((B, c.vocab_size), jnp.float32)
    proxy = None
    for i in range(c.n_layers):
        layer = i + 1
        kv = LayerKV(k=k_all[i], v=v_all[i], layer=None, index=end)

        def run(x, kv, i=i, attention_only=False):
            y, kv = model.apply_layer(i, x, positions, mask, kv, attention_only=attention_only)
            return y, kv.k, kv.v

        if layer <= window.start:
            y, k_i, v_i = run(x, kv)
        else:
            y, k_i, v_i = jax.lax.cond(jnp.all(exited), functools.partial(run, attention_only=True), run, x, kv)
        x = jnp.where(exited[:, None, None], x, y)  # exited rows keep their exit hidden state
        k_all[i], v_all[i] = k_i, v_i
        if window.start <= layer <= window.end:
            h = model.final_norm(x[:, 0])
            if layer == window.start:
                full_logits = model.unembed(h)
                _, proxy = jax.lax.top_k(full_logits, window.proxy_vocab)  # [B, K]
            z = jnp.einsum("bd,bkd->bk", h.astype(jnp.float32), rows[proxy].astype(jnp.float32))
            conf = jnp.max(jax.nn.softmax(z, -1), -1)
            go = ~exited & (conf >= window.threshold)
            scattered = jnp.full((B, c.vocab_size), -jnp.inf, jnp.float32).at[jnp.arange(B)[:, None], proxy].set(z)
            exit_logits = jnp.where(go[:, None], scattered, exit_logits)
            exit_layer = jnp.where(go, layer, exit_layer)
            exited = exited | go
    final = model.unembed(model.final_norm(x[:, 0]))
    logits = jnp.where(exited[:, None], exit_logits, final)
    new_cache = cache.replace(k=tuple(k_all), v=tuple(v_all), valid=kv_valid, end_index=end + 1,
                              lengths=cache.lengths + 1)
    return logits, exit_layer, new_cache


@functools.partial(jax.jit, static_argnames=("graphdef", "window", "max_new_tokens", "processors", "greedy", "pad_id",
                                             "stop_tokens", "cache_dtype"))
def early_exit_generate_tokens(graphdef, params, prompt_tokens, prompt_mask, rng, *, window: ExitWindow,
                               max_new_tokens: int, processors: tuple[LogitsProcessor, ...] = (),
                               greedy: bool = False, pad_id: int = 0, stop_tokens: tuple[int, ...] = (),
                               cache_dtype: str | None = None) -> ExitState:
    """Prefill at full depth, then decode with WAVE exits (one `lax.while_loop`)."""
    model = nnx.merge(graphdef, params)
    B, P = prompt_tokens.shape
    N = max_new_tokens
    process = compose(processors)
    stop = jnp.asarray(stop_tokens, jnp.int32) if stop_tokens else None
    cache = KVCache.init(model.config, B, P + N, cache_dtype, per_layer=True)
    out = model.backbone(prompt_tokens, cache=cache, mask=prompt_mask)
    logits = model.unembed(out.hidden[:, -1])
    state = ExitState(
        step=jnp.zeros((), jnp.int32), tokens=jnp.full((B, N), pad_id, jnp.int32),
        logprobs=jnp.zeros((B, N), jnp.float32), sampling_logprobs=jnp.zeros((B, N), jnp.float32),
        lengths=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
        prompt_lengths=prompt_mask.sum(1, dtype=jnp.int32), exit_layers=jnp.zeros((B, N), jnp.int32),
        cache=out.cache, rng=rng,
    )

    def choose(s: ExitState, logits, layers) -> ExitState:
        rng, key = (s.rng, None) if greedy else jax.random.split(s.rng)
        token, lp, slp = _select(logits, process(logits, s), key, greedy, same=not processors)
        token = jnp.where(s.done, pad_id, token)
        col = (0, s.step)
        put = lambda buf, v: jax.lax.dynamic_update_slice(buf, v[:, None].astype(buf.dtype), col)  # noqa: E731
        done = s.done if stop is None else s.done | jnp.isin(token, stop)
        return s.replace(
            tokens=put(s.tokens, token), logprobs=put(s.logprobs, jnp.where(s.done, 0.0, lp)),
            sampling_logprobs=put(s.sampling_logprobs, jnp.where(s.done, 0.0, slp)),
            exit_layers=put(s.exit_layers, jnp.where(s.done, 0, layers)),
            lengths=s.lengths + (~s.done).astype(jnp.int32), done=done, step=s.step + 1, rng=rng)

    def body(s: ExitState) -> ExitState:
        last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)[:, 0]
        logits, layers, cache = _decode_step(model, last, s.cache, window)
        return choose(s.replace(cache=cache), logits, layers)

    first = choose(state, logits, jnp.full((B,), model.config.n_layers, jnp.int32))
    return jax.lax.while_loop(lambda s: (s.step < N) & ~jnp.all(s.done), body, first)

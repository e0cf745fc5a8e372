"""OnlineSPEC: speculative decoding whose draft keeps learning while it serves
(Qian, Wu, Fu, Zhang, Zhao, "When Drafts Evolve: Speculative Decoding Meets Online Learning",
ICML 2026, arXiv 2603.12617).

A stream of prompts is served in chunks. For each chunk ``t``:

1. **serve** the chunk with speculative decoding and the current draft
   (`jaxlm.generate(..., draft=)`), logging accepted lengths and tokens/s;
2. the target's outputs are the **verification feedback**: at every generated position
   the target's distribution ``p`` is the one its verify forward computed (recomputed here by
   one teacher-forced forward per training batch, which is the same causal computation, so no
   ``[B, N, V]`` array rides in the decode loop);
3. **adapt** the draft on the chunk by the distillation loss
   ``L = mean_positions KL(p_target || q_draft)``; the paper ties the acceleration to the
   cumulative loss through ``1 - alpha = TV(p, q) <= sqrt(KL / 2)``;
4. serve chunk ``t + 1`` with the adapted draft.

Learners (`OnlineSpecConfig.method`):

* ``"opt_hydra"`` (Opt-Hydra, "optimistic online learning"): SGD with momentum 0.9 whose
  optimizer state persists across chunks, so past chunks' gradients act as the hint
  (`Hydra/pipeline.py`: lr 0.1, 3 epochs per chunk);
* ``"ensemble"`` (Ens-EAGLE, `EAGLE/pipeline_hedge.py`): ``K`` base learners, each trained
  from the meta draft with its own learning rate; weights ``w = softmax(-L_k / T)`` from their
  final training losses (``T = 1.2``); the meta draft ``sum_k w_k theta_k`` serves the next chunk;
* ``"osd"`` (Online Speculative Decoding, Liu et al. 2023), the baseline that distils only at
  positions where the serving draft's proposal was wrong (its argmax differs from the
  target's token), with the same optimizer as ``"opt_hydra"``;
* ``"static"``: the offline draft, never updated.

A draft is a small jaxlm `Transformer` or `MedusaHeads` on the target's hidden states (the
Hydra / EAGLE family: head ``j`` predicts the token ``j + 2`` places ahead and is distilled
towards the target's distribution for that token).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, Iterable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlm.inference.sampler import _as_token_lists, generate
from jaxlm.inference.speculative import MedusaHeads

log = logging.getLogger(__name__)

METHODS = ("static", "opt_hydra", "osd", "ensemble")
OPTIMIZERS = ("sgd", "adam")


@dataclasses.dataclass(frozen=True)
class OnlineSpecConfig:
    """How a stream is served and how the draft adapts between chunks. Defaults follow the
    paper's scripts (Opt-Hydra: SGD momentum 0.9, lr 0.1, 3 epochs; Ens-EAGLE: learning rates
    5e-4 / 1e-3 / 1e-1, one epoch, ``T = 1.2``); presets: `OnlineSpecConfig.preset`."""

    method: str = "opt_hydra"
    """``"static"`` | ``"opt_hydra"`` | ``"osd"`` | ``"ensemble"`` (module docstring)."""
    chunk_size: int = 40
    """Prompts per chunk: the draft adapts after each chunk."""
    batch_size: int = 8
    """Prompts per `jaxlm.generate` call while serving."""
    max_new_tokens: int = 64
    num_draft_tokens: int = 4
    temperature: float = 0.0
    """Serving temperature (0: greedy). Distillation targets the raw target distribution."""
    optimizer: str = "sgd"
    """The single learner's optimizer (``"opt_hydra"``, ``"osd"``): ``"sgd"`` (with
    ``momentum``) or ``"adam"``."""
    learning_rate: float = 0.1
    momentum: float = 0.9
    persist_optimizer_state: bool = True
    """Keep the single learner's optimizer state (momentum) across chunks: Opt-Hydra's hint.
    False restarts it every chunk (the ablation)."""
    epochs: int = 3
    """Passes over each chunk's feedback (single learner)."""
    train_batch_size: int = 8
    """Sequences per update step."""
    ensemble_learning_rates: tuple[float, ...] = (5e-4, 1e-3, 1e-1)
    """One base learner per learning rate (``"ensemble"``)."""
    ensemble_optimizer: str = "adam"
    ensemble_epochs: int = 1
    ensemble_temperature: float = 1.2
    """``T`` in ``w = softmax(-L_k / T)``."""
    ensemble_loss: str = "running"
    """``L_k``: ``"running"``, the mean training loss over the last epoch (the paper's scripts),
    or ``"post_fit"``, the trained learner's loss on the chunk (what "running" tends to with
    many steps per epoch; differs when a chunk is only a few steps)."""
    seed: int = 0
    """Seeds the order of training examples (and sampling when ``temperature > 0``)."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"OnlineSpecConfig.method={self.method!r} is invalid: must be one of {METHODS}")
        for name in ("chunk_size", "batch_size", "max_new_tokens", "num_draft_tokens", "epochs", "train_batch_size",
                     "ensemble_epochs"):
            v = getattr(self, name)
            if isinstance(v, np.integer) and not isinstance(v, np.bool_):  # numpy ints: stored as Python ints
                v = int(v)
                object.__setattr__(self, name, v)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"OnlineSpecConfig.{name}={v!r} is invalid: must be an int >= 1")
        for name in ("optimizer", "ensemble_optimizer"):
            if getattr(self, name) not in OPTIMIZERS:
                raise ValueError(f"OnlineSpecConfig.{name}={getattr(self, name)!r} is invalid: must be one of "
                                 f"{OPTIMIZERS}")
        for name in ("learning_rate", "ensemble_temperature"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"OnlineSpecConfig.{name}={v!r} is invalid: must be a finite number > 0")
        if self.ensemble_loss not in ("running", "post_fit"):
            raise ValueError(f"OnlineSpecConfig.ensemble_loss={self.ensemble_loss!r} is invalid: must be "
                             "'running' or 'post_fit'")
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)) or not 0 <= self.momentum < 1:
            raise ValueError(f"OnlineSpecConfig.momentum={self.momentum!r} is invalid: must be in [0, 1)")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0 <= self.temperature < math.inf:  # NaN passed a plain "< 0"
            raise ValueError(f"OnlineSpecConfig.temperature={self.temperature!r} is invalid: must be a finite "
                             "number >= 0")
        if not isinstance(self.persist_optimizer_state, bool):
            raise ValueError(f"OnlineSpecConfig.persist_optimizer_state={self.persist_optimizer_state!r} is "
                             "invalid: must be a bool")
        lrs = self.ensemble_learning_rates
        if (not isinstance(lrs, tuple) or not lrs
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0
                       for x in lrs)):
            raise ValueError(f"OnlineSpecConfig.ensemble_learning_rates={lrs!r} is invalid: must be a non-empty "
                             "tuple of finite numbers > 0")

    @classmethod
    def preset(cls, name: str, **overrides) -> OnlineSpecConfig:
        """The paper's settings by name: ``"opt_hydra"`` (SGD momentum 0.9 persisted, lr 0.1,
        3 epochs, chunk 80), ``"ens_eagle"`` (3 learners at 5e-4 / 1e-3 / 1e-1 with Adam, one
        epoch, T = 1.2, chunk 40), ``"osd"`` (the mismatch-only baseline with Opt-Hydra's
        optimizer), ``"static"``."""
        presets = {
            "opt_hydra": dict(method="opt_hydra", chunk_size=80),
            "ens_eagle": dict(method="ensemble", chunk_size=40),
            "osd": dict(method="osd", chunk_size=80),
            "static": dict(method="static"),
        }
        if name not in presets:
            raise ValueError(f"preset={name!r} is unknown: must be one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})


# --- the distillation loss ----------------------------------------------------------------------


def _is_heads(draft) -> bool:
    return isinstance(draft, MedusaHeads)


def num_proposers(draft) -> int:
    """How many predictions the draft makes per position: 1 for a draft model, the heads' count
    for `MedusaHeads`."""
    return draft.num_heads if _is_heads(draft) else 1


def aligned_predictions(draft, target, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced predictions aligned by the token they predict: ``draft_logits [B, T, J, V]``
    where ``[:, s, j]`` is proposer ``j``'s logits for ``tokens[:, s]`` (a draft model from the
    prefix ``< s``; Medusa head ``j`` from the target's hidden state at ``s - j - 2``), and the
    target's log-probabilities ``[B, T, V]`` for ``tokens[:, s]`` from the prefix ``< s``.
    Entries with no source position (``s`` too small) are zero; weight them out."""
    B, T = tokens.shape
    chex.assert_shape(mask, (B, T))
    pad = lambda x, n: jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))[:, :T]  # noqa: E731
    if _is_heads(draft):
        hidden = jax.lax.stop_gradient(target.backbone(tokens, mask=mask).hidden)  # [B, T, D]
        t_logits = jax.lax.stop_gradient(target.unembed(hidden))
        out = jax.vmap(draft, in_axes=1, out_axes=1)(hidden)  # [B, T, J, D]
        h_logits = target.unembed(out)  # [B, T, J, V]
        d = jnp.stack([pad(h_logits[:, :, j], j + 2) for j in range(draft.num_heads)], axis=2)
    else:
        t_logits = jax.lax.stop_gradient(target(tokens, mask=mask).logits)
        d = pad(draft(tokens, mask=mask).logits, 1)[:, :, None]
    return d, pad(jax.nn.log_softmax(t_logits, -1), 1)


def distill_loss(draft, target, tokens: jax.Array, mask: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum_{b,s,j} w[b,s,j] KL(p_target(. | x_<s) || q_j(. | ...)) / sum w``: the online
    distillation loss on verification feedback. ``weights [B, T, J]`` select the predicted
    positions (generated tokens; mismatches only for OSD)."""
    d_logits, t_logp = aligned_predictions(draft, target, tokens, mask)
    chex.assert_shape(weights, d_logits.shape[:3])
    q_logp = jax.nn.log_softmax(d_logits.astype(jnp.float32), -1)
    p = jnp.exp(t_logp)[:, :, None]
    kl = jnp.sum(jnp.where(p > 0, p * (t_logp[:, :, None] - q_logp), 0.0), -1)  # [B, T, J]
    w = weights.astype(jnp.float32)
    total = jnp.sum(w)
    return jnp.sum(kl * w) / jnp.where(total > 0, total, 1.0)  # all weights zero: 0, not NaN


def feedback_weights(draft, target, tokens, mask, generated, *, mismatch_only: bool) -> np.ndarray:
    """``[B, T, J]`` float32 weights: 1 at generated positions a proposer can predict (and,
    with ``mismatch_only``, where its argmax is not the served token: OSD's replay set,
    taken with the draft as it served)."""
    J = num_proposers(draft)
    T = tokens.shape[1]
    s = np.arange(T)[None, :, None]
    first = np.arange(J) + (2 if _is_heads(draft) else 1)  # the first position each proposer can predict
    w = np.asarray(generated)[:, :, None] & (s >= first[None, None, :])
    if mismatch_only:
        d_logits, _ = _jitted_predictions(draft, target, jnp.asarray(tokens), jnp.asarray(mask))
        w = w & (np.asarray(jnp.argmax(d_logits, -1)) != np.asarray(tokens)[:, :, None])
    return w.astype(np.float32)


def _jitted_predictions(draft, target, tokens, mask):
    dg, dp = nnx.split(draft)
    tg, tp = nnx.split(target)
    return _predict(dg, dp, tg, tp, tokens, mask)


@functools.partial(jax.jit, static_argnames=("dg", "tg"))
def _predict(dg, dp, tg, tp, tokens, mask):
    return aligned_predictions(nnx.merge(dg, dp), nnx.merge(tg, tp), tokens, mask)


# --- learners -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _optimizer(name: str, momentum: float) -> optax.GradientTransformation:
    """An optimizer whose learning rate lives in its state (one compiled step for every rate)."""
    if name == "sgd":
        return optax.inject_hyperparams(optax.sgd, static_args=("momentum",))(
            learning_rate=1.0, momentum=momentum or None)
    return optax.inject_hyperparams(optax.adam)(learning_rate=1.0)


def _init_opt_state(opt, params, learning_rate: float):
    state = opt.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
    return state


@functools.partial(jax.jit, static_argnames=("dg", "tg", "opt"))
def _update(dg, params, opt_state, tg, tp, tokens, mask, weights, *, opt):
    def loss_fn(p):
        return distill_loss(nnx.merge(dg, p), nnx.merge(tg, tp), tokens, mask, weights)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("dg", "tg"))
def _loss(dg, params, tg, tp, tokens, mask, weights):
    return distill_loss(nnx.merge(dg, params), nnx.merge(tg, tp), tokens, mask, weights)


def _batches(feedback, batch_size: int, order: np.ndarray):
    """Fixed-shape batches over ``order`` (the last padded with zero-weight rows)."""
    order = np.concatenate([order, np.full((-len(order)) % batch_size, -1, np.int64)])
    for i in range(0, len(order), batch_size):
        rows = order[i: i + batch_size]
        take = np.where(rows < 0, order[0], rows)
        w = feedback.weights[take] * (rows >= 0)[:, None, None]
        yield jnp.asarray(feedback.tokens[take]), jnp.asarray(feedback.mask[take]), jnp.asarray(w), float(w.sum())


def feedback_loss(draft, target, feedback: Feedback, *, params=None, batch_size: int = 8) -> float:
    """The distillation loss of ``draft`` (or of ``params`` in its structure) over all of
    ``feedback``, pooled over its weighted positions."""
    dg, p0 = nnx.split(draft)
    tg, tp = nnx.split(target)
    params = p0 if params is None else params
    total = count = 0.0
    for tokens, mask, w, n in _batches(feedback, batch_size, np.arange(feedback.tokens.shape[0])):
        total += float(_loss(dg, params, tg, tp, tokens, mask, w)) * max(n, 1.0)
        count += n
    return total / max(count, 1.0)


@dataclasses.dataclass
class Feedback:
    """One chunk's verification feedback, right-padded: ``tokens / mask [n, W]`` (prompt +
    the target's output), ``weights [n, W, J]`` (the positions to distil on)."""

    tokens: np.ndarray
    mask: np.ndarray
    weights: np.ndarray


def fit_draft(draft, target, feedback: Feedback, *, params=None, opt_state=None, optimizer: str = "sgd",
              learning_rate: float = 0.1, momentum: float = 0.9, epochs: int = 1, batch_size: int = 8,
              seed: int = 0):
    """``epochs`` passes of ``optimizer`` over ``feedback`` (shuffled, fixed batch shape);
    starts from ``params`` (default: the draft's) and ``opt_state`` (default: fresh, at
    ``learning_rate``). Returns ``(params, opt_state, last-epoch mean loss)``; the loss is
    ``inf`` when the parameters came out non-finite (the running loss is measured before
    each update, so a last update that diverged would still report a finite one)."""
    dg, p0 = nnx.split(draft)
    tg, tp = nnx.split(target)
    params = p0 if params is None else params
    opt = _optimizer(optimizer, float(momentum))
    if opt_state is None:
        opt_state = _init_opt_state(opt, params, learning_rate)
    n = feedback.tokens.shape[0]
    rng = np.random.default_rng(seed)
    last = float("nan")
    for _ in range(epochs):
        losses = []
        for tokens, mask, w, _ in _batches(feedback, batch_size, rng.permutation(n)):
            params, opt_state, loss = _update(dg, params, opt_state, tg, tp, tokens, mask, w, opt=opt)
            losses.append(float(loss))
        last = float(np.mean(losses))
    if not all_finite(params):
        last = float("inf")
    return params, opt_state, last


def all_finite(tree) -> bool:
    """Whether every floating-point leaf of ``tree`` is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


def average_params(trees: Sequence[Any], weights: Sequence[float] | np.ndarray):
    """``sum_k w_k theta_k`` leaf by leaf (the ensemble's meta draft), in each leaf's dtype.
    Trees of weight 0 are left out (a diverged learner's NaN times 0 is NaN)."""
    w = np.asarray(weights, np.float64)
    if len(trees) != len(w) or not len(w):
        raise ValueError(f"average_params: {len(trees)} trees and {len(w)} weights")
    if not (np.all(np.isfinite(w)) and np.all(w >= 0) and w.sum() > 0):
        raise ValueError(f"average_params: weights {w.tolist()} must be finite, >= 0 and not all 0")
    kept = [(float(wk), t) for wk, t in zip(w, trees) if wk > 0]
    return jax.tree.map(lambda *xs: sum(wk * x.astype(jnp.float32) for (wk, _), x in zip(kept, xs)).astype(xs[0].dtype),
                        *[t for _, t in kept])


def ensemble_weights(losses: Sequence[float], temperature: float) -> np.ndarray:
    """``softmax(-L / T)`` over the base learners' losses; a non-finite loss (a diverged
    learner) gets weight 0, and if every loss is non-finite the weights are uniform."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not 0 < temperature < np.inf:  # 0 gave NaN weights
        raise ValueError(f"temperature={temperature!r} is invalid: must be a finite number > 0")
    L = np.asarray(losses, np.float64)
    ok = np.isfinite(L)
    if not ok.any():
        return np.full(len(L), 1.0 / len(L))
    z = np.where(ok, -L / temperature, -np.inf)
    z = np.exp(z - z[ok].max())
    return z / z.sum()


# --- the serving loop ---------------------------------------------------------------------------


@dataclasses.dataclass
class ChunkReport:
    """What serving one chunk measured (before the draft adapted on it)."""

    index: int
    prompts: int
    generated_tokens: int
    verify_rounds: int
    tokens_per_round: float
    """Tokens the verify rounds produced per round: mean accepted drafts + 1 (each row's
    first token comes from the prefill, not from a round, and is not counted)."""
    accept_rate: float
    """Accepted drafts / proposed drafts over the rounds that ran to their end: each row's last
    round is left out, since a stop token or the token limit may cut it short (drafts the
    target accepted but no longer needed would count as rejected)."""
    serve_seconds: float
    tokens_per_second: float
    adapt_seconds: float = 0.0
    train_loss: float = float("nan")
    """The learner's last-epoch loss on this chunk (the ensemble: the weighted losses)."""
    ensemble_weights: list[float] | None = None
    completions: list[list[int]] | None = None


@dataclasses.dataclass
class StreamReport:
    config: OnlineSpecConfig
    chunks: list[ChunkReport]
    draft: Any
    """The draft after the last chunk's update."""

    def mean(self, field: str, chunks: slice | Sequence[int] = slice(None)) -> float:
        """``field`` averaged over chunks (``tokens_per_round`` and ``tokens_per_second``
        weighted by the chunks' rounds and seconds, i.e. pooled)."""
        cs = self.chunks[chunks] if isinstance(chunks, slice) else [self.chunks[i] for i in chunks]
        if field == "tokens_per_round":
            from_rounds = sum(c.generated_tokens - c.prompts for c in cs)  # less each row's prefill token
            return from_rounds / max(sum(c.verify_rounds for c in cs), 1)
        if field == "tokens_per_second":
            return sum(c.generated_tokens for c in cs) / max(sum(c.serve_seconds for c in cs), 1e-12)
        return float(np.mean([getattr(c, field) for c in cs]))


def chunked(prompts: Sequence[Any], chunk_size: int) -> list[list[Any]]:
    """Split a prompt stream into consecutive chunks of ``chunk_size`` (the last may be shorter)."""
    return [list(prompts[i: i + chunk_size]) for i in range(0, len(prompts), chunk_size)]


def _feedback(results, draft, target, *, width_multiple: int, mismatch_only: bool) -> Feedback:
    seqs, gen_ranges = [], []
    for r in results:
        for b, s in enumerate(r.sequences()):
            n_gen = int(r.lengths[b])
            seqs.append(s)
            gen_ranges.append((len(s) - n_gen, len(s)))
    longest = max(map(len, seqs))
    limit = min(target.config.max_seq_len, math.inf if _is_heads(draft) else draft.config.max_seq_len)
    W = int(min(-(-longest // width_multiple) * width_multiple, limit))
    pad_id = getattr(getattr(target, "tokenizer", None), "pad_id", None) or 0
    tokens = np.full((len(seqs), W), pad_id, np.int32)
    mask = np.zeros((len(seqs), W), bool)
    generated = np.zeros((len(seqs), W), bool)
    for i, (s, (a, e)) in enumerate(zip(seqs, gen_ranges)):
        tokens[i, : len(s)] = s
        mask[i, : len(s)] = True
        generated[i, a:e] = True
    weights = feedback_weights(draft, target, tokens, mask, generated, mismatch_only=mismatch_only)
    return Feedback(tokens, mask, weights)


def serve_stream(target, draft, chunks: Iterable[Sequence[Any]], config: OnlineSpecConfig = OnlineSpecConfig(), *,
                 tokenizer=None, stop_tokens: Sequence[int] | None = None, keep_completions: bool = False,
                 warmup: bool = True, callback=None) -> StreamReport:
    """Serve ``chunks`` of prompts (text or token ids) with speculative decoding and adapt the
    draft after each chunk by ``config.method``. The target never changes, so every output is
    the target's own (token for token its greedy output at temperature 0). ``warmup``
    compiles each new batch shape before it is timed; ``callback(chunk_report)`` runs after
    each chunk. Returns per-chunk measurements and the final draft (a new module: the
    ``draft`` passed in is not modified)."""
    if not isinstance(config, OnlineSpecConfig):
        raise TypeError(f"config must be an OnlineSpecConfig, got {type(config).__name__}")
    tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    dg, params = nnx.split(draft)
    params = jax.tree.map(jnp.copy, params)  # the caller's draft stays as it was
    opt_state = None
    seen_shapes = set()
    reports = []
    rng = jax.random.key(config.seed)
    B = config.batch_size
    gen_kw = dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, tokenizer=tokenizer,
                  stop_tokens=stop_tokens, num_draft_tokens=config.num_draft_tokens)
    for t, chunk in enumerate(chunks):
        token_lists = _as_token_lists(list(chunk), tokenizer, add_bos=True)
        current = nnx.merge(dg, params)
        results, real, seconds = [], [], 0.0
        for i in range(0, len(token_lists), B):
            batch = token_lists[i: i + B]
            n_real = len(batch)
            batch = batch + [batch[-1]] * (B - n_real)  # one batch shape: one compilation
            shape = -(-max(map(len, batch)) // 8)
            if warmup and shape not in seen_shapes:
                jax.block_until_ready(generate(target, batch, draft=current, rng=rng, **gen_kw).tokens)
            seen_shapes.add(shape)
            rng, key = jax.random.split(rng)
            start = time.perf_counter()
            r = generate(target, batch, draft=current, rng=key, **gen_kw)
            jax.block_until_ready(r.tokens)
            seconds += time.perf_counter() - start
            results.append(_take_rows(r, n_real))
        generated = sum(int(np.sum(r.lengths)) for r in results)
        rounds = sum(int(np.sum(r.verify_rounds)) for r in results)
        accepted, complete = 0, 0
        for r in results:
            acc, n_rounds = np.asarray(r.accepted_lengths), np.asarray(r.verify_rounds)
            full = np.arange(acc.shape[1])[None, :] < (n_rounds - 1)[:, None]  # every round but each row's last
            accepted += int(np.sum(np.where(full, acc, 0)))
            complete += int(np.sum(np.maximum(n_rounds - 1, 0)))
        report = ChunkReport(
            index=t, prompts=len(token_lists), generated_tokens=generated, verify_rounds=rounds,
            tokens_per_round=(generated - len(token_lists)) / max(rounds, 1),
            accept_rate=accepted / complete / config.num_draft_tokens if complete else float("nan"),
            serve_seconds=seconds, tokens_per_second=generated / max(seconds, 1e-12),
            completions=[c for r in results for c in r.completions()] if keep_completions else None,
        )
        if config.method != "static":
            start = time.perf_counter()
            fb = _feedback(results, current, target, width_multiple=16, mismatch_only=config.method == "osd")
            seed = config.seed * 1_000_003 + t
            if config.method == "ensemble":
                learners, losses = [], []
                for lr in config.ensemble_learning_rates:
                    p_k, _, loss_k = fit_draft(current, target, fb, params=params, optimizer=config.ensemble_optimizer,
                                               learning_rate=lr, epochs=config.ensemble_epochs,
                                               batch_size=config.train_batch_size, seed=seed)
                    if config.ensemble_loss == "post_fit":
                        loss_k = feedback_loss(current, target, fb, params=p_k, batch_size=config.train_batch_size)
                    learners.append(p_k)
                    losses.append(loss_k)
                losses = [loss if all_finite(p_k) else float("inf") for p_k, loss in zip(learners, losses)]
                if np.isfinite(losses).any():
                    w = ensemble_weights(losses, config.ensemble_temperature)
                    params = average_params(learners, w)
                    report.train_loss = float(np.sum(w * np.where(np.isfinite(losses), losses, 0.0)))
                else:  # every learner diverged: the draft keeps its parameters
                    w = np.zeros(len(losses))
                    report.train_loss = float("inf")
                    log.warning("online spec chunk %d: every ensemble learner diverged; the draft is unchanged", t)
                report.ensemble_weights = [float(x) for x in w]
            else:
                new_params, new_state, report.train_loss = fit_draft(
                    current, target, fb, params=params, opt_state=opt_state, optimizer=config.optimizer,
                    learning_rate=config.learning_rate, momentum=config.momentum, epochs=config.epochs,
                    batch_size=config.train_batch_size, seed=seed)
                if np.isfinite(report.train_loss):
                    params = new_params
                    opt_state = new_state if config.persist_optimizer_state else None
                else:  # a diverged update would serve a NaN draft from now on: keep the last good one
                    log.warning("online spec chunk %d: the draft's update diverged; the draft is unchanged", t)
            jax.block_until_ready(params)
            report.adapt_seconds = time.perf_counter() - start
        reports.append(report)
        if callback is not None:
            callback(report)
    if not reports:
        raise ValueError("chunks is empty: the stream needs at least one chunk of prompts")
    return StreamReport(config=config, chunks=reports, draft=nnx.merge(dg, params))


def _take_rows(r, n: int):
    """The first ``n`` rows of a `GenerateResult` (the rest padded the batch)."""
    if n == r.tokens.shape[0]:
        return r
    cut = lambda x: None if x is None else x[:n]  # noqa: E731
    return dataclasses.replace(
        r, tokens=r.tokens[:n], logprobs=r.logprobs[:n], sampling_logprobs=r.sampling_logprobs[:n],
        lengths=r.lengths[:n], prompt_tokens=r.prompt_tokens[:n], prompt_lengths=r.prompt_lengths[:n],
        texts=None if r.texts is None else r.texts[:n], accepted_lengths=cut(r.accepted_lengths),
        verify_rounds=cut(r.verify_rounds), exit_layers=cut(r.exit_layers))

"""Above `trainers.step.CHUNKED_LOSS_BYTES` the SFT loss never materialises the whole
``[B, T, V]`` logits: its gradient's jaxpr holds no array of ``B * T * V`` elements (chunks of
``512 x V`` only), and the chunked loss equals the full-logits one. At the Qwen3-0.6B vocabulary and 32 x 256 tokens on one device this took
XLA's temporaries from 18.1 to 6.0 GiB (docs/benchmarks.md, scale check)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlm
from jaxlm.models.params import model_from_flat, param_shapes
from trainers.losses import sft_loss_sum
import trainers.step as step_module
from trainers.step import forward, make_loss_fn

B, T, V = 4, 256, 2048


def _batch():
    rng = np.random.default_rng(0)
    seg = np.ones((B, T), np.int32)
    seg[1, 200:] = 0  # padding
    return dict(
        tokens=jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
        positions=jnp.asarray(np.broadcast_to(np.arange(T), (B, T)), jnp.int32),
        segment_ids=jnp.asarray(seg),
        loss_mask=jnp.asarray(rng.random((B, T)) < 0.8),
    )


def _avals(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _avals(sub)


def _model(tie: bool):
    cfg = jaxlm.ModelConfig.tiny(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                 max_seq_len=T, tie_embeddings=tie)
    rng = np.random.default_rng(1)
    flat = {k: 0.1 * rng.standard_normal(s.shape).astype(np.float32) for k, s in param_shapes(cfg).items()}
    graphdef, params = nnx.split(model_from_flat(cfg, flat))
    return graphdef, nnx.to_pure_dict(params)


def test_sft_loss_gradient_never_holds_whole_logits(monkeypatch):
    monkeypatch.setattr(step_module, "CHUNKED_LOSS_BYTES", B * T * V * 4 - 1)
    batch = _batch()
    for tie in (True, False):
        graphdef, params = _model(tie)
        grad_fn = jax.value_and_grad(make_loss_fn(graphdef, sliding_window=None), has_aux=True)
        sizes = [int(np.prod(a.shape)) for a in _avals(jax.make_jaxpr(grad_fn)(params, batch).jaxpr)
                 if hasattr(a, "shape")]
        assert max(sizes) < B * T * V, (tie, max(sizes))
        assert max(sizes) >= 512 * V  # the chunks are there: the check sees the LM head at all


def test_small_logits_keep_the_whole_logits_path():
    graphdef, params = _model(tie=True)
    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, sliding_window=None), has_aux=True)
    sizes = [int(np.prod(a.shape)) for a in _avals(jax.make_jaxpr(grad_fn)(params, _batch()).jaxpr)
             if hasattr(a, "shape")]
    assert B * T * V * 4 <= step_module.CHUNKED_LOSS_BYTES and max(sizes) == B * T * V


def test_chunked_sft_loss_equals_full_logits(monkeypatch):
    monkeypatch.setattr(step_module, "CHUNKED_LOSS_BYTES", 0)
    batch = _batch()
    graphdef, params = _model(tie=True)
    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, sliding_window=None), has_aux=True)

    def full(p):
        return sft_loss_sum(forward(graphdef, p, batch, sliding_window=None).logits, batch)

    (total, count), grads = jax.jit(grad_fn)(params, batch)
    (ref_total, ref_count), ref_grads = jax.jit(jax.value_and_grad(full, has_aux=True))(params)
    assert float(count) == float(ref_count)
    np.testing.assert_allclose(float(total), float(ref_total), rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-6 * float(np.abs(r).max()) + 1e-9)

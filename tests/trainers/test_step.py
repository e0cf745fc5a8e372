"""The training step: exact gradient accumulation, packing without cross-document
attention, non-finite steps leave the state unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlm
from jaxlm.models.masks import segment_mask
from trainers.optim import make_optimizer
from trainers.config import OptimizerConfig
from trainers.step import init_state, make_loss_fn, make_train_step

from packed_rows import packed_row, stacked

CFG = jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, init_std=0.1)
TOK = jaxlm.ByteTokenizer()


def _row(examples, T=48):
    return packed_row(examples, TOK, T)


_batch = stacked


EXAMPLES = [
    {"prompt": "12+30=", "completion": "42"},
    {"prompt": "7+8=", "completion": "15"},
    {"prompt": "sort 3 1 2:", "completion": "1 2 3"},
    {"prompt": "a", "completion": "a much longer completion here"},
]


@pytest.fixture(scope="module")
def model_parts():
    model = jaxlm.build_model(CFG, seed=0)
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def test_exact_gradient_accumulation(model_parts):
    """Two micro-batches with very different token counts == one batch (token mean)."""
    graphdef, params = model_parts
    batch = _batch([_row(EXAMPLES[:1]), _row(EXAMPLES[3:4])])  # 3 vs 30 trained tokens
    assert int(batch["loss_mask"][0].sum()) != int(batch["loss_mask"][1].sum())
    # an "optimizer" that stores the gradient it receives in its state (comparing Adam steps
    # would amplify rounding in near-zero gradients to +-lr)
    tx = optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g)
    )
    schedule = lambda step: 1.0
    one = make_train_step(graphdef, tx, schedule, grad_accum=1, donate=False)
    two = make_train_step(graphdef, tx, schedule, grad_accum=2, donate=False)
    s1, m1 = one(init_state(params, tx, 0), batch)
    s2, m2 = two(init_state(params, tx, 0), batch)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
    for g1, g2 in zip(jax.tree.leaves(s1.opt_state), jax.tree.leaves(s2.opt_state)):
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6 * np.abs(g1).max())
    # the naive mean of the two micro-batch means is a different number
    loss_fn = make_loss_fn(graphdef, sliding_window=None)
    means = [float(s / n) for s, n in (loss_fn(params, jax.tree.map(lambda x: x[i : i + 1], batch)) for i in range(2))]
    assert abs(np.mean(means) - float(m1["loss"])) > 1e-3


def test_packing_never_leaks_attention(model_parts):
    """Logits of each document in a packed row equal its logits run alone, and changing one
    document does not change the other's logits."""
    graphdef, params = model_parts
    model = nnx.merge(graphdef, params)
    packed = _batch([_row(EXAMPLES[:3])])
    mask = segment_mask(packed["segment_ids"])
    logits = model(packed["tokens"], packed["positions"], mask=mask).logits[0]
    seg = np.asarray(packed["segment_ids"][0])
    for i, ex in enumerate(EXAMPLES[:3], 1):
        alone = _batch([_row([ex])])
        ref = model(alone["tokens"], alone["positions"], mask=segment_mask(alone["segment_ids"])).logits[0]
        n = int((seg == i).sum())
        np.testing.assert_allclose(logits[seg == i], ref[:n], atol=1e-5)
    # perturb document 1: documents 2 and 3 are untouched
    other = _batch([_row([{"prompt": "99+99=", "completion": "198"}, *EXAMPLES[1:3]])])
    other_logits = model(other["tokens"], other["positions"], mask=segment_mask(other["segment_ids"])).logits[0]
    seg_o = np.asarray(other["segment_ids"][0])
    np.testing.assert_allclose(other_logits[seg_o == 2], logits[seg == 2], atol=1e-6)


def test_loss_ignores_prompt_and_cross_document_targets():
    from trainers.losses import next_token_targets

    batch = _batch([_row(EXAMPLES[:2])])
    targets, valid = next_token_targets(batch)
    valid = np.asarray(valid[0])
    # trained positions: predictions of completion tokens + EOS within the same document
    expected = sum(len(TOK.encode(e["completion"])) + 1 for e in EXAMPLES[:2])
    assert valid.sum() == expected
    seg = np.asarray(batch["segment_ids"][0])
    boundary = np.flatnonzero(np.diff(seg) != 0)
    assert not valid[boundary].any()


def test_non_finite_step_keeps_state(model_parts):
    graphdef, params = model_parts
    tx, schedule = make_optimizer(OptimizerConfig(), 10)

    def nan_weights(batch, logits):
        return jnp.full(batch["tokens"].shape, jnp.nan)

    step = make_train_step(graphdef, tx, schedule, weight_fn=nan_weights, donate=False)
    state = init_state(params, tx, 0)
    new, metrics = step(state, _batch([_row(EXAMPLES[:2])]))
    assert not bool(metrics["finite"])
    assert int(new.step) == 0
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
        np.testing.assert_array_equal(a, b)


def test_bf16_compute_keeps_fp32_master_weights():
    cfg = CFG.replace(dtype="bfloat16", param_dtype="float32")
    model = jaxlm.build_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0), 10)
    step = make_train_step(graphdef, tx, schedule, donate=False)
    new, metrics = step(init_state(params, tx, 0), _batch([_row(EXAMPLES[:2])]))
    assert bool(metrics["finite"]) and float(metrics["loss"]) > 0
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(new.params))
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(new.opt_state) if hasattr(m, "dtype") and m.ndim)
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new.params))]
    assert min(moved) > 0  # every parameter received an update


def test_chunked_token_logprobs_match_log_softmax():
    from jaxlm.models.logprobs import token_logprobs

    rng = np.random.RandomState(0)
    h = jnp.asarray(rng.randn(37, 16), jnp.float32)  # 37 rows: not a multiple of the chunk
    w = jnp.asarray(rng.randn(16, 50) * 0.3, jnp.float32)
    t = jnp.asarray(rng.randint(0, 50, 37))
    c = jnp.asarray(rng.randn(37), jnp.float32)  # an arbitrary cotangent

    def ref(h, w):
        return jnp.sum(c * jnp.take_along_axis(jax.nn.log_softmax(h @ w), t[:, None], -1)[:, 0])

    def chunked(h, w):
        return jnp.sum(c * token_logprobs(h, w, t, chunk=8))

    np.testing.assert_allclose(chunked(h, w), ref(h, w), rtol=1e-5)
    for a, b in zip(jax.grad(chunked, (0, 1))(h, w), jax.grad(ref, (0, 1))(h, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # a target outside [0, V) (-1, an ignore id -100, V) is NaN, not another token's log-prob,
    # and a jnp.where mask leaves the value and the gradient of the valid rows exact
    bad = t.at[jnp.array([3, 9, 20])].set(jnp.array([-1, -100, 50]))
    lp = token_logprobs(h, w, bad, chunk=8)
    assert np.isnan(np.asarray(lp)[[3, 9, 20]]).all() and np.isfinite(np.delete(np.asarray(lp), [3, 9, 20])).all()
    keep = (bad >= 0) & (bad < 50)

    def masked(h, w):
        return jnp.sum(jnp.where(keep, c * token_logprobs(h, w, bad, chunk=8), 0.0))

    def masked_ref(h, w):
        picked = jnp.take_along_axis(jax.nn.log_softmax(h @ w), jnp.clip(bad, 0, 49)[:, None], -1)[:, 0]
        return jnp.sum(jnp.where(keep, c * picked, 0.0))

    np.testing.assert_allclose(masked(h, w), masked_ref(h, w), rtol=1e-5)
    for a, b in zip(jax.grad(masked, (0, 1))(h, w), jax.grad(masked_ref, (0, 1))(h, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_training_only_the_hypernetwork_keeps_the_base_frozen():
    """optimizer.trainable='meta_gate': the base is bit-identical after training, the
    condition-dependent loss goes down (gradients reach the hypernetwork through beta)."""
    from jaxlm.data.conditioned import ConditionedDigits
    from jaxlm.data.pipeline import DataConfig, train_dataset

    cfg = CFG.replace(mlp="meta_swiglu", meta_rank=16)
    model = jaxlm.build_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    data = DataConfig(source=ConditionedDigits(condition_in="hyper"), seq_len=32, batch_size=16)
    batch = {k: jnp.asarray(v) for k, v in next(iter(train_dataset(data, TOK))).items()}
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0, trainable="meta_gate"), 50)
    step = make_train_step(graphdef, tx, schedule, donate=False, beta_l1=1e-4)
    state0 = init_state(params, tx, 0)
    s, first = step(state0, batch)
    for _ in range(30):
        s, m = step(s, batch)
    assert float(m["loss"]) < float(first["loss"]) - 0.05
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(jax.tree.leaves(s.params[name])[0]), np.asarray(jax.tree.leaves(params[name])[0]))
    np.testing.assert_array_equal(s.params["layers"][0]["mlp"]["up_proj"]["kernel"], params["layers"][0]["mlp"]["up_proj"]["kernel"])
    assert float(jnp.abs(s.params["meta_gate"]["w_beta"]).max()) > 0


def test_the_second_step_reuses_the_first_steps_compilation(model_parts, caplog):
    """As the training loops place it (parameters on a mesh by their logical axes, Adam), the
    state a step returns has the shardings of the state it was given, so the update compiles
    once (before `StateShardedJit` and the committed `init_state` it compiled twice: a
    replicated vector came back as P() instead of P(None,), the optimizer state committed)."""
    import logging

    from jaxlm.sharding import make_mesh, model_shardings

    graphdef, params = model_parts
    shardings = nnx.to_pure_dict(model_shardings(nnx.merge(graphdef, params), make_mesh(1, 1, 1)))
    tx = optax.adamw(1e-3)
    step = make_train_step(graphdef, tx, lambda s: 1e-3)
    state = init_state(jax.device_put(jax.tree.map(jnp.copy, params), shardings), tx, 0)
    batch = _batch([_row(EXAMPLES[:2]), _row(EXAMPLES[2:3])])
    before = jax.tree.map(lambda x: x.sharding, state)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        for _ in range(3):
            state, metrics = step(state, batch)
    assert jax.tree.map(lambda x: x.sharding, state) == before
    compiles = [r for r in caplog.records if "XLA compilation of jit(step)" in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage()[:120] for r in compiles]
    assert bool(metrics["finite"])


def test_init_state_commits_an_optimizer_state_optax_cannot_map(model_parts):
    """An optimizer whose init reads the parameters' structure (optax's placeholder has none)
    still gets a committed state, next to the parameters."""
    graphdef, params = model_parts
    tx = optax.GradientTransformation(lambda p: {"rows": jnp.zeros(p["embed"].shape[0])},
                                      lambda g, s, p=None: (g, s))
    with pytest.raises((TypeError, ValueError, AttributeError)):
        optax.tree_map_params(tx, lambda _, x: x, jax.eval_shape(tx.init, params), params)
    state = init_state(params, tx, 0)
    device = jax.tree.leaves(params)[0].sharding
    assert state.opt_state["rows"].shape == (CFG.vocab_size,)
    assert all(x.sharding.device_set == device.device_set for x in jax.tree.leaves(state))


def _param_tree(rng):
    return {
        "embed": jnp.asarray(rng.randn(50, 16), jnp.float32),
        "layers": [{"kernel": jnp.asarray(rng.randn(16, 24), jnp.float32),
                    "scale": jnp.asarray(rng.randn(24), jnp.float32)}],
        "attn": {"rope_inv_freq": jnp.asarray(rng.rand(2, 4), jnp.float32)},
    }


@pytest.mark.parametrize("weight_decay,clip_norm", [(0.01, 1.0), (0.0, None), (0.1, 100.0)])
def test_in_place_adamw_matches_the_optax_chain(weight_decay, clip_norm):
    """`apply_if_finite` on `make_optimizer`'s AdamW == optax's clip + adamw chain and
    ``apply_updates`` (the weight-decay mask, warmup, clipping on and off), step by step; a
    non-finite step returns the state it was given."""
    from trainers.optim import ClippedAdamW, apply_if_finite, decay_mask

    rng = np.random.RandomState(0)
    params = _param_tree(rng)
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=3, weight_decay=weight_decay, clip_norm=clip_norm)
    tx, schedule = make_optimizer(cfg, 20)
    assert isinstance(tx, ClippedAdamW)
    ref_tx = optax.chain(
        *([optax.clip_by_global_norm(clip_norm)] if clip_norm is not None else []),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=weight_decay, mask=decay_mask),
    )

    @jax.jit
    def ours(g, s, p, finite):
        return apply_if_finite(tx, g, optax.tree.norm(g), finite, s, p)

    @jax.jit
    def ref(g, s, p):
        u, s = ref_tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p1 = p2 = params
    s1 = s2 = tx.init(params)
    assert jax.tree.structure(s1) == jax.tree.structure(ref_tx.init(params))
    for i in range(6):
        g = jax.tree.map(lambda x: jnp.asarray(rng.randn(*x.shape) * (3.0 if i % 2 else 0.01), jnp.float32), params)
        p1, s1 = ours(g, s1, p1, jnp.asarray(True))
        p2, s2 = ref(g, s2, p2)
        assert jax.tree.structure(s1) == jax.tree.structure(s2)
        for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    kept = ours(g, s1, p1, jnp.asarray(False))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves((p1, s1))):
        np.testing.assert_array_equal(a, b)


def test_train_step_matches_a_plain_optax_step(model_parts):
    """Three steps of `make_train_step` (custom cross-entropy gradient, in-place AdamW, the
    reciprocal-scaled gradient) against a step written from scratch: ``log_softmax`` NLL,
    ``jax.grad``, optax's chain, ``apply_updates``."""
    graphdef, params = model_parts
    cfg = OptimizerConfig(lr=3e-3, warmup_steps=0, schedule="constant", weight_decay=0.01, clip_norm=0.5)
    tx, schedule = make_optimizer(cfg, 10)
    from trainers.optim import decay_mask

    ref_tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                         optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                     mask=decay_mask))
    batch = _batch([_row(EXAMPLES[:2]), _row(EXAMPLES[2:3])])
    tokens, seg, mask = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"]), np.asarray(batch["loss_mask"])
    valid = np.zeros_like(mask)
    valid[:, :-1] = mask[:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], 1)

    def ref_loss(p):
        model = nnx.merge(graphdef, p)
        logits = model(batch["tokens"], batch["positions"], mask=segment_mask(batch["segment_ids"])).logits
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(valid, nll, 0.0)) / valid.sum()

    @jax.jit
    def ref_step(p, s):
        loss, g = jax.value_and_grad(ref_loss)(p)
        u, s = ref_tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, optax.tree.norm(g)

    # the gradient itself, through an "optimizer" that stores what it receives
    store = optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g)
    )
    stored, _ = make_train_step(graphdef, store, schedule, donate=False)(init_state(params, store, 0), batch)
    for a, b in zip(jax.tree.leaves(stored.opt_state), jax.tree.leaves(jax.grad(ref_loss)(params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())

    step = make_train_step(graphdef, tx, schedule, donate=False)
    state = init_state(params, tx, 0)
    p, s = params, ref_tx.init(params)
    for _ in range(3):
        state, metrics = step(state, batch)
        p, s, loss, norm = ref_step(p, s)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
        np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
    # Adam divides by sqrt(v): rounding in a near-zero gradient moves its update by up to lr,
    # so parameters are compared to a fraction of lr
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * cfg.lr)
    assert int(state.step) == 3


def test_token_nll_value_and_gradient_match_numpy():
    """The cross-entropy and its custom gradient ``c (softmax - onehot)`` against float64
    numpy, including large logits (the max shift) and a row whose target dominates."""
    from trainers.losses import token_nll

    rng = np.random.RandomState(0)
    logits = rng.randn(3, 5, 40) * 4
    logits[0, 0] += 80.0
    targets = rng.randint(0, 40, (3, 5))
    logits[1, 2, targets[1, 2]] += 30.0
    c = rng.randn(3, 5)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    grad = c[..., None] * (np.exp(logp) - np.eye(40)[targets])
    x, t = jnp.asarray(logits, jnp.float32), jnp.asarray(targets, jnp.int32)
    np.testing.assert_allclose(token_nll(x, t), nll, rtol=1e-5, atol=1e-5)
    ours = jax.grad(lambda x: jnp.sum(jnp.asarray(c, jnp.float32) * token_nll(x, t)))(x)
    np.testing.assert_allclose(ours, grad, rtol=1e-5, atol=1e-6)
    bf16 = jax.grad(lambda x: jnp.sum(token_nll(x, t)))(x.astype(jnp.bfloat16))
    assert bf16.dtype == jnp.bfloat16


def test_a_weight_sum_below_one_still_normalises_the_loss():
    """Self-normalised weights (PEAR) make the count a sum of weights that may be below 1:
    the loss and gradient are divided by it; only an empty batch (count 0) is guarded."""
    from trainers.step import apply_summed_gradients

    params = {"w": jnp.ones((3,))}
    state = init_state(params, optax.sgd(1.0), seed=0)
    g_sum, loss_sum = {"w": jnp.asarray([0.2, 0.0, -0.1])}, jnp.float32(0.3)
    for count, want in ((0.25, 1.2), (4.0, 0.075), (0.0, 0.3)):
        new, loss, grad_norm, finite = apply_summed_gradients(state, optax.sgd(1.0), g_sum, loss_sum, jnp.float32(count))
        d = count if count > 0 else 1.0
        np.testing.assert_allclose(float(loss), want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(new.params["w"]), 1.0 - np.asarray(g_sum["w"]) / d, rtol=1e-6)


def test_weight_decay_mask_is_the_same_with_stacked_layers():
    """Decay on matrices only, whether the layers are separate or stacked along a leading
    [L] axis (`scan_layers`): norm scales and biases are never decayed."""
    from trainers.optim import decay_mask, param_names

    def decayed(scan, prefix=None):
        model = jaxlm.build_model(jaxlm.ModelConfig.tiny(scan_layers=scan, qkv_bias=True, qk_norm=True))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        params = params if prefix is None else {prefix: params}  # an omni model holds its LM under "lm"
        names, mask = jax.tree.leaves(param_names(params)), jax.tree.leaves(decay_mask(params))
        cut = 0 if prefix is None else len(prefix) + 1
        return {".".join(p for p in n[cut:].split(".") if not p.isdigit()) for n, m in zip(names, mask) if m}

    stacked, separate = decayed(True), decayed(False)
    assert stacked == separate == decayed(True, "lm") == decayed(False, "lm")
    assert all(n.endswith(("kernel", "embed", "embedding")) for n in stacked), stacked

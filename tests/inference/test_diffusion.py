"""Masked diffusion LMs: LLaDA's schedule and sampler, Fast-dLLM, dLLM-Cache, SPEED's Slow-Fast
rule, checked against hand cases, scipy and the uncached sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.spatial.distance import jensenshannon

import jaxlm
from jaxlm.inference.diffusion import DLLMCache, SlowFast, diffusion_generate, num_transfer_tokens
from jaxlm.inference.diffusion import forward as fw
from jaxlm.inference.diffusion.commit import (
    commit_slow_fast,
    commit_threshold,
    commit_top_k,
    jensen_shannon,
    predict,
)
from jaxlm.models.transformer import build_model

MASK = 259
PROMPTS = ["12+34=", "7+8=", "99+1="]


def diffusion_config(**kw):
    return jaxlm.ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=MASK, **kw)


@pytest.fixture(scope="module")
def model():
    # a larger init scale makes the random model's predictions depend on context (confident, varied)
    return build_model(diffusion_config(init_std=0.3), seed=1, tokenizer=jaxlm.ByteTokenizer())


@pytest.fixture(scope="module")
def baseline(model):
    return diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4)


# ------------------------------------------------------------------ schedule and commit rules
def test_num_transfer_tokens_hand_cases():
    assert num_transfer_tokens(10, 4).tolist() == [3, 3, 2, 2]
    assert num_transfer_tokens(8, 8).tolist() == [1] * 8
    assert num_transfer_tokens(3, 5).tolist() == [1, 1, 1, 0, 0]
    assert num_transfer_tokens(np.array([10, 4]), 4).tolist() == [[3, 3, 2, 2], [1, 1, 1, 1]]
    for n in range(0, 40):
        for s in range(1, 9):
            k = num_transfer_tokens(n, s)
            assert k.sum() == n and k.max() - k.min() <= 1 and list(k) == sorted(k, reverse=True)
    with pytest.raises(ValueError, match="steps"):
        num_transfer_tokens(4, 0)


def test_commit_rules_hand_case():
    tokens = jnp.asarray([[MASK, 5, MASK, MASK, MASK]])
    masked = tokens == MASK
    proposal = jnp.asarray([[10, 11, 12, 13, 14]])
    conf = jnp.asarray([[0.5, 0.99, 0.95, 0.2, 0.5]])
    new, sel = commit_top_k(tokens, masked, proposal, conf, jnp.asarray(2))
    # the committed 5 is never re-proposed; 0.95 first, then the earlier of the two 0.5s
    assert new.tolist() == [[10, 5, 12, MASK, MASK]] and sel.sum() == 2
    new, _ = commit_threshold(tokens, masked, proposal, conf, 0.9)
    assert new.tolist() == [[MASK, 5, 12, MASK, MASK]]
    new, _ = commit_threshold(tokens, masked, proposal, conf, 0.4)
    assert new.tolist() == [[10, 5, 12, MASK, 14]]
    new, _ = commit_threshold(jnp.asarray([[5, 6]]), jnp.zeros((1, 2), bool), proposal[:, :2], conf[:, :2], 0.0)
    assert new.tolist() == [[5, 6]]  # nothing masked: nothing committed


def test_predict_temperature_zero_is_argmax_and_sampling_follows_softmax():
    logits = jnp.asarray([[[0.0, 1.0, 0.5], [2.0, -1.0, 0.0]]])
    prop, conf = predict(logits, jax.random.key(0), temperature=0.0, remasking="low_confidence")
    assert prop.tolist() == [[1, 0]]
    np.testing.assert_allclose(conf, jax.nn.softmax(logits, -1).max(-1), rtol=1e-6)
    # Gumbel-max at temperature 1 draws from softmax(logits)
    keys = jax.random.split(jax.random.key(1), 4000)
    draws = jax.vmap(lambda k: predict(logits, k, temperature=1.0, remasking="low_confidence")[0])(keys)
    freq = np.bincount(np.asarray(draws[:, 0, 0]), minlength=3) / 4000
    np.testing.assert_allclose(freq, jax.nn.softmax(logits[0, 0]), atol=0.03)
    with pytest.raises(ValueError, match="remasking"):
        predict(logits, jax.random.key(0), temperature=0.0, remasking="top")


def test_jensen_shannon_matches_scipy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 7)) * 3, rng.normal(size=(6, 7))
    ref = [jensenshannon(jax.nn.softmax(x), jax.nn.softmax(y)) ** 2 for x, y in zip(a, b)]  # scipy: sqrt, base e
    np.testing.assert_allclose(jensen_shannon(jnp.asarray(a), jnp.asarray(b)), ref, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(jensen_shannon(jnp.asarray(a), jnp.asarray(a)), 0.0, atol=1e-6)
    one_hot = jnp.asarray([[50.0, -50.0], [-50.0, 50.0]])  # disjoint supports: log 2
    np.testing.assert_allclose(jensen_shannon(one_hot[:1], one_hot[1:]), np.log(2), rtol=1e-5)


@pytest.mark.parametrize("fast", ["low", "high"])
def test_slow_fast_commit_direction(fast):
    tokens = jnp.full((1, 4), MASK)
    masked = tokens == MASK
    proposal = jnp.asarray([[1, 2, 3, 4]])
    conf = jnp.asarray([[0.3, 0.9, 0.95, 0.1]])
    jsd = jnp.asarray([[0.01, 0.5, 0.01, 0.01]])
    new, _ = commit_slow_fast(tokens, masked, proposal, conf, jsd, jsd_threshold=0.1, confidence=0.8, fast=fast)
    if fast == "low":  # low-JSD, confident: position 2 (also the top-1)
        assert new.tolist() == [[MASK, MASK, 3, MASK]]
    else:  # high-JSD, confident: position 1, plus the top-1 (position 2)
        assert new.tolist() == [[MASK, 2, 3, MASK]]


# ------------------------------------------------------------------ the sampler
def test_temperature_zero_is_deterministic(model, baseline):
    again = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4, rng=123)
    np.testing.assert_array_equal(again.tokens, baseline.tokens)
    assert baseline.steps == 16 and baseline.forwards == 16 and baseline.tokens_per_step == 1.0
    assert not (baseline.tokens == MASK).any()
    a = diffusion_generate(model, PROMPTS, gen_length=16, steps=8, block_length=4, temperature=1.0, rng=5)
    b = diffusion_generate(model, PROMPTS, gen_length=16, steps=8, block_length=4, temperature=1.0, rng=5)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.steps == 8 and a.tokens_per_step == 2.0


def test_batched_rows_match_rows_alone(model, baseline):
    alone = diffusion_generate(model, PROMPTS[1:2], gen_length=16, steps=16, block_length=4)
    np.testing.assert_array_equal(alone.tokens[0], baseline.tokens[1])


def test_fast_dllm_threshold_one_equals_one_token_per_step(model, baseline):
    out = diffusion_generate(model, PROMPTS, gen_length=16, block_length=4, threshold=1.0)
    np.testing.assert_array_equal(out.tokens, baseline.tokens)
    assert out.steps == 16
    fast = diffusion_generate(model, PROMPTS, gen_length=16, block_length=4, threshold=0.0)
    assert fast.steps == 4 and not (fast.tokens == MASK).any()  # one step per block


@pytest.mark.parametrize("threshold", [0.1, 0.3])
def test_row_steps_are_each_rows_steps_decoded_alone(model, baseline, threshold):
    """A batch advances until its slowest row is done; ``row_steps`` counts each row's own."""
    assert baseline.row_steps.tolist() == [16, 16, 16]  # the fixed schedule: every row every step
    out = diffusion_generate(model, PROMPTS, gen_length=16, block_length=4, threshold=threshold)
    alone = [diffusion_generate(model, [p], gen_length=16, block_length=4, threshold=threshold) for p in PROMPTS]
    assert out.row_steps.tolist() == [a.steps for a in alone] == [int(a.row_steps[0]) for a in alone]
    # the batch waits, block by block, for its slowest row; at least one step per block
    assert out.steps >= max(out.row_steps) and min(out.row_steps) >= 4
    one_block = diffusion_generate(model, PROMPTS, gen_length=8, threshold=threshold)
    assert one_block.steps == max(one_block.row_steps)
    for i, a in enumerate(alone):
        np.testing.assert_array_equal(out.tokens[i], a.tokens[0])


def test_dllm_cache_refreshing_every_step_is_the_uncached_sampler_bit_for_bit(model, baseline):
    out = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4, cache=DLLMCache(1, 1, 0.25))
    np.testing.assert_array_equal(out.tokens, baseline.tokens)
    assert out.flops == baseline.flops


def test_dllm_cache_with_scanned_layers_bit_for_bit():
    m = build_model(diffusion_config(init_std=0.3, scan_layers=True), seed=1, tokenizer=jaxlm.ByteTokenizer())
    ref = diffusion_generate(m, PROMPTS, gen_length=8, steps=8, block_length=4)
    out = diffusion_generate(m, PROMPTS, gen_length=8, steps=8, block_length=4, cache=DLLMCache(1, 1, 0.5))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    cached = diffusion_generate(m, PROMPTS, gen_length=8, steps=8, block_length=4, cache=DLLMCache(4, 2, 0.5))
    assert cached.flops < ref.flops and not (cached.tokens == MASK).any()


@pytest.fixture(scope="module")
def cached_state(model):
    """Caches of a full forward on x, then x with three response tokens committed."""
    tok = jaxlm.ByteTokenizer()
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS]
    P, G = 8, 8
    x = np.full((3, P + G), MASK, np.int32)
    valid = np.ones((3, P + G), bool)
    for i, p in enumerate(ids):
        x[i, :P - len(p)], valid[i, :P - len(p)] = 0, False
        x[i, P - len(p):P] = p
    x, valid = jnp.asarray(x), jnp.asarray(valid)
    _, caches = fw.full_forward(model, x, valid, start=P, collect=True)
    x2 = x.at[:, P:P + 3].set(jnp.asarray([[20, 30, 40]]))
    return x2, valid, caches, P


def test_partial_update_with_rho_one_recomputes_every_response_token(model, cached_state):
    x2, valid, caches, P = cached_state
    refreshed, _ = fw.dllm_cache_forward(model, x2, valid, caches, 1, prompt_len=P, transfer_ratio=0.0)
    all_tokens, new = fw.dllm_cache_forward(model, x2, valid, caches, 3, prompt_len=P, transfer_ratio=1.0)
    np.testing.assert_allclose(all_tokens, refreshed, rtol=1e-5, atol=1e-5)
    # every response slot's attention and MLP outputs were rewritten in every layer after the first
    for name in ("attn", "mlp"):
        changed = np.abs(np.asarray(new[name][1:, :, P:] - caches[name][1:, :, P:])).max(-1) > 0
        assert changed.all()
    # rho = 0: the response reuses every cached sub-layer output after the first layer
    _, none = fw.dllm_cache_forward(model, x2, valid, caches, 3, prompt_len=P, transfer_ratio=0.0)
    for name in ("attn", "mlp"):
        np.testing.assert_array_equal(none[name][1:], caches[name][1:])
    # and its values too: at rho = 0 the reference skips the partial update altogether
    np.testing.assert_array_equal(none["v"][1:], caches["v"][1:])


def test_partial_update_recomputes_the_least_similar_tokens(model, cached_state):
    x2, valid, caches, P = cached_state
    G = x2.shape[1] - P
    _, new = fw.dllm_cache_forward(model, x2, valid, caches, 3, prompt_len=P, transfer_ratio=0.25)
    k = int(G * 0.25)
    changed = np.abs(np.asarray(new["mlp"][1:, :, P:] - caches["mlp"][1:, :, P:])).max(-1) > 0  # [L-1, B, G]
    assert (changed.sum(-1) == k).all()
    # layer 1: recomputed = the k response tokens whose new values have the lowest cosine to the cached ones
    block = fw.blocks(model)[1]
    x = fw.embed(model, x2)
    a, m, _, _ = fw.layer_queries(fw.blocks(model)[0], x, fw.positions_of(valid),
                                  jnp.broadcast_to(jnp.arange(x2.shape[1]), x2.shape), caches["k"][0],
                                  caches["v"][0], valid)
    h = block.attn_norm((x + a + m)[:, P:])
    v_new = np.asarray(block.attn.v_proj(h)).reshape(3, G, -1)
    v_old = np.asarray(caches["v"][1, :, P:]).reshape(3, G, -1)
    cos = (v_new * v_old).sum(-1) / (np.linalg.norm(v_new, axis=-1) * np.linalg.norm(v_old, axis=-1))
    expected = np.argsort(cos, axis=-1, kind="stable")[:, :k]
    for b in range(3):
        assert set(np.flatnonzero(changed[0, b])) == set(expected[b])


def _reference_dllm_cache_step(model, tokens, cache, mode, rho, P):
    """One forward of dLLM-Cache as `cache_hook_LLaDA.py` (maomaocun/dLLM-cache) orders it, for
    one unpadded row, written from the hook: the first layer and mode 0 recompute everything;
    a response refresh (mode 1) recomputes the response over the cached prompt K/V; otherwise,
    for 0 < rho <= 1, every response value is replaced and the int(G rho) tokens whose values
    moved most get new keys, and then the prompt (mode 2) and those tokens query the updated
    K/V together. ``cache``: per layer, a dict updated in place."""
    from jaxlm.models.taps import Taps

    no_taps = Taps(frozenset())
    T = tokens.shape[0]
    G = T - P
    x = fw.embed(model, jnp.asarray(tokens[None], jnp.int32))
    pos = jnp.arange(T)[None]

    def project(block, h, p):
        return block.attn.project(block.attn_norm(h), p, no_taps)

    def attend(block, q, k, v):
        n = q.shape[1]
        ctx, _ = block.attn.attend(q, k.astype(q.dtype), v.astype(q.dtype), jnp.ones((1, 1, n, k.shape[2]), bool),
                                   need_probs=False)
        return block.attn.o_proj(ctx.reshape(1, n, -1))

    def mlp(block, h):
        return block.mlp(block.mlp_norm(h), no_taps, {"meta": None})

    for i, block in enumerate(fw.blocks(model)):
        c = cache[i]
        gen, prompt = mode in (0, 1) or i == 0, mode in (0, 2) or i == 0
        if gen and prompt:
            q, k, v = project(block, x, pos)
            a = attend(block, q, k, v)
            m = mlp(block, x + a)
            c.update(kP=k[:, :, :P], vP=v[:, :, :P], kG=k[:, :, P:], vG=v[:, :, P:], aP=a[:, :P], aG=a[:, P:],
                     mP=m[:, :P], mG=m[:, P:])
            x = x + a + m
            continue
        chosen = np.zeros(0, int)
        if not gen and 0 < rho <= 1:
            qg, kg, vg = project(block, x[:, P:], pos[:, P:])
            old = np.asarray(c["vG"]).transpose(0, 2, 1, 3).reshape(G, -1)
            new = np.asarray(vg).transpose(0, 2, 1, 3).reshape(G, -1)
            cos = (old * new).sum(-1) / np.maximum(np.linalg.norm(old, axis=-1) * np.linalg.norm(new, axis=-1), 1e-8)
            chosen = np.argsort(cos, kind="stable")[:int(G * rho)]
            c["kG"], c["vG"] = c["kG"].at[:, :, chosen].set(kg[:, :, chosen]), vg
        if gen:
            qg, kg, vg = project(block, x[:, P:], pos[:, P:])
            c.update(kG=kg, vG=vg, aG=attend(block, qg, jnp.concatenate([c["kP"], kg], 2),
                                             jnp.concatenate([c["vP"], vg], 2)))
        elif prompt:
            qp, kp, vp = project(block, x[:, :P], pos[:, :P])
            c.update(kP=kp, vP=vp)
            k, v = jnp.concatenate([kp, c["kG"]], 2), jnp.concatenate([vp, c["vG"]], 2)
            a = attend(block, jnp.concatenate([qp, qg[:, chosen]], 1) if len(chosen) else qp, k, v)
            c["aP"] = a[:, :P]
            if len(chosen):
                c["aG"] = c["aG"].at[:, chosen].set(a[:, P:])
        elif len(chosen):
            k, v = jnp.concatenate([c["kP"], c["kG"]], 2), jnp.concatenate([c["vP"], c["vG"]], 2)
            c["aG"] = c["aG"].at[:, chosen].set(attend(block, qg[:, chosen], k, v))
        x1 = x + jnp.concatenate([c["aP"], c["aG"]], 1)
        if gen:
            c["mG"] = mlp(block, x1[:, P:])
        if prompt:
            c["mP"] = mlp(block, x1[:, :P])
        if not gen and len(chosen):
            c["mG"] = c["mG"].at[:, chosen].set(mlp(block, x1[:, P:][:, chosen]))
        x = x1 + jnp.concatenate([c["mP"], c["mG"]], 1)
    return np.asarray(model.unembed(model.final_norm(x[:, P:])))[0]


@pytest.mark.parametrize("rho", [0.0, 0.25, 0.5])
def test_dllm_cache_steps_equal_the_reference_hook(rho):
    """Four layers (with two, the last layer's prompt outputs never reach the logits), the
    schedule K_p = 2, K_r = 3 through every mode, one token committed per step."""
    model = build_model(diffusion_config(init_std=0.3, n_layers=4), seed=1)
    P, G = 6, 8
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.integers(3, 200, P), np.full(G, MASK)])
    schedule = DLLMCache(2, 3, rho)
    reference, ours = [{} for _ in range(4)], None
    valid = jnp.ones((1, P + G), bool)
    for step in range(7):
        mode = int(schedule.mode(step))
        want = _reference_dllm_cache_step(model, x, reference, mode, rho, P)
        tokens = jnp.asarray(x[None], jnp.int32)
        if mode == 0:
            got, ours = fw.full_forward(model, tokens, valid, start=P, collect=True)
        else:
            got, ours = fw.dllm_cache_forward(model, tokens, valid, ours, mode, prompt_len=P, transfer_ratio=rho)
        np.testing.assert_allclose(np.asarray(got)[0], want, atol=2e-5, err_msg=f"step {step}, mode {mode}")
        x[P + (step * 5) % G] = rng.integers(3, 200)
    assert {int(schedule.mode(s)) for s in range(7)} == {0, 1, 2, 3}


def test_dllm_cache_flops_follow_the_refresh_schedule(model, baseline):
    schedule = DLLMCache(8, 4, 0.25)
    out = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4, cache=schedule)
    # forwards 0 and 8: both refresh; 4 and 12: response only; the rest: partial update only
    modes = [0 if s % 8 == 0 else 1 if s % 4 == 0 else 3 for s in range(16)]
    assert [int(schedule.mode(s)) for s in range(16)] == modes
    c, B, P, G = model.config, 3, 8, 16
    expected = sum(fw.dllm_cache_flops(c, B, P + G, P, m, 0.25) for m in modes)
    np.testing.assert_allclose(out.flops, expected, rtol=1e-6)
    assert out.flops < baseline.flops and not (out.tokens == MASK).any()
    assert int(DLLMCache(3, 2, 0.25).mode(3)) == 2  # prompt refresh only
    # with guidance a step is one model call over [cond; uncond] rows: the same schedule, twice the rows
    guided = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4, cache=schedule, cfg_scale=1.0)
    expected = sum(fw.dllm_cache_flops(c, 2 * B, P + G, P, m, 0.25) for m in modes)
    np.testing.assert_allclose(guided.flops, expected, rtol=1e-6)
    assert guided.forwards == 32


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fast_dllm_caches(model, cache):
    ref = diffusion_generate(model, PROMPTS, gen_length=16, steps=4, block_length=4)
    # one step per block: every step is a block's first, computed in full: the uncached result
    one = diffusion_generate(model, PROMPTS, gen_length=16, steps=4, block_length=4, cache=cache)
    np.testing.assert_array_equal(one.tokens, ref.tokens)
    many = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4, cache=cache)
    full = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4)
    assert many.flops < full.flops and not (many.tokens == MASK).any()


def test_span_forward_over_fresh_caches_is_the_full_forward(model, cached_state):
    x2, valid, _, P = cached_state
    logits, caches = fw.full_forward(model, x2, valid, start=P, collect=True)
    span = fw.span_forward(model, x2, valid, caches, start=P + 4, size=4)
    np.testing.assert_allclose(span, logits[:, 4:8], rtol=1e-5, atol=1e-5)


def test_guidance_and_slow_fast_run(model, baseline):
    guided = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4, cfg_scale=0.0)
    np.testing.assert_array_equal(guided.tokens, baseline.tokens)
    w = diffusion_generate(model, PROMPTS, gen_length=16, steps=16, block_length=4, cfg_scale=1.5)
    assert w.forwards == 32 and not (w.tokens == MASK).any()
    for fast in ("low", "high"):
        sf = diffusion_generate(model, PROMPTS, gen_length=16, block_length=4,
                                slow_fast=SlowFast(jsd_threshold=0.05, confidence=0.3, fast=fast))
        assert sf.forwards == 2 * sf.steps and 4 <= sf.steps <= 16 and not (sf.tokens == MASK).any()
    slowest = diffusion_generate(model, PROMPTS, gen_length=16, block_length=4,
                                 slow_fast=SlowFast(confidence=1.1))  # nothing is fast: one token per step
    np.testing.assert_array_equal(slowest.tokens, baseline.tokens)


def test_banned_tokens_are_never_proposed(model):
    out = diffusion_generate(model, PROMPTS, gen_length=8, steps=8, banned_tokens=list(range(3, 200)))
    assert ((out.tokens < 3) | (out.tokens >= 200)).all()


@pytest.fixture(scope="module")
def mask_loving_model():
    """A model whose every logit is 0 and whose [MASK] is id 0: the argmax (first of the tie)
    is [MASK] at every position."""
    m = build_model(jaxlm.ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=0), seed=1)
    m.lm_head.kernel[...] = jnp.zeros_like(m.lm_head.kernel[...])
    return m


@pytest.mark.parametrize("rule", [dict(steps=8), dict(threshold=0.9), dict(steps=8, remasking="random"),
                                  dict(slow_fast=SlowFast())])
def test_mask_id_is_never_committed(mask_loving_model, rule):
    """A committed [MASK] would read as still masked: a block decoded until no mask is left
    would never end, and the fixed schedule would return mask ids as text."""
    prompts = [[5, 6, 7], [9, 10]]
    assert (np.asarray(mask_loving_model(jnp.asarray(prompts[:1])).logits).argmax(-1) == 0).all()
    out = diffusion_generate(mask_loving_model, prompts, gen_length=8, block_length=4, **rule)
    assert out.tokens.shape == (2, 8) and (out.tokens != 0).all()
    only = diffusion_generate(mask_loving_model, prompts, gen_length=8, steps=8,
                              banned_tokens=[t for t in range(1, 260) if t not in (5, 258)])
    assert set(only.tokens.ravel().tolist()) <= {5, 258}  # the only ids left besides [MASK]


def test_diffusion_model_attends_bidirectionally(model):
    x = jnp.asarray([[1, 20, 30, 40, 50]])
    y = x.at[0, 4].set(60)
    a, b = model(x).logits, model(y).logits
    assert np.abs(np.asarray(a[0, 0] - b[0, 0])).max() > 1e-4  # the first position sees the last
    causal = build_model(jaxlm.ModelConfig.tiny(vocab_size=260, init_std=0.3), seed=1)
    np.testing.assert_array_equal(causal(x).logits[0, :4], causal(y).logits[0, :4])


def test_next_token_head():
    m = build_model(diffusion_config(next_token_head=True), seed=0)
    out = m(jnp.asarray([[1, 2, 3]]))
    assert out.next_logits.shape == (1, 3, 260) and out.next_logits.dtype == jnp.float32
    assert m.config.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))


def test_flop_counts_hand_case():
    c = jaxlm.ModelConfig.tiny(vocab_size=10, d_model=8, n_heads=2, n_kv_heads=1, ffn_dim=16, n_layers=3)
    # per token and layer: q 8x8, k 8x4, v 8x4, o 8x8, MLP 3 x 8x16 -> 2 * (64+32+32+64+384) = 1152
    # attention of 5 queries over 5 keys: 2 * 25 * 2 heads * (4 + 4) = 800; head: 2 * 8 * 10 per token
    assert fw.full_flops(c, 1, 5, 2) == 3 * (5 * 1152 + 800) + 2 * 160
    assert fw.span_flops(c, 2, 5, 1) == 2 * (3 * (1152 + 2 * 5 * 2 * 8) + 160)


def test_config_errors():
    with pytest.raises(ValueError, match="mask_token_id"):
        jaxlm.ModelConfig.tiny(mode="diffusion")
    with pytest.raises(ValueError, match="mask_token_id"):
        jaxlm.ModelConfig.tiny(mode="diffusion", mask_token_id=259)  # vocab 259: out of range
    with pytest.raises(ValueError, match="mode"):
        jaxlm.ModelConfig.tiny(mode="bidirectional")
    with pytest.raises(ValueError, match="next_token_head"):
        jaxlm.ModelConfig.tiny(next_token_head=True)
    with pytest.raises(ValueError, match="mask_token_id"):
        jaxlm.ModelConfig.tiny(mask_token_id=3)


def test_bad_input_errors(model):
    with pytest.raises(ValueError, match="gen_length=10 is not divisible by block_length=4"):
        diffusion_generate(model, PROMPTS, gen_length=10, steps=10, block_length=4)
    with pytest.raises(ValueError, match="steps=6 is not divisible by the number of blocks"):
        diffusion_generate(model, PROMPTS, gen_length=16, steps=6, block_length=4)
    with pytest.raises(ValueError, match="steps is required"):
        diffusion_generate(model, PROMPTS, gen_length=16)
    with pytest.raises(ValueError, match="at most one step per token"):
        diffusion_generate(model, PROMPTS, gen_length=8, steps=16)
    with pytest.raises(ValueError, match="cache="):
        diffusion_generate(model, PROMPTS, gen_length=8, steps=8, cache="both")
    with pytest.raises(ValueError, match="mask_token_id"):
        diffusion_generate(model, [[1, MASK, 5]], gen_length=8, steps=8)
    with pytest.raises(ValueError, match="threshold"):
        diffusion_generate(model, PROMPTS, gen_length=8, threshold=1.5)
    causal = build_model(jaxlm.ModelConfig.tiny(), seed=0, tokenizer=jaxlm.ByteTokenizer())
    with pytest.raises(ValueError, match="causal checkpoint"):
        diffusion_generate(causal, PROMPTS, gen_length=8, steps=8)
    with pytest.raises(ValueError, match="diffusion_generate"):
        jaxlm.generate(model, PROMPTS, max_new_tokens=4)
    q = build_model(diffusion_config(kv_quant="nvfp4", head_dim=16), seed=0)
    with pytest.raises(ValueError, match="kv_quant='nvfp4' is not supported by the cached diffusion forwards"):
        diffusion_generate(q, [[1, 2]], gen_length=4, steps=4, cache="dual")
    with pytest.raises(ValueError, match=r"stop_tokens \[1000000\] are outside"):
        diffusion_generate(model, PROMPTS, gen_length=8, steps=8, stop_tokens=[10**6])
    with pytest.raises(ValueError, match="bucket=0 is invalid"):
        diffusion_generate(model, PROMPTS, gen_length=8, steps=8, bucket=0)
    with pytest.raises(TypeError, match="token ids must be ints"):
        diffusion_generate(model, [[5.7, 9.2]], gen_length=8, steps=8)
    # settings that were silently ignored or made rows interact
    with pytest.raises(ValueError, match="steps=0 is not used with threshold="):
        diffusion_generate(model, PROMPTS, gen_length=8, steps=0, threshold=0.5)
    for field in ("jsd_threshold", "confidence"):
        with pytest.raises(ValueError, match=f"SlowFast.{field}=nan is invalid"):
            SlowFast(**{field: float("nan")})
    with pytest.raises(ValueError, match="DLLMCache.* with threshold= decodes one prompt per call"):
        diffusion_generate(model, PROMPTS, gen_length=8, threshold=0.3, cache=DLLMCache(3, 2, 0.25))
    diffusion_generate(model, PROMPTS[:1], gen_length=8, threshold=0.3, cache=DLLMCache(3, 2, 0.25))  # one row: fine


def test_bucket_padding_shrinks_to_fit_the_context(model):
    """A prompt that fits without the bucket's padding is decoded (as `generate` does), the
    same as with no bucketing at all."""
    room = model.config.max_seq_len - 8
    prompt = [[1 + i % 200 for i in range(room - 1)]]  # padded to a multiple of 8 it would not fit
    got = diffusion_generate(model, prompt, gen_length=8, steps=8)
    np.testing.assert_array_equal(got.tokens, diffusion_generate(model, prompt, gen_length=8, steps=8, bucket=1).tokens)


def test_logits_eos_inf_bans_eos_and_needs_an_eos_id(model):
    out = diffusion_generate(model, PROMPTS, gen_length=8, steps=8, logits_eos_inf=True)
    assert not (np.asarray(out.tokens) == model.tokenizer.eos_id).any()
    bare = build_model(diffusion_config(init_std=0.3), seed=1)  # no tokenizer: no EOS id is known
    with pytest.raises(ValueError, match="logits_eos_inf=True bans EOS, but no tokenizer with an EOS id"):
        diffusion_generate(bare, [[1, 20, 21]], gen_length=8, steps=8, logits_eos_inf=True)


def test_task_accuracy_passes_the_users_steps_to_the_sampler(model):
    """Only the default ``steps = max_new_tokens`` gives way to ``threshold``: steps a user
    passes with a threshold reach `diffusion_generate` and its error (they were dropped)."""
    from jaxlm.eval.accuracy import task_accuracy

    examples = [{"prompt": p, "completion": "x"} for p in PROMPTS]
    with pytest.raises(ValueError, match="threshold"):
        task_accuracy(model, examples, lambda e, t: 0.0, tokenizer=model.tokenizer, max_new_tokens=8,
                      generate_kwargs={"steps": 4, "threshold": 0.9})
    fast = task_accuracy(model, examples, lambda e, t: 0.0, tokenizer=model.tokenizer, max_new_tokens=8, generate_kwargs={"threshold": 0.9})
    want = diffusion_generate(model, PROMPTS, gen_length=8, threshold=0.9)
    assert [s["completion"] for s in fast.samples] == want.texts
    halved = task_accuracy(model, examples, lambda e, t: 0.0, tokenizer=model.tokenizer, max_new_tokens=8, generate_kwargs={"steps": 4})
    assert [s["completion"] for s in halved.samples] == diffusion_generate(model, PROMPTS, gen_length=8, steps=4).texts


def test_nan_logits_still_commit_a_token_every_step(model):
    """NaN confidences ranked after the unmasked positions: nothing was committed again, the
    fixed schedule returned [MASK] ids and the threshold loop never ended (a diverged model)."""
    from flax import nnx

    broken = nnx.clone(model)
    broken.final_norm.scale[...] = broken.final_norm.scale[...] * jnp.nan
    for kw in (dict(steps=4), dict(threshold=0.9)):
        out = diffusion_generate(broken, ["1+1="], gen_length=4, block_length=4, **kw)
        assert not (np.asarray(out.tokens) == MASK).any(), kw


def test_settings_that_would_do_nothing_are_refused(model):
    with pytest.raises(ValueError, match="cover all 260 ids: no token could be proposed"):
        diffusion_generate(model, ["1+1="], gen_length=4, steps=4, banned_tokens=range(259))
    for kw in (dict(edits_per_round=2), dict(edit_threshold=0.5), dict(edit_max_length=2)):
        with pytest.raises(ValueError, match="set without edit_rounds"):
            diffusion_generate(model, ["1+1="], gen_length=4, steps=4, **kw)

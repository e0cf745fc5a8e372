"""Speculative decoding: greedy output equals plain greedy token for token (several k,
batch sizes, unequal prompts, drafts that are random, always right or always wrong, a
scanned target, stop tokens); sampled output follows the target's exact distribution
(chi-square against the distribution enumerated from full forwards, with temperature and
top-p); the mean tokens per verify round equals (1 - a^(k+1)) / (1 - a) for constant p, q
with known acceptance a; the caches after rollback equal recomputed ones; bad drafts fail
with errors naming the argument."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.inference.cache import KVCache
from jaxlm.inference.speculative import MedusaHeads, medusa_loss, speculative_generate_tokens, train_medusa_heads

V = 24
CFG = jaxlm.ModelConfig.tiny(vocab_size=V, init_std=0.5, max_seq_len=64)
DRAFT_CFG = jaxlm.ModelConfig.tiny(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                   init_std=0.5, max_seq_len=64)
PROMPTS = [[1, 5, 9, 17], [3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 7]]
N = 14


@pytest.fixture(scope="module")
def target():
    return jaxlm.build_model(CFG, seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    random_draft = jaxlm.build_model(DRAFT_CFG, seed=1)
    # the target with its output columns rolled by one: its argmax is always the target's + 1
    wrong = jaxlm.build_model(CFG, seed=0)
    wrong.lm_head.kernel.set_value(jnp.roll(wrong.lm_head.kernel[...], 1, axis=1))
    heads = MedusaHeads(CFG.d_model, 5)
    heads.w.set_value(0.3 * jax.random.normal(jax.random.key(3), heads.w.shape))
    return {"random": random_draft, "always_right": target, "always_wrong": wrong, "medusa": heads}


@pytest.fixture(scope="module")
def plain(target):
    return {b: jaxlm.generate(target, PROMPTS[:b], max_new_tokens=N, temperature=0, stop_tokens=())
            for b in (1, 4)}


@pytest.mark.parametrize("kind,k", [("random", 1), ("random", 3), ("random", 5), ("always_right", 1),
                                    ("always_right", 4), ("always_wrong", 2), ("medusa", 3), ("medusa", 5)])
def test_greedy_speculative_equals_plain_greedy(target, drafts, plain, kind, k):
    ref = plain[4]
    out = jaxlm.generate(target, PROMPTS, max_new_tokens=N, temperature=0, stop_tokens=(), draft=drafts[kind],
                         num_draft_tokens=k)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
    acc, rounds = np.asarray(out.accepted_lengths), np.asarray(out.verify_rounds)
    for b in range(len(PROMPTS)):
        used = acc[b, : rounds[b]]
        assert (used >= 0).all() and (acc[b, rounds[b]:] == -1).all()
        # bookkeeping check, not the behaviour under test (tokens are compared above): the
        # prefill token plus each round's accepted drafts + 1 add up to every generated token
        assert 1 + np.sum(used + 1) == N
        if kind == "always_wrong":
            assert (used == 0).all() and rounds[b] == N - 1
        if kind == "always_right":
            assert rounds[b] == -(-(N - 1) // (k + 1)) and (used[:-1] == k).all()


def test_greedy_batch_one_and_stop_tokens(target, drafts, plain):
    out = jaxlm.generate(target, PROMPTS[:1], max_new_tokens=N, temperature=0, stop_tokens=(), draft=drafts["random"],
                         num_draft_tokens=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain[1].tokens))
    # a stop token that the rows reach at different steps ends each row there, drafts or not
    toks = np.asarray(plain[4].tokens)
    stop = int(toks[0, 5])
    ref = jaxlm.generate(target, PROMPTS, max_new_tokens=N, temperature=0, stop_tokens=(stop,))
    for kind in ("random", "always_right"):
        out = jaxlm.generate(target, PROMPTS, max_new_tokens=N, temperature=0, stop_tokens=(stop,),
                             draft=drafts[kind], num_draft_tokens=4)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    assert np.asarray(ref.lengths).min() < N  # the stop token did end a row early


def test_greedy_scanned_target_and_draft():
    target = jaxlm.build_model(dataclasses.replace(CFG, scan_layers=True), seed=0)
    draft = jaxlm.build_model(dataclasses.replace(DRAFT_CFG, scan_layers=True), seed=1)
    ref = jaxlm.generate(target, PROMPTS, max_new_tokens=N, temperature=0, stop_tokens=())
    out = jaxlm.generate(target, PROMPTS, max_new_tokens=N, temperature=0, stop_tokens=(), draft=draft,
                         num_draft_tokens=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def _left_pad(seqs, width=None):
    T = width or max(map(len, seqs))
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros((len(seqs), T), bool)
    for b, s in enumerate(seqs):
        tokens[b, T - len(s):] = s
        mask[b, T - len(s):] = True
    return jnp.asarray(tokens), jnp.asarray(mask)


def test_caches_after_rollback_equal_recomputation(target, drafts):
    """After the loop each row's cache holds its prompt and its committed tokens (all but
    the last generated one) at consecutive slots; a fresh prefill of the same row gives the
    same keys/values there, the same validity and the same next write slot / position."""
    tokens, mask = _left_pad(PROMPTS, width=12)
    draft = drafts["random"]
    k = 3
    final = speculative_generate_tokens(
        nnx.graphdef(target), nnx.state(target), nnx.graphdef(draft), nnx.state(draft), tokens, mask,
        jax.random.key(0), max_new_tokens=N, num_draft_tokens=k, greedy=False)
    gen, lengths = np.asarray(final.tokens), np.asarray(final.lengths)
    rounds = np.asarray(final.rounds)
    assert rounds.min() < N - 1 and len(set(rounds)) > 1  # drafts accepted, rows rolled back by different amounts
    for model, cache, lag in ((target, final.cache, 1), (draft, final.draft_cache, 2)):
        # the target holds every committed token but the last; the draft all but the last two
        # (its next round rewrites the second-to-last in place)
        for b, p in enumerate(PROMPTS):
            seq = list(p) + gen[b, : lengths[b]].tolist()
            kept = seq[: len(seq) - lag]
            pad = 12 - len(p)
            row_tokens = jnp.asarray([[0] * pad + kept])
            row_mask = jnp.asarray([[False] * pad + [True] * len(kept)])
            empty = KVCache.init(model.config, 1, cache.max_len, per_layer=cache.is_per_layer)
            ref = model.backbone(row_tokens, cache=empty, mask=row_mask).cache
            end = int(np.asarray(cache.end_index)[b])
            assert end == 12 + len(kept) - len(p) == int(np.asarray(ref.end_index))
            assert int(np.asarray(cache.lengths)[b]) == len(kept)
            np.testing.assert_array_equal(np.asarray(cache.valid[b]), np.asarray(ref.valid[0]))
            for got, want in zip(jax.tree.leaves((cache.k, cache.v)), jax.tree.leaves((ref.k, ref.v))):
                ax = got.ndim - 4
                g = np.take(np.asarray(got), b, axis=ax)[..., :end, :]
                w = np.take(np.asarray(want), 0, axis=ax)[..., :end, :]
                valid = np.asarray(ref.valid[0, :end])
                # float32 sums in another order (verify chunks vs one prefill): relative to the scale
                np.testing.assert_allclose(g[..., valid, :], w[..., valid, :], atol=1e-5 * np.abs(w).max())


# --- sampled output follows the target's distribution ------------------------------------


SMALL_V = 6


@pytest.fixture(scope="module")
def small_vocab():
    """A target and a draft over 6 tokens: every 3-token continuation is a chi-square cell."""
    target = jaxlm.build_model(dataclasses.replace(CFG, vocab_size=SMALL_V, init_std=0.1), seed=4)
    draft = jaxlm.build_model(dataclasses.replace(DRAFT_CFG, vocab_size=SMALL_V, init_std=0.3), seed=5)
    heads = MedusaHeads(CFG.d_model, 3)
    heads.w.set_value(0.3 * jax.random.normal(jax.random.key(6), heads.w.shape))
    return target, {"random": draft, "medusa": heads}


def _target_sequence_probs(model, prompt, n, temperature=1.0, top_p=None):
    """P(x_1..x_n | prompt) for every sequence, from full forwards (numpy nucleus)."""
    V = model.config.vocab_size
    seqs = np.asarray(list(itertools.product(range(V), repeat=n)), np.int32)
    rows = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    logits = np.asarray(model(jnp.asarray(rows)).logits, np.float64)[:, len(prompt) - 1: -1]  # [S, n, V]
    z = logits / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p is not None:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, -1)
        before = np.cumsum(sp, -1) - sp  # mass strictly before each token in the order
        keep_sorted = before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    step = np.take_along_axis(p, seqs[..., None], -1)[..., 0]
    return seqs, step.prod(-1)


@pytest.mark.parametrize("kind,k,temperature,top_p", [("random", 3, 1.0, None), ("medusa", 2, 1.5, 0.8)])
def test_sampled_output_distribution_is_the_targets(small_vocab, kind, k, temperature, top_p):
    target, drafts = small_vocab
    prompt = [1, 5, 2]
    n = 3
    seqs, probs = _target_sequence_probs(target, prompt, n, temperature, top_p)
    draws = 8000
    out = jaxlm.generate(target, [prompt] * draws, max_new_tokens=n, temperature=temperature, top_p=top_p,
                         stop_tokens=(), draft=drafts[kind], num_draft_tokens=k, rng=7)
    got = np.asarray(out.tokens)
    index = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    counts = np.bincount([index[tuple(r)] for r in got.tolist()], minlength=len(seqs))
    assert counts[probs == 0].sum() == 0  # nothing outside the nucleus
    # pool rare outcomes so every chi-square cell expects >= 5
    expected = probs * draws
    order = np.argsort(expected)
    order = order[expected[order] > 0]  # cells outside the nucleus were checked above
    small = order[np.cumsum(expected[order]) < 20]
    big = np.setdiff1d(order, small)
    f_obs, f_exp = counts[big], expected[big]
    if len(small):
        f_obs, f_exp = np.append(f_obs, counts[small].sum()), np.append(f_exp, expected[small].sum())
    assert len(f_obs) >= 20  # enough cells for the test to say something
    f_exp *= f_obs.sum() / f_exp.sum()
    assert stats.chisquare(f_obs, f_exp).pvalue > 1e-3
    # and the drafts were used (the test would pass vacuously if every draft were rejected)
    acc = np.asarray(out.accepted_lengths)
    assert (acc > 0).mean() > 0.05


def _constant_model(cfg, seed, probs):
    """A model whose next-token distribution is ``probs`` at every position: layers output
    zero (o_proj, down_proj = 0), every token embeds to one vector ``e``, and the LM head
    maps ``h = final_norm(e)`` to ``log(probs)``."""
    m = jaxlm.build_model(cfg, seed=seed)
    emb = m.embed[...]
    m.embed.set_value(jnp.broadcast_to(emb[:1], emb.shape))
    for layer in m.layers:
        layer.attn.o_proj.kernel.set_value(jnp.zeros_like(layer.attn.o_proj.kernel[...]))
        layer.mlp.down_proj.kernel.set_value(jnp.zeros_like(layer.mlp.down_proj.kernel[...]))
    h = np.asarray(m.backbone(jnp.asarray([[1]])).hidden[0, 0], np.float64)
    m.lm_head.kernel.set_value(jnp.asarray(np.outer(h / (h @ h), np.log(probs)), jnp.float32))
    return m


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])  # k = 4: the same check, slower
def test_mean_tokens_per_round_matches_the_formula(k):
    rng = np.random.default_rng(0)
    p_set = rng.dirichlet(np.ones(V))
    q_set = 0.5 * p_set + 0.5 * rng.dirichlet(np.ones(V))
    target, draft = _constant_model(CFG, 10, p_set), _constant_model(DRAFT_CFG, 11, q_set)
    p = np.asarray(jax.nn.softmax(target(jnp.asarray([[1, 2, 3]])).logits[0]), np.float64)
    q = np.asarray(jax.nn.softmax(draft(jnp.asarray([[1, 2, 3]])).logits[0]), np.float64)
    np.testing.assert_allclose(p, np.broadcast_to(p_set, p.shape), atol=1e-5)  # the same at every position
    np.testing.assert_allclose(q, np.broadcast_to(q_set, q.shape), atol=1e-5)
    alpha = np.minimum(p[0], q[0]).sum()
    assert 0.5 < alpha < 0.95
    n_tokens = 40
    out = jaxlm.generate(target, [[1]] * 512, max_new_tokens=n_tokens, stop_tokens=(), draft=draft,
                         num_draft_tokens=k, rng=3)
    # the first R rounds can never reach max_new_tokens, so none of them is truncated
    R = (n_tokens - 2) // (k + 1)
    per_round = np.asarray(out.accepted_lengths)[:, :R].ravel() + 1
    want = (1 - alpha ** (k + 1)) / (1 - alpha)
    se = per_round.std() / np.sqrt(per_round.size)
    print(f"k={k} alpha={alpha:.3f}: {per_round.mean():.4f} tokens per round, formula {want:.4f} (se {se:.4f})")
    assert abs(per_round.mean() - want) < 4 * se, (per_round.mean(), want, se)


# --- Medusa heads --------------------------------------------------------------------------


def test_medusa_loss_against_a_direct_computation(target):
    heads = MedusaHeads(CFG.d_model, 3)
    heads.w.set_value(0.2 * jax.random.normal(jax.random.key(0), heads.w.shape))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, V)
    mask = jnp.ones((2, 9), bool).at[1, :2].set(False)
    got = float(nnx.jit(medusa_loss)(heads, target, tokens, mask))
    hidden = np.asarray(nnx.jit(lambda m, t, k: m.backbone(t, mask=k).hidden)(target, tokens, mask), np.float64)
    w, b = np.asarray(heads.w[...], np.float64), np.asarray(heads.b[...], np.float64)
    lm_head = np.asarray(target.lm_head.kernel[...], np.float64)
    tokens = np.asarray(tokens)
    total, count = 0.0, 0
    for j in range(3):
        for bi in range(2):
            for t in range(9 - j - 2):
                if not (mask[bi, t] and mask[bi, t + j + 2]):
                    continue
                z = hidden[bi, t] @ w[j] + b[j]
                h = hidden[bi, t] + z / (1 + np.exp(-z))
                logits = h @ lm_head
                total += np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[tokens[bi, t + j + 2]]
                count += 1
    assert got == pytest.approx(total / count, rel=1e-4)


def test_trained_medusa_heads_accept_more_on_a_periodic_sequence(target):
    """On a sequence the target continues periodically, trained heads propose its
    continuation: more drafts accepted than the untrained heads, output unchanged."""
    prompt = [1, 2, 3, 4, 5, 6]
    ref = jaxlm.generate(target, [prompt], max_new_tokens=40, temperature=0, stop_tokens=())
    seq = np.asarray(ref.sequences()[0], np.int32)
    batches = [(seq[None], np.ones((1, len(seq)), bool))] * 150
    heads0 = MedusaHeads(CFG.d_model, 3)
    heads, losses = train_medusa_heads(heads0, target, batches, learning_rate=3e-2)
    assert losses[-1] < 0.5 * losses[0]
    runs = [jaxlm.generate(target, [prompt], max_new_tokens=40, temperature=0, stop_tokens=(), draft=h,
                           num_draft_tokens=3) for h in (heads0, heads)]
    for r in runs:
        np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(ref.tokens))
    assert int(runs[1].verify_rounds[0]) < int(runs[0].verify_rounds[0])


# --- bad input -----------------------------------------------------------------------------


class _OtherTokenizer(ByteTokenizer):
    eos_id = 5


def test_bad_drafts_fail_with_errors_naming_the_argument(target, drafts):
    other_vocab = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=V + 1, max_seq_len=64), seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=other_vocab)
    other_tok = jaxlm.build_model(DRAFT_CFG, seed=1, tokenizer=_OtherTokenizer())
    with pytest.raises(ValueError, match="tokenizer"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=other_tok, tokenizer=ByteTokenizer())
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=drafts["random"], num_draft_tokens=k)
    with pytest.raises(ValueError, match="num_draft_tokens=6 exceeds the draft's num_heads=5"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=drafts["medusa"], num_draft_tokens=6)
    with pytest.raises(ValueError, match="d_model"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=MedusaHeads(16, 2))
    # 10 prompt tokens + 50 new fit the target's 64 slots, but not with 5 drafted slots past them
    with pytest.raises(ValueError, match="num_draft_tokens 5 = 65 exceeds the target's ModelConfig.max_seq_len=64"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=50, draft=drafts["random"], num_draft_tokens=5)
    short = jaxlm.build_model(dataclasses.replace(DRAFT_CFG, max_seq_len=32), seed=1)
    with pytest.raises(ValueError, match="draft's ModelConfig.max_seq_len=32"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=20, draft=short, num_draft_tokens=3)
    with pytest.raises(TypeError, match="draft must be"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft="small-model")
    # a numpy integer is a count, as max_new_tokens may be one
    np.testing.assert_array_equal(
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=drafts["random"], num_draft_tokens=np.int64(2)).tokens,
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=drafts["random"], num_draft_tokens=2).tokens)
    with pytest.raises(ValueError, match="condition"):
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=drafts["random"], condition=jnp.ones((4, 2), int))
    # a processor may read the state (tokens so far), which a round does not advance per drafted token
    with pytest.raises(ValueError, match="logits_processors= do not combine with draft="):
        jaxlm.generate(target, PROMPTS, max_new_tokens=4, draft=drafts["random"],
                       logits_processors=[lambda logits, state: logits])


# --- a trained target and draft ---------------------------------------------------------------


@pytest.mark.slow  # trains two models (~1 min on 2 cores); the exactness tests above run by default
def test_trained_draft_gives_the_same_greedy_answers_with_fewer_target_forwards(tmp_path):
    """A target and a smaller draft trained on the same Markov-chain text: speculative greedy
    decoding writes the target's greedy continuations with far fewer target forwards."""
    from jaxlm.data.tasks import MarkovText
    from tiny_training import train_tiny

    task = MarkovText()
    target = jaxlm.load_checkpoint(train_tiny(tmp_path / "t", task, jaxlm.ModelConfig.tiny(max_seq_len=128),
                                              steps=300, seq_len=96))
    draft = jaxlm.load_checkpoint(train_tiny(
        tmp_path / "d", task, jaxlm.ModelConfig.tiny(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                                     max_seq_len=128), steps=300, seq_len=96))
    prompts = [" ".join(task.example(i, "eval")["completion"].split()[:2]) + " " for i in range(6)]
    n = 48
    plain = jaxlm.generate(target, prompts, max_new_tokens=n, temperature=0, stop_tokens=())
    spec = jaxlm.generate(target, prompts, max_new_tokens=n, temperature=0, stop_tokens=(), draft=draft,
                          num_draft_tokens=4)
    assert spec.texts == plain.texts
    forwards = 1 + np.asarray(spec.verify_rounds)  # prefill + one verify per round, against n for plain
    print("target forwards per row:", forwards.tolist(), "of", n)
    assert forwards.mean() < 0.5 * n

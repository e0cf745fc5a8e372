"""ME-DLM's edit rounds on device (`jaxlm.inference.diffusion.edit`), checked row by row against
the list-based `jaxlm.data.edit_labels.apply_edits` and, with oracle predictions from the
canonical alignment, by reaching the clean response."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.data.edit_labels import apply_edits, edit_labels, levenshtein_alignment
from jaxlm.inference.diffusion.edit import apply_predictions, close_response

DEL, EOS = 9, 8  # tokens 0..7 are content


def _apply_reference(response, length, cur, nxt, max_len):
    n = length - 1
    return apply_edits(response[:n], cur[:n], nxt[:n + 1], del_id=DEL, eos_id=EOS, max_len=max_len)


def _random_rows(rng, B, W):
    """``(lengths, response, cur)``: random responses closed by EOS and current-token predictions
    that mostly keep the token, else replace or delete it."""
    lengths = rng.integers(1, 8, B)
    response = np.full((B, W), EOS, np.int32)
    for b in range(B):
        response[b, :lengths[b] - 1] = rng.integers(0, 8, lengths[b] - 1)
    cur = np.where(rng.random((B, W)) < 0.6, response, rng.choice([0, 1, 2, 3, 4, 5, 6, 7, DEL], (B, W)))
    return lengths, response, cur


def test_apply_predictions_matches_apply_edits_row_by_row():
    rng = np.random.default_rng(0)
    B, W = 256, 12
    # predictions mostly "keep / insert nothing", some replaces, deletes and insertions
    lengths, response, cur = _random_rows(rng, B, W)
    following = np.concatenate([response[:, :], np.full((B, 1), EOS)], 1)[:, :W]  # gap i: token i
    nxt = np.where(rng.random((B, W)) < 0.6, following, rng.choice([0, 1, 2, 3, 4, 5, 6, 7, EOS, DEL], (B, W)))
    for max_len in (4, 7, W - 1):
        out, new_len, changed = jax.jit(apply_predictions, static_argnames=("del_id", "eos_id", "max_len"))(
            jnp.asarray(response), jnp.asarray(lengths, jnp.int32), jnp.asarray(cur, jnp.int32),
            jnp.asarray(nxt, jnp.int32), del_id=DEL, eos_id=EOS, max_len=max_len)
        out, new_len, changed = np.asarray(out), np.asarray(new_len), np.asarray(changed)
        for b in range(B):
            ref = _apply_reference(response[b], lengths[b], cur[b], nxt[b], max_len)
            got = out[b, :new_len[b]].tolist()
            assert got == ref + [EOS], (b, max_len)
            assert (out[b, new_len[b]:] == EOS).all()
            n = lengths[b] - 1
            if ref != response[b, :n].tolist():
                assert changed[b], b
            wanted = [nxt[b, i] != (cur[b, i] if i < n else EOS) for i in range(n + 1) if i == n or cur[b, i] != DEL]
            if (cur[b, :n] == response[b, :n]).all() and not any(wanted):
                assert not changed[b], b


def test_changed_flag_is_exact_on_hand_cases():
    resp = jnp.asarray([[1, 2, EOS, EOS]] * 4, jnp.int32)
    lens = jnp.asarray([3, 3, 3, 3], jnp.int32)
    keep_cur = jnp.asarray([[1, 2, 0, 0]] * 4, jnp.int32)
    nothing = jnp.asarray([[1, 2, EOS, 0]] * 4, jnp.int32)
    cur = keep_cur.at[1, 0].set(3).at[2, 1].set(DEL)  # row 1 replaces, row 2 deletes
    nxt = nothing.at[1, 0].set(3).at[3, 2].set(5)  # row 1: "insert nothing" before the new 3; row 3 appends 5
    out, new_len, changed = apply_predictions(resp, lens, cur, nxt, del_id=DEL, eos_id=EOS, max_len=3)
    assert np.asarray(changed).tolist() == [False, True, True, True]
    assert [np.asarray(out)[b, :int(new_len[b])].tolist() for b in range(4)] == [
        [1, 2, EOS], [3, 2, EOS], [1, EOS], [1, 2, 5, EOS]]


def test_close_response_drops_stop_tokens_and_appends_one_eos():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 9, (64, 10)).astype(np.int32)  # EOS = 8 appears anywhere
    for width in (4, 11, 14):
        out, lens = close_response(jnp.asarray(tokens), jnp.asarray(tokens == EOS), eos_id=EOS, width=width)
        for b in range(64):
            kept = [t for t in tokens[b].tolist() if t != EOS][:width - 1]
            assert np.asarray(out)[b].tolist() == kept + [EOS] * (width - len(kept))
            assert int(lens[b]) == len(kept) + 1


@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_predictions_reach_the_clean_response(seed):
    """Current/next predictions equal to the canonical labels (``swap_rule="safe"``): repeated
    rounds on device reach the clean response within the edit distance."""
    rng = np.random.default_rng(seed)
    W = 16
    apply = jax.jit(apply_predictions, static_argnames=("del_id", "eos_id", "max_len"))
    for _ in range(60):
        clean = rng.integers(0, 4, rng.integers(0, 8)).tolist()
        noisy = rng.integers(0, 4, rng.integers(0, 8)).tolist()
        distance = sum(op.kind != "keep" for op in levenshtein_alignment(noisy, clean))
        resp = np.full((1, W), EOS, np.int32)
        resp[0, :len(noisy)] = noisy
        lens = np.asarray([len(noisy) + 1], np.int32)
        for _ in range(distance + 1):
            n = int(lens[0]) - 1
            tokens, nexts = edit_labels(resp[0, :n], clean, del_id=DEL, eos_id=EOS, swap_rule="safe")
            cur = np.full((1, W), EOS, np.int32)
            nxt = np.full((1, W), EOS, np.int32)
            # a gap the labels leave free (after a deleted token) gets "insert nothing"
            nexts = np.where(nexts == -100, np.append(tokens, EOS), nexts)
            cur[0, :n], nxt[0, :n + 1] = tokens, nexts
            resp, lens, _ = apply(jnp.asarray(resp), jnp.asarray(lens), jnp.asarray(cur), jnp.asarray(nxt),
                                  del_id=DEL, eos_id=EOS, max_len=W - 1)
            resp, lens = np.asarray(resp), np.asarray(lens)
        assert resp[0, :int(lens[0])].tolist() == clean + [EOS], (noisy, clean)


def test_max_len_must_leave_room_for_eos():
    with pytest.raises(ValueError, match="max_len=4"):
        apply_predictions(jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1, 4), jnp.int32),
                          jnp.zeros((1, 4), jnp.int32), del_id=DEL, eos_id=EOS, max_len=4)


# ------------------------------------------------------------------ edit rounds in the sampler
MASK, DELETE = 259, 260
PROMPTS = ["12+34=", "7+8=", "99+1=", "5="]


@pytest.fixture(scope="module")
def edit_model():
    import jaxlm
    from jaxlm.models.transformer import build_model
    config = jaxlm.ModelConfig.tiny(vocab_size=261, mode="diffusion", mask_token_id=MASK, next_token_head=True,
                                    delete_token_id=DELETE, init_std=0.3)
    return build_model(config, seed=3, tokenizer=jaxlm.ByteTokenizer())


def _host_edit_rounds(model, prompt_row, prompt_valid, response, rounds, max_len, k=None, threshold=None):
    """The edit loop on the host: one eager forward over the unpadded sequence per round,
    greedy heads (mask id excluded) and the list-based `apply_edits`; with ``k``, only the
    ``k`` most confident edits (`_top_k_reference`, scores the softmax probabilities)."""
    eos = model.tokenizer.eos_id
    prompt = [int(t) for t, v in zip(prompt_row, prompt_valid) if v]
    changed_rounds = 0
    for _ in range(rounds):
        x = jnp.asarray([prompt + response + [eos]], jnp.int32)
        hidden = model.backbone(x).hidden
        P = len(prompt)
        cur = np.array(model.unembed(hidden[:, P:P + len(response)]))[0]
        nxt = np.array(model.unembed_next(hidden[:, P - 1:P + len(response)]))[0]
        cur[:, MASK] = nxt[:, MASK] = -np.inf
        c, x = cur.argmax(-1), nxt.argmax(-1)
        if k is not None or threshold is not None:
            def prob(z):  # the argmax's softmax probability
                return 1.0 / np.exp(z - z.max(-1, keepdims=True)).sum(-1)
            n = len(response)
            after = [c[g] if g < n else eos for g in range(n + 1)]
            cands = [(-prob(cur)[i], 0, i) for i in range(n) if c[i] != response[i]]
            cands += [(-prob(nxt)[g], 1, g) for g in range(n + 1) if x[g] != after[g]]
            chosen = sorted(c for c in cands if threshold is None or -c[0] >= threshold)[:k]
            c = [c[i] if (0, i) in {(kd, j) for _, kd, j in chosen} else response[i] for i in range(n)]
            x = [x[g] if (1, g) in {(kd, j) for _, kd, j in chosen} else (c[g] if g < n else eos) for g in range(n + 1)]
        new = apply_edits(response, c, x, del_id=DELETE, eos_id=eos, max_len=max_len)
        changed = new != response or any(t == DELETE for t in c)
        response = new
        changed_rounds += bool(changed)
        if not changed:
            break
    return response, changed_rounds


def test_sampler_edit_rounds_match_a_host_loop(edit_model):
    from jaxlm.inference.diffusion import diffusion_generate
    eos = edit_model.tokenizer.eos_id
    plain = diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=4, banned_tokens=(DELETE,))
    edited = diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=4, banned_tokens=(DELETE,), edit_rounds=3,
                                edit_max_length=12)
    assert edited.mask_completions == plain.completions
    assert edited.tokens.shape == (len(PROMPTS), 13)
    for b in range(len(PROMPTS)):
        start = [t for t in plain.tokens[b].tolist() if t != eos]
        valid = plain.prompt_tokens[b] != 0  # left padding is id 0, which no prompt holds
        ref, n_changed = _host_edit_rounds(edit_model, plain.prompt_tokens[b], valid, start, 3, 12)
        assert edited.completions[b] == ref, b
        assert int(edited.edits[b]) == n_changed
    assert edited.forwards == plain.forwards + edited.edit_rounds
    # changes stop at a fixed point, so the loop runs one round past the longest-changing row, at most 3
    assert edited.edit_rounds == min(3, int(edited.edits.max()) + 1) and edited.flops > plain.flops
    assert edited.edits.sum() > 0  # the random model does edit


def test_the_delete_token_is_never_a_mask_diffusion_token(edit_model):
    """<|del|> is an edit (ME-DLM bans it while unmasking): banned without banned_tokens=,
    here with its logit pushed above every other so that it would win everywhere."""
    from flax import nnx

    from jaxlm.inference.diffusion import diffusion_generate

    pushed = nnx.clone(edit_model)
    kernel = pushed.lm_head.kernel.get_value()
    pushed.lm_head.kernel.set_value(kernel.at[:, DELETE].set(kernel[:, DELETE] + 50.0 * jnp.sign(kernel[:, 0])))
    free = diffusion_generate(pushed, PROMPTS, gen_length=8, steps=4)
    want = diffusion_generate(pushed, PROMPTS, gen_length=8, steps=4, banned_tokens=(DELETE,))
    assert DELETE not in np.asarray(free.tokens) and free.completions == want.completions


@pytest.mark.parametrize(("k", "threshold"), [(1, None), (3, None), (None, 0.3)])
def test_sampler_edits_per_round_match_a_host_loop(edit_model, k, threshold):
    from jaxlm.inference.diffusion import diffusion_generate
    eos = edit_model.tokenizer.eos_id
    plain = diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=4, banned_tokens=(DELETE,))
    edited = diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=4, banned_tokens=(DELETE,), edit_rounds=3,
                                edit_max_length=12, edits_per_round=k, edit_threshold=threshold)
    for b in range(len(PROMPTS)):
        start = [t for t in plain.tokens[b].tolist() if t != eos]
        valid = plain.prompt_tokens[b] != 0
        ref, n_changed = _host_edit_rounds(edit_model, plain.prompt_tokens[b], valid, start, 3, 12, k=k,
                                           threshold=threshold)
        assert edited.completions[b] == ref, b
        assert int(edited.edits[b]) == n_changed
        if k is not None:  # each round makes at most k edits, so 3 rounds move the response at most 3k edits away
            assert abs(len(ref) - len(start)) <= 3 * k
    assert edited.edits.sum() > 0
    unrestricted = diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=4, banned_tokens=(DELETE,),
                                      edit_rounds=3, edit_max_length=12)
    assert edited.completions != unrestricted.completions  # the random model predicts edits left out here


def test_sampler_edit_errors(edit_model):
    import jaxlm
    from jaxlm.inference.diffusion import diffusion_generate
    from jaxlm.models.transformer import build_model
    with pytest.raises(ValueError, match="edit_max_length=4 is shorter than gen_length=8"):
        diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=8, edit_rounds=2, edit_max_length=4)
    with pytest.raises(ValueError, match="edits_per_round=0 is invalid"):
        diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=8, edit_rounds=2, edits_per_round=0)
    with pytest.raises(ValueError, match="edit_threshold=1.5 is invalid"):
        diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=8, edit_rounds=2, edit_threshold=1.5)
    with pytest.raises(ValueError, match="edit_rounds=-1"):
        diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=8, edit_rounds=-1)
    with pytest.raises(ValueError, match="max_seq_len"):
        diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=8, edit_rounds=2, edit_max_length=500)
    plain = build_model(jaxlm.ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=MASK), seed=0,
                        tokenizer=jaxlm.ByteTokenizer())
    with pytest.raises(ValueError, match="needs an edit model"):
        diffusion_generate(plain, PROMPTS, gen_length=8, steps=8, edit_rounds=2)
    with pytest.raises(ValueError, match="delete_token_id"):
        jaxlm.ModelConfig.tiny(vocab_size=261, mode="diffusion", mask_token_id=MASK, delete_token_id=DELETE)
    with pytest.raises(ValueError, match="delete_token_id"):
        jaxlm.ModelConfig.tiny(vocab_size=261, mode="diffusion", mask_token_id=MASK, next_token_head=True,
                               delete_token_id=MASK)


# ------------------------------------------------------------------ the most confident edits only
def _top_k_reference(response, cur, nxt, cur_score, nxt_score, k, max_len, threshold=None):
    """ME-DLM's ``pred_per_step`` on one row, from the reference loop's definition: the
    substitutions (``cur[i] != response[i]``) and insertions (``nxt[g]`` differing from the
    predicted token after gap ``g``, EOS after the last) ranked together by their scores
    (ties: substitutions first, then leftmost); the others are undone before `apply_edits`.
    ``threshold`` first drops the candidates scored below it; ``k=None`` keeps all."""
    n = len(response)
    after = [cur[g] if g < n else EOS for g in range(n + 1)]
    candidates = [(-cur_score[i], 0, i) for i in range(n) if cur[i] != response[i]]
    candidates += [(-nxt_score[g], 1, g) for g in range(n + 1) if nxt[g] != after[g]]
    if threshold is not None:
        candidates = [c for c in candidates if -c[0] >= threshold]
    chosen = sorted(candidates)[:k]
    subs = {i for _, kind, i in chosen if kind == 0}
    inserts = {g for _, kind, g in chosen if kind == 1}
    new_cur = [cur[i] if i in subs else response[i] for i in range(n)]
    new_nxt = [nxt[g] if g in inserts else (new_cur[g] if g < n else EOS) for g in range(n + 1)]
    return apply_edits(response, new_cur, new_nxt, del_id=DEL, eos_id=EOS, max_len=max_len)


def test_select_edits_keeps_the_k_most_confident_edits():
    from jaxlm.inference.diffusion.edit import select_edits
    rng = np.random.default_rng(2)
    B, W = 200, 12
    lengths, response, cur = _random_rows(rng, B, W)
    nxt = np.where(rng.random((B, W)) < 0.6, cur, rng.choice([0, 1, 2, 3, 4, 5, 6, 7, EOS, DEL], (B, W)))
    # scores on a coarse grid, so that ties between substitutions and insertions occur
    cur_score = rng.integers(1, 6, (B, W)) / 7.0
    nxt_score = rng.integers(1, 6, (B, W)) / 7.0

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def run(k, threshold):
        c, x = select_edits(jnp.asarray(response), jnp.asarray(lengths, jnp.int32), jnp.asarray(cur, jnp.int32),
                            jnp.asarray(nxt, jnp.int32), jnp.asarray(cur_score, jnp.float32),
                            jnp.asarray(nxt_score, jnp.float32), eos_id=EOS, k=k, threshold=threshold)
        return apply_predictions(jnp.asarray(response), jnp.asarray(lengths, jnp.int32), c, x, del_id=DEL,
                                 eos_id=EOS, max_len=W - 1)

    # thresholds on the grid (ties with the scores) and between it
    for k, threshold in [(1, None), (2, None), (3, None), (2 * W, None), (None, 3 / 7), (None, 0.5), (2, 4 / 7)]:
        out, new_len, _ = (np.asarray(a) for a in run(k, threshold))
        for b in range(B):
            n = lengths[b] - 1
            ref = _top_k_reference(response[b, :n].tolist(), cur[b, :n].tolist(), nxt[b, :n + 1].tolist(),
                                   cur_score[b].astype(np.float32).tolist(), nxt_score[b].astype(np.float32).tolist(),
                                   k, W - 1, None if threshold is None else float(np.float32(threshold)))
            assert out[b, :new_len[b]].tolist() == ref + [EOS], (b, k, threshold)
    # k at least the number of candidates, or threshold 0: every predicted edit, as without selection
    everything = apply_predictions(jnp.asarray(response), jnp.asarray(lengths, jnp.int32), jnp.asarray(cur),
                                   jnp.asarray(nxt), del_id=DEL, eos_id=EOS, max_len=W - 1)
    np.testing.assert_array_equal(np.asarray(run(2 * W, None)[0]), np.asarray(everything[0]))
    np.testing.assert_array_equal(np.asarray(run(None, 0.0)[0]), np.asarray(everything[0]))


def test_select_edits_hand_case():
    """Response ``1 2 3``: replace 1 -> 4 (0.9), delete 2 (0.5), insert 6 before 3 (0.7),
    append 7 (0.95)."""
    from jaxlm.inference.diffusion.edit import select_edits
    resp = jnp.asarray([[1, 2, 3, EOS, EOS, EOS]], jnp.int32)
    lens = jnp.asarray([4], jnp.int32)
    cur = jnp.asarray([[4, DEL, 3, 0, 0, 0]], jnp.int32)
    nxt = jnp.asarray([[4, DEL, 6, 7, 0, 0]], jnp.int32)
    cur_score = jnp.asarray([[0.9, 0.5, 0.8, 0.0, 0.0, 0.0]])
    nxt_score = jnp.asarray([[0.1, 0.2, 0.7, 0.95, 0.0, 0.0]])
    expected = {1: [1, 2, 3, 7], 2: [4, 2, 3, 7], 3: [4, 2, 6, 3, 7], 4: [4, 6, 3, 7]}
    for k, want in expected.items():
        c, x = select_edits(resp, lens, cur, nxt, cur_score, nxt_score, k=k, eos_id=EOS)
        out, n, _ = apply_predictions(resp, lens, c, x, del_id=DEL, eos_id=EOS, max_len=5)
        assert np.asarray(out)[0, :int(n[0])].tolist() == want + [EOS], k
    # a threshold of 0.75 keeps the append (0.95) and the replacement (0.9)
    c, x = select_edits(resp, lens, cur, nxt, cur_score, nxt_score, threshold=0.75, eos_id=EOS)
    out, n, _ = apply_predictions(resp, lens, c, x, del_id=DEL, eos_id=EOS, max_len=5)
    assert np.asarray(out)[0, :int(n[0])].tolist() == [4, 2, 3, 7, EOS]

"""ME-DLM's edit rounds on device (`jaxlm.inference.diffusion.edit`), checked row by row against
the list-based `jaxlm.data.edit_labels.apply_edits` and, with oracle predictions from the
canonical alignment, by reaching the clean response."""

from __future__ import annotations

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


def test_apply_predictions_matches_apply_edits_row_by_row():
    rng = np.random.default_rng(0)
    B, W = 256, 12
    lengths = rng.integers(1, 8, B)
    response = np.full((B, W), EOS, np.int32)
    for b in range(B):
        response[b, :lengths[b] - 1] = rng.integers(0, 8, lengths[b] - 1)
    # predictions mostly "keep / insert nothing", some replaces, deletes and insertions
    cur = np.where(rng.random((B, W)) < 0.6, response, rng.choice([0, 1, 2, 3, 4, 5, 6, 7, DEL], (B, W)))
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


def _host_edit_rounds(model, prompt_row, prompt_valid, response, rounds, max_len):
    """The edit loop on the host: one eager forward over the unpadded sequence per round,
    greedy heads (mask id excluded) and the list-based `apply_edits`."""
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
        new = apply_edits(response, cur.argmax(-1), nxt.argmax(-1), del_id=DELETE, eos_id=eos, max_len=max_len)
        changed = new != response or (cur.argmax(-1) == DELETE).any()
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


def test_sampler_edit_errors(edit_model):
    import jaxlm
    from jaxlm.inference.diffusion import diffusion_generate
    from jaxlm.models.transformer import build_model
    with pytest.raises(ValueError, match="edit_max_length=4 is shorter than gen_length=8"):
        diffusion_generate(edit_model, PROMPTS, gen_length=8, steps=8, edit_rounds=2, edit_max_length=4)
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

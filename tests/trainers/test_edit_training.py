"""ME-DLM's mask + edit training (`trainers.edit_batches`, ``DiffusionConfig(objective="edit")``):
the two batch kinds against direct constructions, the loss against numpy, and harness runs with
resume."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.checkpoint import load_model
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Sorting
from jaxlm.models.config import ModelConfig
from jaxlm.models.transformer import build_model
from trainers import edit_batches
from trainers.config import DiffusionConfig, ExperimentConfig, OptimizerConfig, TrainerConfig
from trainers.diffusion import edit_loss_sum
from trainers.edit_batches import IGNORE
from trainers.loop import train

MASK, DELETE, EOS = 259, 260, 2


def _rows(T=12):
    """Two SFT rows: BOS + prompt (untrained), answer + EOS padding (trained), then padding."""
    tokens = np.zeros((2, T), np.int32)
    loss_mask = np.zeros((2, T), bool)
    seg = np.zeros((2, T), np.int32)
    for b, (prompt, answer) in enumerate([([1, 51, 50, 61], [48, 49, 50, EOS, EOS]), ([1, 55, 61], [70, EOS])]):
        row = prompt + answer
        tokens[b, :len(row)], seg[b, :len(row)] = row, 1
        loss_mask[b, len(prompt):len(row)] = True
    return {"tokens": tokens, "loss_mask": loss_mask, "segment_ids": seg,
            "positions": np.where(seg > 0, np.arange(T)[None], 0).astype(np.int32)}


def test_mask_batch_labels_follow_the_masks():
    batch = _rows()
    for seed in range(20):
        out = edit_batches.mask_batch(batch, np.random.default_rng(seed), mask_id=MASK, eps=1e-3)
        for b in range(2):
            real = batch["segment_ids"][b] > 0
            trained = batch["loss_mask"][b]
            masked = out["tokens"][b] == MASK
            assert not (masked & ~trained).any()  # the prompt is never masked
            np.testing.assert_array_equal(out["tokens"][b][~masked & real], batch["tokens"][b][~masked & real])
            np.testing.assert_array_equal(out["cur_labels"][b], np.where(masked, batch["tokens"][b], IGNORE))
            np.testing.assert_array_equal(out["next_labels"][b], np.append(out["cur_labels"][b][1:], IGNORE))
            np.testing.assert_array_equal(out["segment_ids"][b], batch["segment_ids"][b])
            # the same draws again: the weight is exactly 1 / p and the masks are the drawn ones
            p, drawn = edit_batches._draw_masks(edit_batches.split_rows(batch), np.random.default_rng(seed), 1e-3)[b]
            assert out["weight"][b] == pytest.approx(1 / p, rel=1e-6)
            np.testing.assert_array_equal(masked[trained], drawn)
    # the masking rate is p = 1 / weight: over many draws the masked fraction matches it
    rng = np.random.default_rng(0)
    big = {k: np.repeat(v, 500, 0) for k, v in batch.items()}
    out = edit_batches.mask_batch(big, rng, mask_id=MASK, eps=1e-3)
    expected = np.sum(big["loss_mask"].sum(1) / out["weight"])
    assert abs((out["tokens"] == MASK).sum() - expected) < 4 * np.sqrt(expected)


@pytest.fixture(scope="module")
def edit_model():
    config = ModelConfig.tiny(vocab_size=261, mode="diffusion", mask_token_id=MASK, next_token_head=True,
                              delete_token_id=DELETE, init_std=0.3, max_seq_len=64)
    return build_model(config, seed=2, tokenizer=jaxlm.ByteTokenizer())


def test_intermediate_batch_without_rounds_is_the_models_fill(edit_model):
    """One forward fills every mask (per_step >= answer length) with the greedy proposals of
    an eager forward (delete and mask banned); EOS dropped, one EOS closes the response, and the
    labels are the canonical alignment's against the clean answer."""
    from jaxlm.data.edit_labels import edit_labels, position_labels
    batch = _rows()
    rng_draws = np.random.default_rng(5)
    out = edit_batches.intermediate_batch(batch, np.random.default_rng(5), edit_model, mask_id=MASK, del_id=DELETE,
                                          eos_id=EOS, eps=1e-3, per_step=16, rounds=0, order="confidence")
    draws = edit_batches._draw_masks(edit_batches.split_rows(batch), rng_draws, 1e-3)
    for b, ((prompt, answer), (p, masked)) in enumerate(zip(edit_batches.split_rows(batch), draws)):
        x = jnp.asarray([prompt + np.where(masked, MASK, answer).tolist()], jnp.int32)
        logits = np.array(edit_model(x).logits[0])
        logits[:, [DELETE, MASK]] = -np.inf
        filled = np.where(masked, logits[len(prompt):].argmax(-1), answer)
        noisy = [int(t) for t in filled if t != EOS][:12 - len(prompt) - 1]
        L = len(prompt) + len(noisy) + 1
        assert out["tokens"][b, :L].tolist() == prompt + noisy + [EOS]
        assert out["weight"][b] == pytest.approx(1 / p)
        clean = [t for t in answer if t != EOS]
        cur, nxt = position_labels(*edit_labels(noisy, clean, del_id=DELETE, eos_id=EOS, ignore_id=IGNORE),
                                   prompt_len=len(prompt), eos_id=EOS, ignore_id=IGNORE)
        assert out["cur_labels"][b, :L].tolist() == cur.tolist() and out["next_labels"][b, :L].tolist() == nxt.tolist()
        assert (out["cur_labels"][b, L:] == IGNORE).all() and (out["segment_ids"][b, L:] == 0).all()


def test_intermediate_batch_rows_fit_after_self_edits(edit_model):
    batch = _rows()
    for seed in range(3):
        out = edit_batches.intermediate_batch(batch, np.random.default_rng(seed), edit_model, mask_id=MASK,
                                              del_id=DELETE, eos_id=EOS, eps=1e-3, per_step=2, rounds=4)
        for b in range(2):
            L = int((out["segment_ids"][b] > 0).sum())
            assert out["tokens"][b, L - 1] == EOS and out["cur_labels"][b, L - 1] == EOS
            assert MASK not in out["tokens"][b, :L].tolist()


def test_edit_loss_sum_matches_numpy():
    rng = np.random.default_rng(0)
    B, T, V = 3, 6, 7
    logits, next_logits = rng.normal(size=(2, B, T, V)).astype(np.float32)
    cur = np.where(rng.random((B, T)) < 0.5, rng.integers(0, V, (B, T)), IGNORE)
    nxt = np.where(rng.random((B, T)) < 0.5, rng.integers(0, V, (B, T)), IGNORE)
    cur[2], nxt[2] = IGNORE, IGNORE  # a document without labels adds nothing
    nxt[1] = IGNORE  # a head without labels adds 0
    weight = np.asarray([1.5, 3.0, 7.0], np.float32)

    def ce(z, t):
        z = z.astype(np.float64)
        return np.log(np.exp(z - z.max()).sum()) + z.max() - z[t]

    expected, docs = 0.0, 0
    for b in range(B):
        row = 0.0
        for z, labels in ((logits, cur), (next_logits, nxt)):
            terms = [ce(z[b, i], labels[b, i]) for i in range(T) if labels[b, i] != IGNORE]
            row += np.mean(terms) if terms else 0.0
        if (cur[b] != IGNORE).any() or (nxt[b] != IGNORE).any():
            expected += weight[b] * row
            docs += 1
    batch = {"cur_labels": jnp.asarray(cur), "next_labels": jnp.asarray(nxt), "weight": jnp.asarray(weight)}
    total, count = edit_loss_sum(jnp.asarray(logits), jnp.asarray(next_logits), batch)
    assert float(count) == docs == 2
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)


def _levenshtein(a, b):
    """Textbook recursion with memoisation (independent of the row-vectorised table)."""
    import functools

    @functools.lru_cache(maxsize=None)
    def d(i, j):
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_edit_distance_and_nearest_answer_against_the_recursion():
    from jaxlm.data.edit_labels import edit_distance
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = (tuple(rng.integers(0, 4, rng.integers(0, 9)).tolist()) for _ in range(2))
        assert edit_distance(list(a), list(b)) == _levenshtein(a, b), (a, b)
    up, down = [48, 49, 50, 51], [51, 50, 49, 48]
    assert edit_batches.nearest_answer([48, 49, 50, 48], [up, down]) == up  # one substitution from up
    assert edit_batches.nearest_answer([51, 50, 50, 48], [up, down]) == down
    assert edit_batches.nearest_answer([51, 49, 50, 48], [up, down]) == up  # a tie: the first (the row's own)
    assert edit_batches.nearest_answer([51, 49, 50, 48], [down, up]) == down


def test_intermediate_batch_labels_against_the_nearest_accepted_answer(edit_model):
    """With ``accepted``, each output is labelled against the nearest of its row's answer and the
    accepted ones: here the reverse of each answer, and an answer equal to the model's own fill."""
    from jaxlm.data.edit_labels import edit_labels, position_labels
    batch = _rows()
    plain = edit_batches.intermediate_batch(batch, np.random.default_rng(5), edit_model, mask_id=MASK, del_id=DELETE,
                                            eos_id=EOS, eps=1e-3, per_step=16, rounds=0)
    rows = edit_batches.split_rows(batch)
    fills = []
    for b, (prompt, _) in enumerate(rows):
        L = int((plain["segment_ids"][b] > 0).sum())
        fills.append(plain["tokens"][b, len(prompt):L - 1].tolist())
    accepted = [[[t for t in answer if t != EOS][::-1], fills[b]] for b, (_, answer) in enumerate(rows)]
    out = edit_batches.intermediate_batch(batch, np.random.default_rng(5), edit_model, mask_id=MASK, del_id=DELETE,
                                          eos_id=EOS, eps=1e-3, per_step=16, rounds=0, accepted=accepted)
    np.testing.assert_array_equal(out["tokens"], plain["tokens"])  # the same draws and fill
    for b, (prompt, answer) in enumerate(rows):
        L = len(prompt) + len(fills[b]) + 1
        # the fill itself is accepted: nothing to edit, every token keeps itself
        cur, nxt = position_labels(*edit_labels(fills[b], fills[b], del_id=DELETE, eos_id=EOS, ignore_id=IGNORE),
                                   prompt_len=len(prompt), eos_id=EOS, ignore_id=IGNORE)
        assert out["cur_labels"][b, :L].tolist() == cur.tolist() and out["next_labels"][b, :L].tolist() == nxt.tolist()
        assert out["cur_labels"][b, len(prompt):L - 1].tolist() == fills[b]


def test_sorting_accepted_completions_and_the_nearest_target_needs_them(tmp_path):
    either = Sorting(length=4, max_value=9, separator="", order="either")
    for i in range(20):
        e = either.example(i)
        got = either.accepted_completions(e["prompt"])
        assert sorted(got) == sorted({"".join(map(str, sorted(e["values"]))),
                                      "".join(map(str, sorted(e["values"], reverse=True)))})
        assert all(either.verify(e, c) == 1.0 for c in got)
    assert Sorting(length=3).accepted_completions("sort 31 2 10:") == ["2 10 31"]
    with pytest.raises(ValueError, match="is not a sorting prompt"):
        either.accepted_completions("sum 12:")
    from jaxlm.data.tasks import Arithmetic
    assert Arithmetic().accepted_completions("12+30=") is None
    cfg = _config(tmp_path)
    with pytest.raises(ValueError, match="edit_target"):
        DiffusionConfig(objective="edit", edit_target="closest")
    bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=Arithmetic(digits=1)),
                              algorithm=dataclasses.replace(cfg.algorithm, edit_target="nearest"))
    with pytest.raises(ValueError, match="edit_target='nearest' needs a generated task .* data.source=Arithmetic"):
        train(bad)


def _config(tmp_path, ratio=0.5, **trainer):
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=261, mode="diffusion", mask_token_id=MASK, next_token_head=True,
                               delete_token_id=DELETE, d_model=32, ffn_dim=64, max_seq_len=64),
        data=DataConfig(source=Sorting(length=3, max_value=9), seq_len=24, batch_size=8, eval_examples=8),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(**{"steps": 4, "out_dir": str(tmp_path), "progress": False, "log_every": 1,
                                 "eval_every": 0, "save_every": 2, "eval_generate": 4, "eval_max_new_tokens": 8,
                                 "async_checkpoint": False, **trainer}),
        algorithm=DiffusionConfig(objective="edit", eval_steps=4, eval_edit_rounds=2, edit_intermediate_ratio=ratio,
                                  edit_max_rounds=4),
    )


def test_edit_training_with_the_nearest_target_runs(tmp_path):
    cfg = _config(tmp_path, ratio=1.0, steps=2)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=Sorting(length=3, max_value=9,
                                                                                      order="either")),
                              algorithm=dataclasses.replace(cfg.algorithm, edit_target="nearest"))
    out = train(cfg)
    assert 0.0 <= out.final_eval["accuracy"] <= 1.0


def test_edit_training_runs_and_resumes_exactly(tmp_path):
    straight = train(_config(tmp_path / "a"))
    assert 0.0 <= straight.final_eval["accuracy"] <= 1.0 and straight.samples
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    kinds = [json.loads(line).get("intermediate") for line in lines]
    assert 0.0 in kinds and 1.0 in kinds  # both batch kinds were trained on
    train(_config(tmp_path / "b", stop_after=2))
    train(_config(tmp_path / "b"))
    a, b = load_model(str(tmp_path / "a" / "model")), load_model(str(tmp_path / "b" / "model"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.config.next_token_head and a.config.delete_token_id == DELETE


def test_edit_config_errors(tmp_path):
    cfg = _config(tmp_path)
    with pytest.raises(ValueError, match="needs model.next_token_head=True and model.delete_token_id"):
        dataclasses.replace(cfg, model=ModelConfig.tiny(vocab_size=261, mode="diffusion", mask_token_id=MASK))
    with pytest.raises(ValueError, match="data.pack=False"):
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack=True))
    with pytest.raises(ValueError, match="edit_intermediate_ratio"):
        DiffusionConfig(objective="edit", edit_intermediate_ratio=1.5)
    with pytest.raises(ValueError, match="edit_fill_per_step"):
        DiffusionConfig(objective="edit", edit_fill_per_step=(0,))
    with pytest.raises(ValueError, match="edit_max_rounds"):
        DiffusionConfig(objective="edit", edit_max_rounds=-1)
    with pytest.raises(ValueError, match="edit_round_cycle"):
        DiffusionConfig(objective="edit", edit_round_cycle=0)


def test_add_edit_head_keeps_the_model_and_copies_its_head():
    from jaxlm.models.edit_head import add_edit_head
    base = build_model(ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=MASK, init_std=0.3), seed=4)
    edit_model = add_edit_head(base)
    assert edit_model.config.vocab_size == 261 and edit_model.config.delete_token_id == 260
    x = jnp.asarray([[1, 50, 51, MASK, MASK, 7]])
    before, after = base(x), edit_model(x)
    np.testing.assert_allclose(np.asarray(after.logits[..., :260]), np.asarray(before.logits), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(after.logits[..., 260]), 0.0)
    np.testing.assert_array_equal(np.asarray(after.next_logits), np.asarray(after.logits))
    # in bf16 too: both heads accumulate and return float32 (the next-token head's logits were
    # rounded to bf16 first, 0.03 off on logits of ~10)
    bf16 = build_model(ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=MASK, init_std=0.5,
                                        param_dtype="bfloat16"), seed=4)
    out = add_edit_head(bf16)(x)
    assert out.next_logits.dtype == out.logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out.next_logits), np.asarray(out.logits))
    # tied embeddings: the current-token head is the embedding (<|del|>'s row the mean one); the copy matches it
    tied = build_model(ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=MASK, init_std=0.3,
                                        tie_embeddings=True), seed=4)
    out = add_edit_head(tied)(x)
    np.testing.assert_allclose(np.asarray(out.logits[..., :260]), np.asarray(tied(x).logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.next_logits), np.asarray(out.logits), atol=1e-5)
    # compressed query/key heads keep their own RoPE frequencies (state that is not a Param)
    small = build_model(ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=MASK, init_std=0.3,
                                         qk_head_dim=8), seed=4)
    kept = 1.0 / 10000 ** (np.arange(4, 8) * 2 / small.config.head_dim)  # as if the low-frequency pairs were kept
    for block in small.layers:
        block.attn.rope_inv_freq.set_value(jnp.asarray(np.tile(kept, (small.config.n_kv_heads, 1)), jnp.float32))
    out = add_edit_head(small)
    np.testing.assert_array_equal(np.asarray(out.layers[0].attn.rope_inv_freq[...])[0], kept.astype(np.float32))
    np.testing.assert_allclose(np.asarray(out(x).logits[..., :260]), np.asarray(small(x).logits), atol=1e-5)
    with pytest.raises(ValueError, match="already has a next-token head"):
        add_edit_head(edit_model)
    with pytest.raises(ValueError, match="masked diffusion LM"):
        add_edit_head(build_model(ModelConfig.tiny(vocab_size=260), seed=0))


def test_medlm_recipe_is_an_edit_model_of_the_diffusion_recipe():
    from jaxlm.models.edit_head import add_edit_head
    from trainers.recipes import load_config
    cfg = load_config("medlm_sort")
    base = load_config("diffusion_sort", ["model.n_layers=6", "data.source.length=8", "data.seq_len=48"])
    assert cfg.algorithm.objective == "edit" and cfg.data.source == base.data.source
    edit_model = add_edit_head(build_model(base.model, seed=0))
    assert edit_model.config == cfg.model  # init_from the diffusion recipe's model after add_edit_head fits

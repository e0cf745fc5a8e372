"""The SFT loss with a teacher: every term against a numpy reference built from both models'
full logits (shifts, packing and masking included), row-chunked == whole (values and
gradients), top-K and offline modes, TPA against explicit two-step joints, and gradient
accumulation exact under unequal token counts."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlm
from jaxlm.models.masks import segment_mask
from trainers.distill.config import DistillConfig
from trainers.distill.loss import make_distill_loss_fn, transition_alignment
from trainers.pear import PEARConfig
from trainers.step import init_state, make_train_step

from packed_rows import packed_row, stacked

TOK = jaxlm.ByteTokenizer()
STUDENT = jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1, init_std=0.3)
TEACHER = jaxlm.ModelConfig.tiny(d_model=48, n_heads=2, n_kv_heads=1, ffn_dim=96, n_layers=2, init_std=0.5)
EXAMPLES = [{"prompt": "12+30=", "completion": "42"}, {"prompt": "7+8=", "completion": "15"},
            {"prompt": "sort 3 1 2:", "completion": "1 2 3"}, {"prompt": "a", "completion": "a longer answer here"}]


def _batch(groups, T=40):
    return stacked([packed_row(group, TOK, T) for group in groups])


BATCH = _batch([[EXAMPLES[0], EXAMPLES[1]], [EXAMPLES[3]], [EXAMPLES[2], EXAMPLES[0]], [EXAMPLES[1]]])


@pytest.fixture(scope="module")
def models():
    s, t = jaxlm.build_model(STUDENT, seed=0), jaxlm.build_model(TEACHER, seed=1)
    sg, ss = nnx.split(s)
    tg, ts = nnx.split(t)
    return s, t, (sg, nnx.to_pure_dict(ss)), (tg, nnx.to_pure_dict(ts))


def _np_logp(model, batch, tau):
    mask = segment_mask(batch["segment_ids"], sliding_window=model.config.sliding_window)  # each model's own window
    logits = model(batch["tokens"], batch["positions"], mask=mask).logits
    z = np.asarray(logits, np.float64) / tau
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _np_valid(batch):
    tok, seg, m = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_mask"))
    valid = np.zeros(tok.shape, bool)
    valid[:, :-1] = m[:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    targets = np.zeros_like(tok)
    targets[:, :-1] = tok[:, 1:]
    return targets, valid


def _kl(p, q):
    nz = p > 0
    return float(np.sum(p[nz] * np.log(p[nz] / q[nz])))


def np_reference(s, t, batch, cfg):
    """(sum, count) of the distillation loss, from the definitions, position by position."""
    tau = cfg.temperature
    ls, lt, ls1 = _np_logp(s, batch, tau), _np_logp(t, batch, tau), _np_logp(s, batch, 1.0)
    targets, valid = _np_valid(batch)
    total = 0.0
    for r, i in zip(*np.nonzero(valid)):
        p, q = np.exp(lt[r, i]), np.exp(ls[r, i])
        if cfg.teacher_logprobs == "topk":
            head = np.argsort(-p, kind="stable")[:cfg.top_k]
            rest = np.setdiff1d(np.arange(len(p)), head)
            p = np.concatenate([p[head], [p[rest].sum()]])
            q = np.concatenate([q[head], [q[rest].sum()]])
        if cfg.divergence == "forward_kl":
            d = _kl(p, q)
        elif cfg.divergence == "jsd":
            b = cfg.jsd_beta
            m = b * p + (1 - b) * q
            d = b * _kl(p, m) + (1 - b) * _kl(q, m)
        else:
            raise NotImplementedError(cfg.divergence)
        loss = cfg.ce_weight * -ls1[r, i, targets[r, i]] + cfg.weight * tau**2 * d
        if cfg.tpa_weight and i + 1 < valid.shape[1] and valid[r, i + 1]:
            y = targets[r, i]
            pn, qn = np.exp(lt[r, i + 1]), np.exp(ls[r, i + 1])
            P = np.concatenate([np.exp(lt[r, i, y]) * pn, [1 - np.exp(lt[r, i, y])]])
            Q = np.concatenate([np.exp(ls[r, i, y]) * qn, [1 - np.exp(ls[r, i, y])]])
            loss += cfg.tpa_weight * tau**2 * _kl(P, Q)
        total += loss
    return total, float(valid.sum())


CONFIGS = {
    "forward_kl+ce+tpa": DistillConfig(teacher="t", divergence="forward_kl", ce_weight=0.3, tpa_weight=0.7,
                                       temperature=2.0),
    "jsd": DistillConfig(teacher="t", divergence="jsd", jsd_beta=0.3, temperature=0.7),
    "topk_forward_kl": DistillConfig(teacher="t", divergence="forward_kl", teacher_logprobs="topk", top_k=5,
                                     weight=0.5, ce_weight=1.0),
    "topk_jsd": DistillConfig(teacher="t", divergence="jsd", teacher_logprobs="topk", top_k=3),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_matches_numpy_reference(models, name):
    s, t, (sg, sp), (tg, tp) = models
    cfg = CONFIGS[name]
    fn = make_distill_loss_fn(sg, sliding_window=None, distill=cfg, pear=None, teacher_graphdef=tg,
                              vocab_size=STUDENT.vocab_size)
    total, (count, sums) = jax.jit(fn)(sp, BATCH, tp)
    want_total, want_count = np_reference(s, t, BATCH, cfg)
    assert float(count) == want_count == float(sums["tokens"])
    np.testing.assert_allclose(float(total), want_total, rtol=2e-5)


@pytest.mark.parametrize("name", ["forward_kl+ce+tpa", "topk_jsd"])
def test_row_chunks_give_the_same_loss_and_gradient(models, name):
    _, _, (sg, sp), (tg, tp) = models
    cfg = CONFIGS[name]

    def grads(chunked):  # chunks of 7 rows, not dividing B * T
        c = DistillConfig(**{**cfg.__dict__, "chunk_rows": 7})
        fn = make_distill_loss_fn(sg, sliding_window=None, distill=c, pear=None, teacher_graphdef=tg,
                                  vocab_size=STUDENT.vocab_size, chunked=chunked)
        return jax.jit(jax.value_and_grad(lambda p: fn(p, BATCH, tp)[0]))(sp)

    (whole, g_whole), (chunked, g_chunked) = grads(False), grads(True)
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_chunked)):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6)


def test_transition_alignment_is_the_kl_of_two_step_joints():
    rng = np.random.default_rng(0)
    V = 9
    for _ in range(5):
        p_y, q_y = rng.uniform(0.05, 0.95, 2)
        pn, qn = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
        fkl = _kl(pn, qn)
        P = np.concatenate([p_y * pn, [1 - p_y]])
        Q = np.concatenate([q_y * qn, [1 - q_y]])
        got = transition_alignment(jnp.log(p_y), jnp.log(q_y), jnp.asarray(fkl), form="joint_bucket")
        np.testing.assert_allclose(float(got), _kl(P, Q), rtol=1e-5)
        prod = transition_alignment(jnp.log(p_y), jnp.log(q_y), jnp.asarray(fkl), form="product")
        np.testing.assert_allclose(float(prod), float(np.sum(P[:-1] * np.log(P[:-1] / Q[:-1]))), rtol=1e-5)
    # a teacher certain of the data token: no bucket term, and no nan
    got = transition_alignment(jnp.asarray(0.0), jnp.log(0.4), jnp.asarray(0.25), form="joint_bucket")
    np.testing.assert_allclose(float(got), np.log(1 / 0.4) + 0.25, rtol=1e-6)


def _sgd_step(sg, loss_fn, params, batch, side, accum):
    tx = optax.sgd(1.0)
    step = make_train_step(sg, tx, lambda s: 1.0, grad_accum=accum, loss_fn=loss_fn, donate=False)
    new, metrics = step(init_state(params, tx, 0), (batch, side))
    return new.params, metrics


@pytest.mark.parametrize("with_pear", [False, True])
def test_gradient_accumulation_is_exact_with_unequal_token_counts(models, with_pear):
    """Rows 0, 2 (micro-batch 0) and 1, 3 (micro-batch 1) hold very different token counts;
    two micro-batches give the update of one batch, PEAR's self-normalisation included."""
    s, _, (sg, sp), (tg, tp) = models
    cfg = CONFIGS["forward_kl+ce+tpa"]
    batch = dict(BATCH)
    pear = None
    if with_pear:
        rng = np.random.default_rng(0)
        batch["behavior_logprobs"] = jnp.asarray(-rng.uniform(0, 4, batch["tokens"].shape), jnp.float32)
        pear = PEARConfig(variant="block", gamma=0.8, block_size=2, clip=3.0)
    fn = make_distill_loss_fn(sg, sliding_window=None, distill=cfg, pear=pear, teacher_graphdef=tg,
                              vocab_size=STUDENT.vocab_size)
    one, m1 = _sgd_step(sg, fn, sp, batch, tp, 1)
    two, m2 = _sgd_step(sg, fn, sp, batch, tp, 2)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-6)
    for k in ("loss", "tokens", "ce", "distill", "tpa"):
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5)
    _, valid = _np_valid(batch)
    assert float(m1["tokens"]) == valid.sum()
    if with_pear:
        np.testing.assert_allclose(float(m2["pear_weight"]), float(m1["pear_weight"]), rtol=1e-5)


def test_offline_topk_equals_the_online_teacher(models, tmp_path):
    """Top-K log-probs written by `jaxlm logprobs` into the data rows give the loss the online
    top-K teacher gives."""
    from jaxlm.data.pipeline import DataConfig, train_dataset
    from jaxlm.data.files import Files
    from trainers.annotate import annotate_file

    _, t, (sg, sp), (tg, tp) = models
    t.tokenizer = TOK
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    annotate_file(t, data, tmp_path / "scored.jsonl", as_="teacher", top_k=4)
    batch = next(iter(train_dataset(DataConfig(source=Files(path=str(tmp_path / "scored.jsonl"), eval_fraction=0.0),
                                               seq_len=40, batch_size=4, pack=True), TOK)))
    assert batch["teacher_topk_ids"].shape == (4, 40, 4)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    online = DistillConfig(teacher="t", teacher_logprobs="topk", top_k=4, tpa_weight=0.5)
    offline = DistillConfig(teacher_logprobs="offline", tpa_weight=0.5)
    got = {}
    for name, cfg in (("online", online), ("offline", offline)):
        fn = make_distill_loss_fn(sg, sliding_window=None, distill=cfg, pear=None, teacher_graphdef=tg,
                                  vocab_size=STUDENT.vocab_size)
        got[name] = jax.jit(fn)(sp, batch, tp)
    np.testing.assert_allclose(float(got["offline"][0]), float(got["online"][0]), rtol=1e-5)
    for k in ("distill", "tpa"):
        np.testing.assert_allclose(float(got["offline"][1][1][k]), float(got["online"][1][1][k]), rtol=1e-5)


def test_a_windowed_teacher_attends_with_its_own_window(models, tmp_path):
    """A sliding-window teacher (Mistral-style) for a full-attention student: the online loss
    equals the reference with each model's own window, and `jaxlm logprobs` stores the
    windowed teacher's log-probs (both used the student's / no window)."""
    from jaxlm.data.files import Files
    from jaxlm.data.pipeline import DataConfig, train_dataset
    from trainers.annotate import annotate_file

    s, _, (sg, sp), _ = models
    t = jaxlm.build_model(TEACHER.replace(sliding_window=4), seed=1, tokenizer=TOK)
    tg, ts = nnx.split(t)
    tp = nnx.to_pure_dict(ts)
    cfg = CONFIGS["forward_kl+ce+tpa"]
    fn = make_distill_loss_fn(sg, sliding_window=None, distill=cfg, pear=None, teacher_graphdef=tg,
                              vocab_size=STUDENT.vocab_size)
    total, (count, _) = jax.jit(fn)(sp, BATCH, tp)
    want, want_count = np_reference(s, t, BATCH, cfg)
    assert float(count) == want_count
    np.testing.assert_allclose(float(total), want, rtol=2e-5)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    annotate_file(t, data, tmp_path / "scored.jsonl", as_="teacher", top_k=4)
    batch = next(iter(train_dataset(DataConfig(source=Files(path=str(tmp_path / "scored.jsonl"), eval_fraction=0.0),
                                               seq_len=40, batch_size=4, pack=True), TOK)))
    lt = _np_logp(t, {k: jnp.asarray(v) for k, v in batch.items()}, 1.0)
    targets, valid = _np_valid(batch)
    stored = np.asarray(batch["teacher_logprobs"])[:, 1:]  # entry t + 1 scores token t + 1
    ref = np.take_along_axis(lt, targets[..., None], -1)[..., 0][:, :-1]
    np.testing.assert_allclose(stored[valid[:, :-1]], ref[valid[:, :-1]], atol=2e-5)


@pytest.mark.parametrize("mode", ["full", "topk"])
@pytest.mark.parametrize("chunked", [False, True])
def test_fused_forward_kl_backward_equals_autodiff(models, mode, chunked):
    """The hand-written backward pass of the forward KL (+ CE) == autodiff of the generic path."""
    _, _, (sg, sp), (tg, tp) = models
    cfg = DistillConfig(teacher="t", divergence="forward_kl", teacher_logprobs=mode, top_k=4, ce_weight=0.4,
                        temperature=1.7, chunk_rows=7)
    out = {}
    for fused in (False, True):
        fn = make_distill_loss_fn(sg, sliding_window=None, distill=cfg, pear=None, teacher_graphdef=tg,
                                  vocab_size=STUDENT.vocab_size, chunked=chunked, fused=fused)
        out[fused] = jax.jit(jax.value_and_grad(lambda p: fn(p, BATCH, tp)[0]))(sp)
    np.testing.assert_allclose(float(out[True][0]), float(out[False][0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[False][1]), jax.tree.leaves(out[True][1])):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6)


def test_a_quantized_teacher_distils_from_its_own_logits(models):
    """A 4-bit teacher (`jaxlm.quant.quantize_model`, LM head kept dense) runs in the step:
    the loss is the numpy reference on the quantized teacher's own logits."""
    from jaxlm.quant import QuantRecipe, quantize_model

    s, t, (sg, sp), _ = models
    qt = quantize_model(t, QuantRecipe(format="nvfp4"))
    qg, qs = nnx.split(qt)
    cfg = DistillConfig(teacher="t", divergence="forward_kl", ce_weight=0.2, temperature=1.3)
    fn = make_distill_loss_fn(sg, sliding_window=None, distill=cfg, pear=None, teacher_graphdef=qg,
                              vocab_size=STUDENT.vocab_size)
    total, _ = jax.jit(fn)(sp, BATCH, nnx.to_pure_dict(qs))
    np.testing.assert_allclose(float(total), np_reference(s, qt, BATCH, cfg)[0], rtol=2e-5)
    assert abs(np_reference(s, qt, BATCH, cfg)[0] - np_reference(s, t, BATCH, cfg)[0]) > 1e-3  # really quantized


@pytest.mark.parametrize("gap", [20.0, 60.0, 95.0])
def test_fused_topk_backward_when_the_students_tail_is_far_below_the_teachers(gap):
    """p_T / q_T beyond float range: the gradient d KL(p_bins || q_bins) / dz = q - p^ (p^ = p on
    the head, p_T q_v / q_T on the tail) against a float64 reference, fused and autodiff."""
    from trainers.distill.loss import fused_forward_kl_terms, position_terms, teacher_topk

    V, K = 6, 2
    w = jnp.eye(V, dtype=jnp.float32)  # logits = h
    targets = jnp.asarray([0])
    teacher = teacher_topk(jnp.asarray([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0]]), w, targets, k=K, temperature=1.0, chunk=None)
    cfg = DistillConfig(teacher="t", teacher_logprobs="topk", top_k=K)
    h = jnp.asarray([[0.0, 0.0] + [-gap, -gap - 1.0, -gap - 2.0, -gap]], jnp.float32)
    z = np.asarray(h, np.float64)[0]
    lq = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    pb = np.exp(np.asarray(teacher["bucket"], np.float64)[0])
    q_tail = np.exp(lq[2:] - np.log(np.exp(lq[2:]).sum()))
    ref = np.exp(lq) - np.concatenate([pb[:2], pb[2] * q_tail])
    fused = jax.grad(lambda x: fused_forward_kl_terms(x, w, targets, teacher, tau=1.0, chunk=None)["div"].sum())(h)
    auto = jax.grad(lambda x: position_terms(x, w, targets, teacher, cfg, chunk=None, need_fkl=False)["div"].sum())(h)
    np.testing.assert_allclose(np.asarray(fused)[0], ref, atol=1e-6)
    np.testing.assert_allclose(np.asarray(auto)[0], ref, atol=1e-6)


def test_transition_alignment_of_a_confident_student_is_finite():
    """log q(y) rounds to 0 in float32 above a logit margin of ~17; the bucket's log(1 - q(y))
    is then the exact log-sum over the other tokens, not -inf (inf loss, NaN gradients)."""
    from trainers.distill.loss import log_rest, position_terms

    V = 5
    w = jnp.eye(V, dtype=jnp.float32)
    targets = jnp.asarray([0, 0])
    cfg = DistillConfig(teacher="t", divergence="forward_kl", tpa_weight=1.0)
    for margin in (12.0, 18.0, 30.0):
        h = jnp.asarray([[margin, 0.0, -1.0, 0.5, 0.0], [1.0, 2.0, 0.0, 0.0, 0.0]], jnp.float32)
        teacher = {"h": jnp.asarray([[3.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]], jnp.float32), "w": w}

        def tpa(x):
            t = position_terms(x, w, targets, teacher, cfg, chunk=None, need_fkl=True)
            fkl_next = jnp.asarray([t["fkl"][1], 0.0])
            return transition_alignment(t["p_target"], t["q_target"], fkl_next, form="joint_bucket",
                                        p_rest=t["p_rest"], q_rest=t["q_rest"])[0]

        value, grad = jax.value_and_grad(tpa)(h)
        # float64 reference: KL of the two-step joints with the other first tokens in one bin
        p = np.exp(np.asarray(teacher["h"], np.float64))
        p /= p.sum(-1, keepdims=True)
        q = np.exp(np.asarray(h, np.float64) - np.asarray(h, np.float64).max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        P = np.concatenate([p[0, 0] * p[1], [1 - p[0, 0]]])
        Q = np.concatenate([q[0, 0] * q[1], [q[0, 1:].sum()]])
        np.testing.assert_allclose(float(value), _kl(P, Q), rtol=1e-4)
        assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(float(log_rest(jnp.asarray([[0.0, -40.0, -41.0]]), jnp.asarray([0]))[0]),
                               np.log(np.exp(-40.0) + np.exp(-41.0)), rtol=1e-6)


@pytest.mark.parametrize("K", [4, 20])
def test_offline_tail_aware_without_tail_weight_is_the_bucket_kl_of_the_stored_k(models, K):
    """tail_aware with tail_beta = 0 on stored top-K log-probs is forward KL over the K + 1
    stored bins, whatever K the rows were written with (cfg.top_k = 10 here): it failed for
    K < 10 and lumped stored head tokens into the tail for K > 10."""
    _, _, (sg, sp), _ = models
    V = STUDENT.vocab_size
    rng = np.random.default_rng(0)
    B, T = BATCH["tokens"].shape
    batch = dict(BATCH)
    batch["teacher_topk_ids"] = jnp.asarray([[rng.choice(V, K, replace=False) for _ in range(T)] for _ in range(B)],
                                            jnp.int32)
    batch["teacher_topk_logprobs"] = jnp.asarray(np.log(rng.dirichlet(np.ones(K + 1), size=(B, T))[..., :K]),
                                                 jnp.float32)
    got = {}
    for name, cfg in (("fkl", DistillConfig(teacher_logprobs="offline")),
                      ("tail", DistillConfig(teacher_logprobs="offline", divergence="tail_aware", tail_beta=0.0))):
        fn = make_distill_loss_fn(sg, sliding_window=None, distill=cfg, pear=None, vocab_size=V)
        got[name] = float(jax.jit(fn)(sp, batch, None)[0])
    np.testing.assert_allclose(got["tail"], got["fkl"], rtol=1e-6)


def test_logprobs_of_rows_past_the_model_length_are_refused():
    """`jaxlm logprobs` scored rows longer than max_seq_len at positions the model was not
    built for; a row that fits exactly is scored."""
    from jaxlm.data.files import DataError
    from trainers.annotate import token_logprobs

    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(max_seq_len=32), seed=0, tokenizer=TOK)
    fits = {"prompt": "1+2=", "completion": "x" * 26}  # BOS + 4 + 26 + EOS = 32 tokens
    assert len(token_logprobs(model, [fits])[0]["logprobs"]) == 32
    with pytest.raises(DataError, match=r"row 1 encodes to 33 tokens, more than .*max_seq_len=32"):
        token_logprobs(model, [fits, {"prompt": "1+2=", "completion": "x" * 27}])

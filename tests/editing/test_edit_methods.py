"""The editing methods end to end on a tiny model (no training needed): every method runs
through the same API, gradient edits reach their targets, and CrispEdit's projection keeps
the outputs on the protected corpus closer to the original than fine-tuning does (the
Bregman/KL constraint of arXiv 2602.15823 in miniature)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.data.facts import FactWorld, read_requests, write_requests
from jaxlm.editing.benchmark import corpus_texts, run_method
from jaxlm.editing.crispedit import GradientEditConfig
from jaxlm.editing.kfac import token_batches
from jaxlm.editing.locate import LocateEditConfig
from jaxlm.editing.metrics import EditEvaluator

WORLD = FactWorld(n_subjects=12, relations=("city",))


@pytest.fixture(scope="module")
def setup():
    model = jaxlm.build_model(
        jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=2, init_std=0.2),
        seed=0, tokenizer=jaxlm.ByteTokenizer(),
    )
    requests = WORLD.edit_requests(4, seed=0)
    corpus = corpus_texts(WORLD, 64)
    evaluator = EditEvaluator(model, requests, model.tokenizer, [])
    return model, requests, corpus, evaluator


def _corpus_kl(model, edited, corpus):
    """Mean KL(p_original || p_edited) over the corpus tokens."""
    total, n = 0.0, 0
    for tokens, valid in token_batches(jaxlm.ByteTokenizer(), corpus, batch_size=64, seq_len=40):
        p = jax.nn.log_softmax(model(jnp.asarray(tokens), mask=jnp.asarray(valid)).logits)
        q = jax.nn.log_softmax(edited(jnp.asarray(tokens), mask=jnp.asarray(valid)).logits)
        kl = jnp.sum(jnp.exp(p) * (p - q), axis=-1)
        total += float(jnp.sum(kl * valid))
        n += int(valid.sum())
    return total / n


def test_crispedit_reaches_the_edits_with_less_change_on_the_protected_corpus(setup):
    model, requests, corpus, evaluator = setup
    cfg = GradientEditConfig(layers=(0, 1), lr=1e-2, epochs=60, batch_size=4, energy=0.9)
    kw = dict(tokenizer=model.tokenizer, corpus=corpus, evaluator=evaluator, gradient=cfg)
    crisp = run_method(model, requests, "crispedit", **kw)
    ft = run_method(model, requests, "finetune", **kw)
    assert crisp.metrics["efficacy_exact"] == 1.0 and ft.metrics["efficacy_exact"] == 1.0
    kl_crisp, kl_ft = _corpus_kl(model, crisp.model, corpus), _corpus_kl(model, ft.model, corpus)
    assert kl_crisp < 0.8 * kl_ft, (kl_crisp, kl_ft)  # measured 0.51 vs 0.75 nats


def test_sequential_batches_and_locate_methods_run_on_the_same_api(setup):
    model, requests, corpus, evaluator = setup
    cfg = GradientEditConfig(layers=(1,), lr=1e-2, epochs=3, batch_size=2)
    run = run_method(model, requests, "crispedit", tokenizer=model.tokenizer, corpus=corpus,
                     evaluator=evaluator, gradient=cfg, batches=2)
    assert len(run.per_batch) == 2
    assert run.info["capability_recomputes"] == 1  # small drift: statistics computed once
    import dataclasses

    eager = run_method(model, requests, "crispedit", tokenizer=model.tokenizer, corpus=corpus, evaluator=evaluator,
                       gradient=dataclasses.replace(cfg, recompute_threshold=0.0), batches=2)
    assert eager.info["capability_recomputes"] == 2  # any drift past 0 recomputes before the next batch
    locate = LocateEditConfig(layers=(0,), v_steps=3)
    for method in ("memit", "alphaedit"):
        r = run_method(model, requests, method, tokenizer=model.tokenizer, corpus=corpus,
                       evaluator=evaluator, locate=locate, batches=2)
        changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jaxlm.models.params.flat_params(model)),
                                                               jax.tree.leaves(jaxlm.models.params.flat_params(r.model))))
        assert changed, method
        assert np.isfinite(list(r.metrics.values())).all(), r.metrics
    with pytest.raises(ValueError, match="target layer 1 must be followed"):
        run_method(model, requests, "memit", tokenizer=model.tokenizer, corpus=corpus, evaluator=evaluator,
                   locate=LocateEditConfig(layers=(0, 1)))


def test_requests_file_round_trip_and_errors(tmp_path):
    requests = WORLD.edit_requests(3, seed=1)
    path = write_requests(requests, tmp_path / "r.jsonl")
    assert read_requests(path) == requests
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*target_new"):
        read_requests(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "x", "target_new": " y"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        read_requests(tmp_path / "broken.jsonl")
    bad_rows = {
        '"paraphrase_prompts": "a string"': r"paraphrase_prompts must be a list of non-empty strings",
        '"neighborhood": [{"prompt": "p"}]': r"neighborhood must be a list of .* objects",
        '"target_true": 3': r"target_true must be a non-empty string",
        # caught at edit time before (a bare TypeError, or the wrong request's index), or silently
        '"subject": 5': r"subject must be a non-empty string that occurs in prompt",
        '"subject": "Qwerty"': r"subject must be a non-empty string that occurs in prompt",
        '"subject": ""': r"subject must be a non-empty string that occurs in prompt",
        '"target_true": " y"': r"target_new equals target_true",
    }
    for extra, match in bad_rows.items():
        (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "target_new": " y", ' + extra + '}\n')
        with pytest.raises(ValueError, match=r"bad.jsonl:1: " + match):
            read_requests(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"layers=\(2, 1\) is invalid: MEMIT/AlphaEdit edit the layers in ascending"):
        LocateEditConfig(layers=(2, 1))
    with pytest.raises(ValueError, match="energy=1.5"):
        GradientEditConfig(energy=1.5)
    from jaxlm.editing.kfac import check_module

    for bad in ((0.7,), (True,), (1, 1.9)):  # were truncated to ints
        with pytest.raises(ValueError, match="layer indices must be ints"):
            check_module("mlp.down_proj", bad, 3)
    assert check_module("mlp.down_proj", (np.int64(2), 0), 3) == (2, 0)
    # a project value other than gradient / update ran fine-tuning without the projection
    for kwargs, match in [(dict(project="updates"), "project='updates' is invalid"),
                          (dict(merge_weight="rows"), "merge_weight='rows' is invalid"),
                          (dict(stop_loss=-1.0), "stop_loss=-1.0 is invalid"),
                          (dict(recompute_threshold=float("nan")), "recompute_threshold=nan is invalid"),
                          # a negative decay pushed kernels away from zero; NaN / inf only failed as a divergence
                          (dict(weight_decay=-5.0), "weight_decay=-5.0 is invalid"),
                          (dict(weight_decay=float("nan")), "weight_decay=nan is invalid"),
                          (dict(lr=float("inf")), "lr=inf is invalid")]:
        with pytest.raises(ValueError, match=match):
            GradientEditConfig(**kwargs)
    # v_steps <= 0 returned the model unchanged as "edited"; batch_size 0 failed in range()
    for kwargs, match in [(dict(v_steps=0), "v_steps=0 is invalid: must be an int >= 1"),
                          (dict(v_steps=-3), "v_steps=-3 is invalid"),
                          (dict(batch_size=0), "batch_size=0 is invalid"),
                          (dict(batch_size=2.5), "batch_size=2.5 is invalid"),
                          (dict(v_weight_decay=-1.0), "v_weight_decay=-1.0 is invalid")]:
        with pytest.raises(ValueError, match=match):
            LocateEditConfig(**kwargs)
    from jaxlm.editing.requests import encode_pairs

    with pytest.raises(ValueError, match="2 prompts but 1 subjects"):  # a bare IndexError before
        encode_pairs(jaxlm.ByteTokenizer(), ["Bob is", "Ann is"], [" a", " b"], subjects=["Bob"])
    with pytest.raises(ValueError, match="n=500"):
        WORLD.edit_requests(500)


def test_targets_with_a_leading_space_encode_as_in_the_whole_text(tmp_path):
    """A Llama-2 / Mistral style tokenizer.json (normalizer: prepend "▁", spaces to "▁") turns
    a separately encoded " Paris" into "▁" + "▁Paris": the pair is encoded as the whole text
    reads, and the subject's key is its last token there."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from jaxlm.data.tokenizers import HFTokenizer
    from jaxlm.editing.requests import encode_pairs

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # for training only
    bpe.train_from_iterator(["Bob lives in Paris", "Ann lives in Tokyo", "The home town of Bob is Paris"] * 50,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    bpe.pre_tokenizer = None
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    prompts, targets = ["Bob lives in", "The home town of Bob is"], [" Paris", " Tokyo"]
    enc = encode_pairs(tok, prompts, targets, subjects=["Bob", "Bob"])
    for r, (p, t) in enumerate(zip(prompts, targets)):
        whole = tok.encode(p + t, add_bos=True)
        assert enc.tokens[r][enc.valid[r]].tolist() == whole
        target = enc.tokens[r][enc.target_mask[r]].tolist()
        assert target == whole[-len(target):] and len(target) < len(tok.encode(t))  # no stray "▁" token
        ids, offsets = tok.encode_with_offsets(p + t)
        end = p.index("Bob") + 3
        assert enc.key_position[r] == 1 + max(k for k, (a, _) in enumerate(offsets) if a < end)

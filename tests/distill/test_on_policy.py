"""On-policy distillation (GKD's student-sampled batches; TPA along the student's own tokens):
the resampled rows are the student's completions after the data's prompts, laid out as SFT rows,
rows that cannot be resampled are refused, and the run trains through the harness."""

import json

import numpy as np
import pytest

import jaxlm
from jaxlm.data.files import Files
from jaxlm.data.pipeline import DataConfig, train_dataset
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.distill.config import DistillConfig
from trainers.distill.on_policy import sample_rows, split_prompts
from trainers.loop import train
from trainers.pear import PEARConfig

TOK = jaxlm.ByteTokenizer()
SMALL = jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1, max_seq_len=64)
ROWS = [{"prompt": "q" * (1 + a % 5) + f"{a}+{b}=", "completion": str(a + b)} for a in range(9) for b in range(5)]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def student():
    return jaxlm.build_model(SMALL, seed=5, tokenizer=TOK)


def _data(path, **kw):
    return DataConfig(source=Files(path=str(path), eval_fraction=0.1), seq_len=24, batch_size=8, pack=False,
                      eval_examples=8, **kw)


def test_sampled_rows_are_the_students_completions_after_the_datas_prompts(data_file, student):
    batch = next(iter(train_dataset(_data(data_file), TOK)))
    batch = {k: np.concatenate([v, np.zeros_like(v[:1])]) for k, v in batch.items()}  # plus one empty row
    T = batch["tokens"].shape[1]
    rows, info = sample_rows(student, batch, seed=0, temperature=0.0, max_new_tokens=None, eos_id=TOK.eos_id)
    assert set(rows) == {"tokens", "loss_mask", "segment_ids", "positions"}
    assert all(v.shape == batch["tokens"].shape for v in rows.values())
    longest = 0
    lengths = []
    for b in range(len(batch["tokens"]) - 1):
        n = int((batch["segment_ids"][b] > 0).sum())
        first = int(np.flatnonzero(batch["loss_mask"][b])[0])
        prompt = batch["tokens"][b, :first].tolist()
        assert TOK.decode(prompt) + TOK.decode(batch["tokens"][b, first:n]) == ROWS_TEXT[TOK.decode(prompt)]
        longest = max(longest, len(prompt))
        lengths.append((prompt, b))
    for prompt, b in lengths:
        # the reference: the same student decoding this prompt alone, greedily
        ref = jaxlm.generate(student, [prompt], max_new_tokens=T - longest, temperature=0, add_bos=False)
        completion = ref.completions()[0]
        P, L = len(prompt), len(prompt) + len(completion)
        assert rows["tokens"][b, :L].tolist() == prompt + completion
        assert rows["tokens"][b, L:].tolist() == [TOK.pad_id] * (T - L)
        assert rows["loss_mask"][b].tolist() == [False] * P + [True] * (L - P) + [False] * (T - L)
        assert rows["segment_ids"][b].tolist() == [1] * L + [0] * (T - L)
        assert rows["positions"][b, :L].tolist() == list(range(L))
    assert not rows["segment_ids"][-1].any() and not rows["loss_mask"][-1].any()  # the empty row stays empty
    assert info["on_policy_length"] == pytest.approx(np.mean(rows["loss_mask"][:-1].sum(1)))

    capped, _ = sample_rows(student, batch, seed=0, temperature=0.0, max_new_tokens=2, eos_id=TOK.eos_id)
    assert capped["loss_mask"].sum(1).max() <= 2
    np.testing.assert_array_equal(capped["tokens"][:, :3], rows["tokens"][:, :3])
    sampled_a, _ = sample_rows(student, batch, seed=1, temperature=1.0, max_new_tokens=None, eos_id=TOK.eos_id)
    sampled_b, _ = sample_rows(student, batch, seed=1, temperature=1.0, max_new_tokens=None, eos_id=TOK.eos_id)
    np.testing.assert_array_equal(sampled_a["tokens"], sampled_b["tokens"])  # seeded


ROWS_TEXT = {r["prompt"]: r["prompt"] + r["completion"] for r in ROWS}


def _row(tokens, trained, segments):
    T = 12
    out = {"tokens": np.zeros((1, T), np.int32), "loss_mask": np.zeros((1, T), bool),
           "segment_ids": np.zeros((1, T), np.int32), "positions": np.zeros((1, T), np.int32)}
    n = len(tokens)
    out["tokens"][0, :n], out["loss_mask"][0, :n], out["segment_ids"][0, :n] = tokens, trained, segments
    return out


def test_rows_that_cannot_be_resampled_are_refused():
    assert split_prompts(_row([1, 5, 6, 7], [0, 0, 1, 1], [1, 1, 1, 1])) == [[1, 5]]
    with pytest.raises(ValueError, match="packs 2 examples"):
        split_prompts(_row([1, 5, 6, 1, 5, 6], [0, 0, 1, 0, 0, 1], [1, 1, 1, 2, 2, 2]))
    with pytest.raises(ValueError, match="not one span at the end"):
        split_prompts(_row([1, 5, 6, 7, 8], [0, 1, 0, 0, 1], [1] * 5))  # a two-turn chat
    with pytest.raises(ValueError, match="no prompt"):
        split_prompts(_row([5, 6], [1, 1], [1, 1]))
    with pytest.raises(ValueError, match="no trained token"):
        split_prompts(_row([5, 6], [0, 0], [1, 1]))


def test_a_conditioned_row_is_sampled_under_its_condition_and_keeps_it():
    """A MeGan row's condition text: the student samples under it (it sampled unconditioned,
    and the loss then ran on those rows without it); per-token columns are refused."""
    import dataclasses

    import jax
    from flax import nnx

    model = jaxlm.build_model(dataclasses.replace(SMALL, mlp="meta_swiglu", init_std=0.5), seed=2, tokenizer=TOK)
    params = nnx.to_pure_dict(nnx.state(model))
    rng = np.random.default_rng(0)  # a trained hypernetwork: the condition changes the MLP gates
    params["meta_gate"] = jax.tree.map(lambda x: np.asarray(rng.normal(size=x.shape), x.dtype), params["meta_gate"])
    nnx.update(model, params)
    rows = [_row([1, 40 + b, 50, 60], [0, 0, 0, 1], [1, 1, 1, 1]) for b in range(3)]
    batch = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    batch["condition"] = np.asarray([[70, 71, 72], [80, 81, 0], [90, 0, 0]], np.int32)
    batch["condition_mask"] = batch["condition"] > 0
    got, _ = sample_rows(model, batch, seed=0, temperature=0.0, max_new_tokens=5, eos_id=None)
    np.testing.assert_array_equal(got["condition"], batch["condition"])
    want = jaxlm.generate(model, [[1, 40 + b, 50] for b in range(3)], max_new_tokens=5, temperature=0.0,
                          add_bos=False, stop_tokens=(), condition=(batch["condition"], batch["condition_mask"]))
    np.testing.assert_array_equal(got["tokens"][:, 3:8], np.asarray(want.tokens))
    free = jaxlm.generate(model, [[1, 40 + b, 50] for b in range(3)], max_new_tokens=5, temperature=0.0,
                          add_bos=False, stop_tokens=())
    assert not np.array_equal(np.asarray(free.tokens), np.asarray(want.tokens))  # the condition matters here
    with pytest.raises(ValueError, match=r"carry \['teacher_logprobs'\]"):
        sample_rows(model, {**batch, "teacher_logprobs": np.zeros((3, 12), np.float32)}, seed=0, temperature=0.0,
                    max_new_tokens=5, eos_id=None)


def test_on_policy_settings_are_checked(teacher_dir, data_file):
    for bad, match in ((dict(on_policy=1.5), "on_policy=1.5"), (dict(on_policy=-0.1), "on_policy=-0.1"),
                       (dict(on_policy=1.0, ce_weight=0.5), "ce_weight=0.5"),
                       (dict(on_policy_max_new_tokens=0), "on_policy_max_new_tokens=0"),
                       (dict(on_policy_temperature=-1.0), "on_policy_temperature")):
        with pytest.raises(ValueError, match=match):
            DistillConfig(teacher=str(teacher_dir), **bad)
    with pytest.raises(ValueError, match="needs a live teacher"):
        DistillConfig(teacher_logprobs="offline", on_policy=0.5)
    distill = DistillConfig(teacher=str(teacher_dir), on_policy=0.5)
    with pytest.raises(ValueError, match="data.pack=False"):
        ExperimentConfig(model=SMALL, data=DataConfig(source=Files(path=str(data_file)), pack=True),
                         algorithm=SFTConfig(distill=distill))
    with pytest.raises(ValueError, match="does not combine with algorithm.pear"):
        ExperimentConfig(model=SMALL, data=_data(data_file), algorithm=SFTConfig(distill=distill, pear=PEARConfig()))


def test_on_policy_distillation_trains_through_the_harness(tmp_path, teacher_dir, data_file):
    algo = SFTConfig(distill=DistillConfig(teacher=str(teacher_dir), on_policy=0.5, tpa_weight=1.0,
                                           on_policy_max_new_tokens=6))
    cfg = ExperimentConfig(
        model=SMALL, data=_data(data_file),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1),
        trainer=TrainerConfig(out_dir=str(tmp_path / "run"), steps=6, progress=False, log_every=1, eval_every=0,
                              save_every=100, eval_generate=0),
        algorithm=algo,
    )
    assert train(cfg).step == 6
    recs = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]
    assert len(recs) == 6 and {r["on_policy"] for r in recs} == {0.0, 1.0}
    for r in recs:
        assert np.isfinite(r["loss"]) and r["distill"] > 0 and r["tpa"] > 0
        if r["on_policy"]:
            assert 1 <= r["on_policy_length"] <= 6

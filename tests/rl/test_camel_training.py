"""CAMEL's training pieces (method card B.7): the judging task's format and verifier, the
counterfactual verdict prefixes (the policy's own greedy verdict, as `gated_judge` takes it, or
the other letter), and the camel collector's rows and rewards through the GRPO trainer."""

import json

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm.data.judging import SumJudging
from jaxlm.data.pipeline import DataConfig
from jaxlm.eval.camel import CamelTemplate, gated_judge
from jaxlm.eval.judge import pairwise_prompts
from trainers.config import CamelConfig, ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig
from trainers.loop import make_tokenizer, train
from trainers.rl.camel import CamelCollector, verdict_prefixes
from trainers.rl.loop import GRPOTrainer

TOK = make_tokenizer("byte")
MODEL = jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1, max_seq_len=128)


def test_sum_judging_examples_are_camel_judgments_of_a_sum():
    task = SumJudging(digits=2)
    seen = set()
    for i in range(200):
        e = task.example(i, "train")
        a, b = e["operands"]
        shown = [int(e["first"]), int(e["second"])]
        right, wrong = shown[e["answer"]], shown[1 - e["answer"]]
        assert right == a + b and abs(wrong - right) in (1, 10) and wrong >= 0
        assert e["prompt"] == pairwise_prompts([f"{a}+{b}="], [e["first"]], [e["second"]])[0]
        letter = "AB"[e["answer"]]
        assert e["completion"] == f"{letter}\nWhy: {a}+{b}={a + b}\nFinal: {letter}"
        assert task.verify(e, e["completion"]) == 1.0
        other = "AB"[1 - e["answer"]]
        assert task.verify(e, f"{letter}\nWhy: ...\nFinal: {other}") == 0.0  # the last final verdict counts
        assert task.verify(e, f"{other}\nWhy: x\nFinal: {other}\nFinal: {letter}") == 1.0
        assert task.verify(e, letter) == 0.0  # no final verdict: no credit
        seen.add(e["answer"])
    assert seen == {0, 1}
    revising = SumJudging(revise_fraction=0.5)
    kinds = []
    for i in range(200):
        e = revising.example(i, "train")
        a, b = e["operands"]
        right, wrong = "AB"[e["answer"]], "AB"[1 - e["answer"]]
        assert e["judge_prompt"] == pairwise_prompts([f"{a}+{b}="], [e["first"]], [e["second"]])[0]
        if e["revision"]:  # the wrong verdict is context; the completion corrects it
            assert e["prompt"] == e["judge_prompt"] + wrong + "\nWhy: "
            assert e["completion"] == f"{a}+{b}={a + b}\nFinal: {right}"
        else:
            assert e["prompt"] == e["judge_prompt"] and e["completion"].startswith(right + "\nWhy: ")
        assert revising.verify(e, e["completion"]) == 1.0
        kinds.append(e["revision"])
    assert 0.35 < np.mean(kinds) < 0.65
    # a held-out problem is not trained in its revision form either (the split is the judging prompt's)
    small = SumJudging(digits=1, revise_fraction=0.5)
    held = {small.example(i, "eval")["judge_prompt"] for i in range(300)}
    assert not held & {small.example(i, "train")["judge_prompt"] for i in range(3000)}
    for bad, match in ((dict(digits=0), "digits"), (dict(wrong_offsets=()), "wrong_offsets"),
                       (dict(wrong_offsets=(0,)), "wrong_offsets"), (dict(revise_fraction=2), "revise_fraction"),
                       (dict(reflection="steps"), "reflection")):
        with pytest.raises(ValueError, match=match):
            SumJudging(**bad)


@pytest.mark.parametrize("width", [0, 4, 6])
def test_checking_reflection_copies_answer_a_and_compares_it_with_the_sum(width):
    checking = SumJudging(wrong_offsets=(1, 10, 1000), revise_fraction=0.5, reflection="check", width=width)
    for i in range(100):
        c = checking.example(i, "train")
        a, b = c["operands"]
        assert c["prompt"] == c["judge_prompt"] + ("AB"[1 - c["answer"]] + "\nWhy: " if c["revision"] else "")
        shown = [c["first"], c["second"]]
        assert c["judge_prompt"] == f"Question: {a}+{b}=\nAnswer A: {shown[0]}\nAnswer B: {shown[1]}\nBetter: "
        if width:  # every answer zero-padded to the width
            assert all(len(x) == width and x.isdigit() for x in shown)
        else:
            assert all(x == str(int(x)) for x in shown)
        assert int(shown[c["answer"]]) == a + b and abs(int(shown[1 - c["answer"]]) - (a + b)) in (1, 10, 1000)
        ok = "yes" if int(c["first"]) == a + b else "no"  # from the shown numbers, not the label
        right = "AB"[c["answer"]]
        total = str(a + b).zfill(width)
        check = f"{a}+{b}={total}\nA={c['first']}? {ok}\nFinal: {right}"
        assert c["completion"] == (check if c["revision"] else f"{right}\nWhy: {check}")
        assert checking.verify(c, c["completion"]) == 1.0
    for bad in (3, -1, 2.0, True):  # 99+99+1000 has 4 digits
        with pytest.raises(ValueError, match="width"):
            SumJudging(wrong_offsets=(1, 10, 1000), width=bad)


def _column_addition(a: int, b: int, shown: str, columns: int) -> list[str]:
    """Schoolbook addition on zero-filled digit strings, right to left, checking ``shown``."""
    xs, ys, zs = (str(v).zfill(columns)[::-1] for v in (a, b, int(shown)))
    out, carry = [], 0
    for x, y, z in zip(xs, ys, zs):
        total = int(x) + int(y) + carry
        out.append(f"{x}+{y}+{carry}={total:02d} A{z} {'ok' if z == str(total)[-1] else 'no'}")
        carry = 1 if total > 9 else 0
    return out


@pytest.mark.parametrize("digits,offsets,width", [(2, (1, 10, 1000), 0), (2, (1, 10, 1000), 4),
                                                  (3, (1, 10, 100), 0), (1, (1, 10), 5)])
def test_column_reflection_adds_by_columns_and_checks_answer_a_digit_by_digit(digits, offsets, width):
    task = SumJudging(digits=digits, wrong_offsets=offsets, revise_fraction=0.5, reflection="columns", width=width)
    lengths = set()
    for i in range(150):
        c = task.example(i, "train")
        a, b = c["operands"]
        columns = width or max(len(str(a + b)), len(c["first"]))
        lengths.add(columns)
        a_right = int(c["first"]) == a + b  # from the shown numbers, not the label
        right = "AB"[c["answer"]]
        lines = _column_addition(a, b, c["first"], columns)
        assert all(line.endswith("ok") for line in lines) == a_right
        body = "\n".join([f"{a}+{b}=", *lines, f"A? {'yes' if a_right else 'no'}", f"Final: {right}"])
        assert c["completion"] == (body if c["revision"] else f"{right}\nWhy: {body}")
        assert task.verify(c, c["completion"]) == 1.0
    if not width:  # the columns follow the longer of the sum and answer A
        assert len(lengths) > 1


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_random_wrong_answers_have_the_right_answers_digit_count(digits):
    task = SumJudging(digits=digits, wrong_offsets=(1, 10), random_wrong=0.5)
    offsets, draws = 0, set()
    for i in range(400):
        e = task.example(i, "train")
        a, b = e["operands"]
        shown = [int(e["first"]), int(e["second"])]
        right, wrong = shown[e["answer"]], shown[1 - e["answer"]]
        assert right == a + b and wrong != right
        if abs(wrong - right) in (1, 10):
            offsets += 1
        else:
            assert len(str(wrong)) == len(str(right))
            draws.add(wrong)
    assert 0.35 < offsets / 400 < 0.75 and len(draws) > 30
    assert all(abs(int(e["first"]) - int(e["second"])) in (1, 10)  # the default draws no random answers
               for e in (SumJudging(digits=digits).example(i, "train") for i in range(50)))
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="random_wrong"):
            SumJudging(random_wrong=bad)


@pytest.fixture(scope="module")
def judge():
    return jaxlm.build_model(MODEL, seed=1, tokenizer=TOK)


def test_verdict_prefixes_are_the_judges_own_verdict_or_the_other(judge):
    task = SumJudging()
    examples = [task.example(i) for i in range(12)]
    # the reference: gated_judge at tau = 0 (never reflects) reports the one-token verdicts
    ref = gated_judge(judge, [e["question"] for e in examples], [e["first"] for e in examples],
                      [e["second"] for e in examples], tau=0.0).initial
    template = CamelTemplate()
    kept, own, flipped = verdict_prefixes(judge, TOK, examples, template=template, flip_prob=0.0,
                                          rng=np.random.default_rng(0))
    np.testing.assert_array_equal(own, ref)
    assert not flipped.any() and [k["initial"] for k in kept] == ref.tolist()
    assert [k["prefix"] for k in kept] == ["AB"[v] + "\nWhy: " for v in ref]
    forced, _, flipped = verdict_prefixes(judge, TOK, examples, template=template, flip_prob=1.0,
                                          rng=np.random.default_rng(0))
    assert flipped.all() and [k["initial"] for k in forced] == (1 - ref).tolist()
    half, _, flipped = verdict_prefixes(judge, TOK, examples * 20, template=template, flip_prob=0.5,
                                        rng=np.random.default_rng(0))
    assert 0.35 < flipped.mean() < 0.65
    revisions = [e for e in (SumJudging(revise_fraction=1.0).example(i) for i in range(12))]
    prefixed, own, _ = verdict_prefixes(judge, TOK, revisions, template=template, flip_prob=0.0,
                                        rng=np.random.default_rng(0))
    assert [p["prompt"] for p in prefixed] == [e["judge_prompt"] for e in revisions]  # the bare prompt, re-prefixed
    with pytest.raises(ValueError, match="no 'answer'"):
        verdict_prefixes(judge, TOK, [{"prompt": "x"}], template=template, flip_prob=0.5,
                         rng=np.random.default_rng(0))


def _cfg(out, steps=2, eval_every=0, **algo):
    return ExperimentConfig(
        model=MODEL, data=DataConfig(source=SumJudging(), seq_len=88, batch_size=4, pack=False, eval_examples=4),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(out_dir=str(out), steps=steps, progress=False, log_every=1, eval_every=eval_every,
                              save_every=100, eval_generate=4),
        algorithm=GRPOConfig(num_generations=2, max_new_tokens=24, mu=1, collector="camel", **algo),
    )


def test_camel_rollouts_continue_after_the_verdict_and_are_scored_with_it(judge, tmp_path):
    cfg = _cfg(tmp_path, camel=CamelConfig(flip_prob=0.5))
    trainer = GRPOTrainer(cfg, judge, TOK)
    col = trainer.collector
    assert isinstance(col, CamelCollector)
    state = trainer.init_state()
    exp = col(state.params, 3, jax.random.key(0))
    G, B = 2, 4
    P = cfg.data.seq_len - cfg.algorithm.max_new_tokens
    rows = exp.rows
    for r in range(B * G):
        ex = col._prefixed(3 * B + r // G)
        assert ex["prompt"] == SumJudging().example(3 * B + r // G)["prompt"]  # the data source's order
        ids = TOK.encode(ex["prompt"] + ex["prefix"], add_bos=True)
        assert rows["tokens"][r, P - len(ids):P].tolist() == ids  # the verdict sits in the prompt block
        assert not rows["loss_mask"][r, :P].any() and rows["loss_mask"][r, P:].sum() == rows["lengths"][r]
        text = TOK.decode(rows["completion"][r, :rows["lengths"][r]])
        assert exp.rewards.reshape(-1)[r] == SumJudging().verify(ex, ex["prefix"] + text)
    assert {"camel/own_correct", "camel/flipped", "camel/final_after_right", "camel/final_after_wrong"} <= set(
        exp.metrics)
    first = [col._prefixed(3 * B + i)["initial"] for i in range(B)]
    col(state.params, 3, jax.random.key(1))  # (seed, iteration) fixes the verdicts and flips
    assert [col._prefixed(3 * B + i)["initial"] for i in range(B)] == first


def test_camel_grpo_trains_through_the_harness(tmp_path):
    result = train(_cfg(tmp_path / "run", steps=2, eval_every=2))  # camel=None: CamelConfig()
    assert result.step == 2
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert len(train_recs) == 2 and all(np.isfinite(r["loss"]) and "camel/flipped" in r for r in train_recs)
    # held-out judging from the bare prompt: verdict, reflection and final verdict, greedily
    evals = [r for r in recs if r["kind"] == "eval" and "accuracy" in r]
    assert evals and all(0.0 <= r["accuracy"] <= 1.0 for r in evals)


def test_camel_settings_are_checked():
    with pytest.raises(ValueError, match="flip_prob"):
        CamelConfig(flip_prob=1.5)
    with pytest.raises(ValueError, match="needs collector='camel'"):
        GRPOConfig(camel=CamelConfig())


def test_camel_claims_reflection_checks_on_hand_written_reflections():
    """`bench/camel_claim.py`'s reflection diagnostics, against reflections written here."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("camel_claim", Path(__file__).parents[2] / "bench" / "camel_claim.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    task = SumJudging(wrong_offsets=(1, 10, 1000), reflection="check", width=4)
    e1 = {"operands": [97, 75], "question": "97+75=", "first": "0172", "second": "0173"}  # A right, same length
    e2 = {"operands": [56, 90], "question": "56+90=", "first": "1146", "second": "0146"}  # A wrong
    texts = ["97+75=0172\nA=0172? yes\nFinal: A",  # all right
             "56+90=0146\nA=1146? yes\nFinal: A",  # sum and copy right, check wrong
             "97+75=0171\nA=0172? no\nFinal: B",  # sum and check wrong
             "56+90=146\nA=146? no\nFinal: B"]  # unpadded sum, wrong copy; the check is right for A=1146
    got = bench.reflection_checks(task, [e1, e2, e1, e2], texts)
    assert got == {"sum": 0.5, "copy": 0.75, "check": 0.5, "check_same_length": 0.5}
    assert bench.reflection_checks(SumJudging(), [e1], ["97+75=172\nFinal: A"]) == {"sum": 1.0}

    columns = SumJudging(wrong_offsets=(1, 10, 1000), reflection="columns", width=4)
    texts = ["97+75=\n7+5+0=12 A2 ok\n9+7+1=17 A7 ok\n0+0+1=01 A1 ok\n0+0+0=00 A0 ok\nA? yes\nFinal: A",  # right
             # right columns and copy; the last digit check and the yes/no are wrong
             "56+90=\n6+0+0=06 A6 ok\n5+9+0=14 A4 ok\n0+0+1=01 A1 ok\n0+0+0=00 A1 ok\nA? yes\nFinal: A",
             # a dropped carry: the sum is 0162, A's copy is right, the checks follow the written digits
             "97+75=\n7+5+0=12 A2 ok\n9+7+0=16 A7 no\n0+0+0=00 A1 no\n0+0+0=00 A0 ok\nA? no\nFinal: B",
             # three columns only: no column or copy credit, the sum still reads 146
             "56+90=\n6+0+0=06 A6 ok\n5+9+0=14 A4 ok\n0+0+1=01 A1 ok\nA? no\nFinal: B"]
    got = bench.reflection_checks(columns, [e1, e2, e1, e2], texts)
    assert got == {"sum": 0.75, "copy": 0.75, "check": 0.5, "check_same_length": 0.5, "columns": 0.5,
                   "digit_checks": 14 / 15}

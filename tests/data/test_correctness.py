"""Correctness-model data: the three prompt variants, history retrieval (same model, other
questions; random or by word overlap), and records from a model's greedy answers with its
own confidence equal to the generated tokens' mean probability."""

import numpy as np
import pytest

import jaxlm
from jaxlm.data.correctness import CorrectnessRecord, correctness_history, gcm_rows, retrieve, verdict_prompt
from jaxlm.data.tasks import Arithmetic
from jaxlm.data.tokenizers import ByteTokenizer

RECORDS = [CorrectnessRecord("m1", "2+2", "4", True), CorrectnessRecord("m1", "2+3", "6", False),
           CorrectnessRecord("m2", "2+2", "5", False), CorrectnessRecord("m1", "9*9 big", "81", True),
           CorrectnessRecord("m1", "9*9 big number", "80", False)]


def test_variants():
    r = RECORDS[0]
    assert verdict_prompt(r) == "Q: 2+2\nA: 4\nCorrect? "
    assert verdict_prompt(r, "answerless") == "Q: 2+2\nCorrect? "
    text = verdict_prompt(r, "history", [RECORDS[1]])
    assert text.startswith("Model Alpha's record:\nQ: 2+3\nA: 6\nCorrect? N\nNow:\n") and text.endswith("A: 4\nCorrect? ")
    rows = gcm_rows(RECORDS, variant="standard")
    assert [row["completion"] for row in rows] == ["Y", "N", "N", "Y", "N"]
    with pytest.raises(ValueError, match="variant"):
        gcm_rows(RECORDS, variant="verbal")


def test_retrieval_keeps_to_the_model_and_other_questions():
    rng = np.random.default_rng(0)
    got = retrieve(RECORDS, RECORDS[3], 2, how="overlap", rng=rng)
    assert got[0].question == "9*9 big number" and all(h.model == "m1" and h.question != "9*9 big" for h in got)
    got = retrieve(RECORDS, RECORDS[2], 3, how="random", rng=rng)
    assert got == []  # m2 has no other record
    rows = gcm_rows(RECORDS, variant="history", k=2, retrieval="overlap")
    assert rows[2]["prompt"].count("Correct? ") == 1  # no history for m2


def test_history_from_a_model_records_its_own_confidence():
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=64), seed=0, tokenizer=ByteTokenizer())
    task = Arithmetic()
    recs = correctness_history(model, task, range(4), name="tiny", max_new_tokens=4)
    assert len(recs) == 4 and all(r.model == "tiny" and 0.0 < r.confidence <= 1.0 for r in recs)
    out = jaxlm.generate(model, [task.example(0, "eval")["prompt"]], max_new_tokens=4, temperature=0.0)
    n = int(out.lengths[0])
    assert recs[0].answer == out.texts[0]
    assert recs[0].confidence == pytest.approx(float(np.exp(np.asarray(out.logprobs)[0, :n].mean())), rel=1e-5)
    assert recs[0].correct == (task.verify(task.example(0, "eval"), out.texts[0]) >= 1.0)

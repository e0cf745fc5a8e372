"""CofactGVR's counterfactual bonus: the policy re-scores the answer under perturbed
evidence; the bonus goes only to verified rollouts, and equals an independent full-logit
computation."""

import numpy as np
import pytest
from flax import nnx
from scipy.special import log_softmax

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.models.config import ModelConfig
from trainers.rl.counterfactual import perturb_span, split_evidence
from trainers.rl.rewards import REWARDS


class CopyTask:
    """The answer must equal the evidence (a stand-in for 'the answer follows from the region')."""

    def verify(self, example, completion):
        parts = split_evidence(completion)
        return float(parts is not None and parts[1].strip() == example["answer"])


class Cfg:
    cf_quality = 1.0


def _reference_score(model, tok, context, answer):
    ids = tok.encode(context, add_bos=True) + tok.encode(answer)
    logits = np.asarray(model(np.asarray([ids], np.int32)).logits[0], np.float64)
    logp = log_softmax(logits[:-1], -1)
    n = len(tok.encode(answer))
    picked = [float(logp[len(ids) - n - 1 + j, ids[len(ids) - n + j]]) for j in range(n)]
    return np.exp(np.mean(picked))


def test_perturbation_changes_every_character_of_its_class():
    out = perturb_span("a7Z-", seed=3)
    assert len(out) == 4 and out[3] == "-"
    assert all(o != c for o, c in zip(out[:3], "a7Z"))
    assert out[0].islower() and out[1].isdigit() and out[2].isupper()
    assert perturb_span("a7Z-", seed=3) == out


def test_bonus_only_for_verified_rollouts_and_equal_to_full_logit_scores():
    cfg = ModelConfig.tiny(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    model = jaxlm.build_model(cfg, seed=0)
    tok = ByteTokenizer()
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    prompts = ["q1:", "q2:", "q3:", "q4:"]
    completions = ["<evidence>42</evidence>42", "<evidence>42</evidence>17", "no evidence 5", "<evidence>ab</evidence>ab"]
    examples = [{"prompt": p, "answer": a} for p, a in zip(prompts, ["42", "42", "5", "ab"])]
    bonus = REWARDS["counterfactual_bonus"](
        prompts, completions, examples=examples, task=CopyTask(), policy=(graphdef, params), tokenizer=tok, config=Cfg(),
    )
    assert bonus[1] == 0 and bonus[2] == 0  # wrong answer; no evidence span
    for i in (0, 3):
        context, answer = split_evidence(completions[i])
        span = context[len("<evidence>"):-len("</evidence>")]
        cf = "<evidence>" + perturb_span(span, seed=i) + "</evidence>"
        want = max(0.0, _reference_score(model, tok, prompts[i] + context, answer)
                   - _reference_score(model, tok, prompts[i] + cf, answer))
        assert bonus[i] == pytest.approx(want, abs=1e-5)
    assert bonus[0] > 0 or bonus[3] > 0  # the instance exercises a non-zero bonus


def test_bonus_scores_under_the_prompt_ids_the_policy_read():
    """The collector passes each rollout's prompt ids (a chat template may write BOS itself, so
    re-encoding the rendered prompt with BOS would score under a different prompt)."""
    cfg = ModelConfig.tiny(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    model = jaxlm.build_model(cfg, seed=1)
    tok = ByteTokenizer()
    graphdef, state = nnx.split(model)
    prompts = ["<bos>q1:", "<bos>q2:"]  # the rendered text, as a template writing its own BOS gives it
    read = [[tok.bos_id] + tok.encode("q1:"), [tok.bos_id] + tok.encode("q2:")]  # what the policy read
    completions = ["<evidence>42</evidence>42", "<evidence>7b</evidence>7b"]
    examples = [{"prompt": p, "answer": a} for p, a in zip(prompts, ["42", "7b"])]
    bonus = REWARDS["counterfactual_bonus"](
        prompts, completions, examples=examples, task=CopyTask(), policy=(graphdef, nnx.to_pure_dict(state)),
        tokenizer=tok, config=Cfg(), prompt_ids=read,
    )

    def score(ids, context, answer):
        full = ids + tok.encode(context) + tok.encode(answer)
        logits = np.asarray(model(np.asarray([full], np.int32)).logits[0], np.float64)
        logp = log_softmax(logits[:-1], -1)
        n = len(tok.encode(answer))
        return np.exp(np.mean([logp[len(full) - n - 1 + j, full[len(full) - n + j]] for j in range(n)]))

    for i in range(2):
        context, answer = split_evidence(completions[i])
        span = context[len("<evidence>"):-len("</evidence>")]
        cf = "<evidence>" + perturb_span(span, seed=i) + "</evidence>"
        want = max(0.0, score(read[i], context, answer) - score(read[i], cf, answer))
        assert bonus[i] == pytest.approx(want, abs=1e-5)
    assert bonus.max() > 0

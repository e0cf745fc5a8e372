"""pass@k against its definition: the fraction of k-subsets of a problem's n samples that hold
at least one correct sample (enumerated), and exact rational arithmetic at large n."""

import dataclasses
import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest

import jaxlm
from jaxlm.data.tasks import Arithmetic
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.pass_at_k import heldout_pass_at_k, pass_at_k


def enumerated(n: int, c: int, k: int) -> float:
    """Draw k of the n samples without replacement, every subset equally likely."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)  # samples 0..c-1 are the correct ones


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_matches_enumerating_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(enumerated(n, c, k), abs=1e-12), (n, c, k)


def test_large_n_against_exact_rationals():
    n = np.array([200, 200, 1000, 1000, 37, 64])
    c = np.array([0, 3, 1, 999, 36, 64])
    for k in (1, 7, 30, 37):
        want = [float(1 - Fraction(comb(int(a) - int(b), k), comb(int(a), k))) for a, b in zip(n, c)]
        np.testing.assert_allclose(pass_at_k(n, c, k), want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(pass_at_k(1000, 2, 500), float(1 - Fraction(comb(998, 500), comb(1000, 500))), rtol=1e-12)
    # k = 1 is the fraction correct
    rng = np.random.default_rng(0)
    n = rng.integers(5, 50, 20)
    c = rng.integers(0, n + 1)
    np.testing.assert_allclose(pass_at_k(n, c, 1), c / n, rtol=1e-12)
    assert pass_at_k(6, 0, 6) == 0.0 and pass_at_k(6, 1, 6) == 1.0 and pass_at_k(6, 6, 3) == 1.0
    assert pass_at_k(10, 9, 2) == 1.0  # fewer than k wrong samples: every k-subset holds a correct one


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="num_samples=4 < k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, 5, 2)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, -1, 2)
    with pytest.raises(ValueError, match="num_samples must hold integers"):
        pass_at_k(4.0, 1, 2)


@dataclasses.dataclass(frozen=True)
class EvenFirstByte(Arithmetic):
    """Any completion whose first character has an even code point counts as correct: a random
    model then solves about half of its samples, so pass@k is far from 0 and 1."""

    def verify(self, example, completion):
        return float(len(completion) > 0 and ord(completion[0]) % 2 == 0)


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=32), seed=0, tokenizer=ByteTokenizer())


def test_heldout_pass_at_k_scores_every_sample(model):
    task = EvenFirstByte(digits=1)
    out = heldout_pass_at_k(model, task, 6, ks=(1, 2, 4), max_new_tokens=3, batch_size=10, seed=1)
    assert out.samples_per_problem == 4 and out.correct.shape == (6,)
    held = [task.example(i, "eval") for i in range(6)]
    recount = np.array([sum(task.verify(e, t) for t in s["completions"]) for e, s in zip(held, out.samples)])
    np.testing.assert_array_equal(out.correct, recount)
    assert [s["prompt"] for s in out.samples] == [e["prompt"] for e in held]
    assert 0 < out.correct.sum() < 24  # a real mix of right and wrong samples
    for k in (1, 2, 4):
        assert out.pass_at_k[k] == pytest.approx(float(np.mean([enumerated(4, int(c), k) for c in recount])))
    assert out.pass_at_k[1] <= out.pass_at_k[2] <= out.pass_at_k[4]
    assert heldout_pass_at_k(model, task, 6, ks=(1, 2, 4), max_new_tokens=3, batch_size=10,
                             seed=1).pass_at_k == out.pass_at_k  # seeded


def test_greedy_samples_agree_and_give_greedy_accuracy(model):
    task = EvenFirstByte(digits=1)
    out = heldout_pass_at_k(model, task, 5, ks=(1, 3), temperature=0.0, max_new_tokens=3)
    assert all(len(set(s["completions"])) == 1 for s in out.samples)
    greedy = jaxlm.eval.heldout_accuracy(model, task, 5, max_new_tokens=3)
    assert out.pass_at_k[1] == out.pass_at_k[3] == pytest.approx(greedy.accuracy)


def test_heldout_pass_at_k_bad_arguments(model):
    task = EvenFirstByte(digits=1)
    with pytest.raises(ValueError, match="samples_per_problem=2 is invalid: must be an int >= max"):
        heldout_pass_at_k(model, task, 2, ks=(1, 4), samples_per_problem=2)
    with pytest.raises(ValueError, match="ks="):
        heldout_pass_at_k(model, task, 2, ks=())
    with pytest.raises(ValueError, match="n=0"):
        heldout_pass_at_k(model, task, 0)


def test_a_masked_diffusion_model_samples_with_diffusion_generate():
    config = jaxlm.ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=259, init_std=0.3, max_seq_len=32)
    dllm = jaxlm.build_model(config, seed=1, tokenizer=ByteTokenizer())
    task = EvenFirstByte(digits=1)
    greedy = heldout_pass_at_k(dllm, task, 3, ks=(1, 2), temperature=0.0, max_new_tokens=4)
    assert all(len(set(s["completions"])) == 1 for s in greedy.samples)
    assert greedy.pass_at_k[1] == pytest.approx(jaxlm.eval.heldout_accuracy(dllm, task, 3, max_new_tokens=4).accuracy)
    sampled = heldout_pass_at_k(dllm, task, 3, ks=(1, 2), temperature=1.5, max_new_tokens=4, seed=2)
    held = [task.example(i, "eval") for i in range(3)]
    recount = [sum(task.verify(e, t) for t in s["completions"]) for e, s in zip(held, sampled.samples)]
    np.testing.assert_array_equal(sampled.correct, recount)
    assert any(len(set(s["completions"])) > 1 for s in sampled.samples)  # the Gumbel-max draws differ
    with pytest.raises(ValueError, match="top_p=0.9 is invalid for a masked diffusion model"):
        heldout_pass_at_k(dllm, task, 2, top_p=0.9)

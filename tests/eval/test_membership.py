"""HaloScope's membership score against a reference written from the paper's definition
(eigenvectors of the centred Gram matrix ``F^T F``, whose eigenvalues are ``sigma_j^2``),
and the labelled selection of ``k`` and orientation."""

import numpy as np
import pytest

from jaxlm.eval.membership import membership_scores, select_membership
from jaxlm.eval.selective import auroc


def reference(x, k, weighting, fit=None):
    fit = x if fit is None else fit
    mean = fit.mean(axis=0)
    evals, evecs = np.linalg.eigh((fit - mean).T @ (fit - mean))
    top = np.argsort(evals)[::-1][:k]
    out = []
    for row in x:
        total = 0.0
        for j in top:
            sigma = np.sqrt(evals[j])
            inner = float((row - mean) @ evecs[:, j])
            total += sigma * inner**2 if weighting == "paper" else inner**2 / sigma**2
        out.append(total / k if weighting == "paper" else total)
    return np.array(out)


@pytest.mark.parametrize("weighting", ["paper", "whitened"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_scores_match_the_definition(k, weighting):
    rng = np.random.default_rng(k)
    x = rng.normal(size=(40, 9)) * np.linspace(3.0, 0.3, 9) + 0.7  # distinct singular values
    np.testing.assert_allclose(membership_scores(x, k, weighting=weighting), reference(x, k, weighting), rtol=1e-9)
    held = rng.normal(size=(5, 9))
    np.testing.assert_allclose(membership_scores(held, k, weighting=weighting, fit=x),
                               reference(held, k, weighting, fit=x), rtol=1e-9)


def test_whitened_scores_of_the_fit_set_sum_to_k():
    """Each whitened direction contributes sum_i <f_i, v_j>^2 / sigma_j^2 = 1 over the fit set."""
    x = np.random.default_rng(0).normal(size=(30, 6))
    assert membership_scores(x, 4, weighting="whitened").sum() == pytest.approx(4.0)
    # N points span N - 1 centred directions: the N-th has sigma at rounding level, and whitening
    # by it gave scores of 1e22 and more; k = N is refused there, and the default candidates stop
    few = np.random.default_rng(2).normal(size=(6, 20))
    assert membership_scores(few, 5, weighting="whitened").sum() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="k=6 exceeds the rank 5 of the centred fit set"):
        membership_scores(few, 6, weighting="whitened")
    k, _, _ = select_membership(few, np.arange(6), np.array([1, 0, 1, 0, 1, 0], bool), weighting="whitened")
    assert k <= 5


def test_labelled_rows_may_be_a_boolean_mask():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 5))
    mask = np.zeros(40, bool)
    mask[::2] = True
    correct = rng.random(20) < 0.5
    assert select_membership(x, mask, correct) == select_membership(x, np.flatnonzero(mask), correct)
    with pytest.raises(ValueError, match=r"boolean mask of shape \(20,\): it must have one entry per row of x"):
        select_membership(x, mask[:20], correct[:10])
    assert select_membership(x, mask, correct.astype(int)) == select_membership(x, mask, correct)
    for bad in (2, 0.5):  # read as True
        with pytest.raises(ValueError, match="correct must hold 0/1"):
            select_membership(x, mask, np.where(correct, bad, 0))


def test_selection_finds_the_separating_direction_and_its_orientation():
    rng = np.random.default_rng(1)
    wrong = rng.random(400) < 0.3
    x = rng.normal(size=(400, 8)) * 0.3
    x[:, 0] += np.where(wrong, 3.0, 0.0)  # hallucinations lie far out along the top direction
    k, sign, a = select_membership(x, np.arange(100), ~wrong[:100], ks=(1, 2, 3))
    assert sign == -1.0 and a > 0.9  # a high score means "wrong": flipped to rank "right" first
    zeta = membership_scores(x, k)
    assert auroc(sign * zeta[100:], ~wrong[100:]) > 0.9
    # the default candidates stop at min(N, D) = 6 here (D < 10), and numpy ints are ints
    assert select_membership(x[:, :6], np.arange(100), ~wrong[:100]) == max(
        ((k, s, auroc(s * membership_scores(x[:, :6], k)[:100], ~wrong[:100])) for k in range(1, 7) for s in (1.0, -1.0)),
        key=lambda t: t[2])
    np.testing.assert_array_equal(membership_scores(x, np.int64(2)), membership_scores(x, 2))


def test_bad_inputs_name_the_argument():
    x = np.zeros((5, 3))
    with pytest.raises(ValueError, match="k=4"):
        membership_scores(x, 4)
    with pytest.raises(ValueError, match="weighting"):
        membership_scores(x + np.eye(5, 3), 1, weighting="sigma")
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        membership_scores(x, 1, fit=np.zeros((5, 2)))

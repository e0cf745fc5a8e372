"""The emotion-circuit steering claim in miniature (`trainers.steering_demo`): a tiny model
trained on the polarity task, its class direction steers negative prompts to "pos", and
ablating the direction removes the effect.

The bounds are the lowest values measured over training seeds 0-2 in this suite's setting
(XLA optimisation level 0; docs/interp.md), with a little slack. A single trained model is a
draw: at this size, runs that differ only in float rounding end in different networks (the
dose that flips 90% of the prompts was 16, 24 and 12 for seeds 0-2), so the test asserts what
held for every seed, not one run's numbers."""

import pytest

from jaxlm.data.polarity import NEGATIVE, NEUTRAL, POSITIVE, Polarity
from jaxlm.data.tasks import TASKS, make_task
from trainers import steering_demo


def test_polarity_task():
    assert TASKS["polarity"] is Polarity  # importing the module registers it
    task = make_task("polarity", max_filler=2)
    for i in range(50):
        ex = task.example(i)
        words = ex["prompt"][:-2].split()
        cues = [w for w in words if w not in NEUTRAL]
        assert ex["prompt"].endswith(" =") and cues
        assert all(w in (POSITIVE, NEGATIVE)[ex["label"]] for w in cues)
        assert ex["variants"][ex["label"]] == ex["prompt"]
        other = ex["variants"][1 - ex["label"]].split()
        assert [w for w in other if w in NEUTRAL] == [w for w in words if w in NEUTRAL]  # same skeleton
        assert task.verify(ex, ex["completion"]) == 1.0 and task.verify(ex, task.labels[1 - ex["label"]]) == 0.0
    assert task.chance_accuracy() == 0.5
    with pytest.raises(ValueError, match="polarity.min_cues=0, max_cues=2 are invalid"):
        Polarity(min_cues=0)
    spaced = Polarity(labels=("pos", "neg "))  # labels may carry spaces: verify reads them stripped
    for ex in (spaced.example(i) for i in range(20)):
        assert spaced.verify(ex, ex["completion"]) == 1.0 and spaced.verify(ex, spaced.labels[1 - ex["label"]]) == 0.0
    with pytest.raises(ValueError, match="polarity.labels=.*different first characters"):
        Polarity(labels=("yes", "yeah"))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model = steering_demo.train_model(tmp_path_factory.mktemp("polarity"))
    return steering_demo.run(model, layer=0, doses=steering_demo.DEFAULT_DOSES)


@pytest.mark.slow
def test_the_model_solves_the_task(result):
    assert result.base_accuracy >= 0.99  # measured 1.000 for seeds 0-2 on 256 held-out prompts
    assert result.n_negative >= 100


@pytest.mark.slow
def test_steering_along_v_pos_flips_negative_prompts(result):
    assert result.flip["none"][0] <= 0.02  # unsteered: measured 0.000
    assert result.chosen_dose is not None and result.chosen_dose <= 24  # measured 16, 24, 12
    i = result.doses.index(result.chosen_dose)
    assert result.flip["none"][i] >= 0.9  # the chosen dose's definition
    assert result.argmax_flip[i] >= 0.85  # "p" is the full-vocabulary argmax: measured 0.955-1.000
    starts, exact = result.generated["prompt_only"]
    assert exact >= 0.85  # the greedy completion is exactly "pos": measured 0.955-0.973


@pytest.mark.slow
def test_ablating_the_direction_removes_the_effect(result):
    for mode in ("same", "next"):
        assert max(result.flip[mode]) <= 0.05, mode  # measured 0.000 at every dose, seeds 0-2
    # the unsteered model still classifies with the direction ablated
    assert result.ablated_accuracy["same"] >= 0.95  # measured 1.000, 1.000, 1.000
    assert result.ablated_accuracy["next"] >= 0.8  # measured 0.863, 0.953, 0.863

"""The emotion-circuit steering claim in miniature (`trainers.steering_demo`): a tiny
model trained on the polarity task, its class direction steers negative prompts to "pos",
and ablating the direction removes the effect. The thresholds are the measured values of
this seeded run (docs/interp.md) with a little slack, not a goal the run was tuned to."""

import pytest

from jaxlm.data.polarity import NEGATIVE, NEUTRAL, POSITIVE, Polarity
from jaxlm.data.tasks import TASKS, make_task
from trainers import steering_demo

DOSE = 16.0  # the smallest dose of DEFAULT_DOSES with a flip rate >= 0.9 (measured 0.973)


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
    with pytest.raises(ValueError, match="polarity.labels=.*different first characters"):
        Polarity(labels=("yes", "yeah"))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model = steering_demo.train_model(tmp_path_factory.mktemp("polarity"))
    return steering_demo.run(model, layer=0, doses=(0.0, DOSE))


@pytest.mark.slow
def test_the_model_solves_the_task(result):
    assert result.base_accuracy >= 0.99  # measured 1.000 on 256 held-out prompts
    assert result.n_negative >= 100


@pytest.mark.slow
def test_steering_along_v_pos_flips_negative_prompts(result):
    assert result.flip["none"][0] <= 0.02  # unsteered: measured 0.000
    assert result.chosen_dose == DOSE
    assert result.flip["none"][1] >= 0.9  # measured 0.973
    assert result.argmax_flip[1] >= 0.9  # "p" is the full-vocabulary argmax, not just above "n"
    starts, exact = result.generated["prompt_only"]
    assert exact >= 0.9  # measured 0.973: the greedy completion is exactly "pos"


@pytest.mark.slow
def test_ablating_the_direction_removes_the_effect(result):
    for mode in ("same", "next"):
        assert max(result.flip[mode]) <= 0.05, mode  # measured 0.000 at both doses
    # the unsteered model still solves the task with the direction ablated
    assert result.ablated_accuracy["same"] >= 0.95  # measured 0.988
    assert result.ablated_accuracy["next"] >= 0.93  # measured 0.965

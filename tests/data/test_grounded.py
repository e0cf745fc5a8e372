"""GridQA: the answer is the asked shape's colour read off the prompt, the evidence its cell;
the shortcut biases training problems only; the teacher's evidence is wrong at the asked rate."""

import numpy as np
import pytest

from jaxlm.data.grounded import GridLookup, GridQA
from jaxlm.data.tasks import TASKS


def read_grid(prompt: str) -> tuple[dict[str, tuple[int, str]], str]:
    """``{shape: (cell, colour)}`` and the asked shape, parsed from the prompt text."""
    cells, question = prompt.rsplit(" ?", 1)
    grid = {tok[2]: (int(tok[0]), tok[1]) for tok in cells.split(" ")}
    return grid, question.rstrip("=")


@pytest.mark.parametrize("split", ["train", "eval"])
def test_answer_and_evidence_are_read_off_the_prompt(split):
    task = GridQA(evidence_noise=0.0)
    for i in range(300):
        e = task.example(i, split)
        grid, asked = read_grid(e["prompt"])
        cell, colour = grid[asked]
        assert len(grid) == task.n_cells and e["completion"] == f"<evidence>{cell}</evidence>{colour}"
        assert task.verify(e, e["completion"]) == 1.0 and task.evidence_correct(e, e["completion"])
        wrong = next(c for c in task.colors if c != colour)
        assert task.verify(e, f"<evidence>{cell}</evidence>{wrong}") == 0.0
        assert task.verify(e, colour) == 0.0  # no evidence: not the format


def test_shortcut_biases_training_problems_and_teacher_evidence_is_noisy():
    task = GridQA(shortcut=0.6, evidence_noise=0.5)
    train = [task.example(i, "train") for i in range(3000)]
    held = [task.example(i, "eval") for i in range(3000)]
    r_train = np.mean([e["answer"] == "r" for e in train])
    r_held = np.mean([e["answer"] == "r" for e in held])
    # 0.6 + 0.4 / 4 = 0.7, less the problems whose biased form would hash to the held-out split
    assert 0.6 < r_train < 0.72 and abs(r_held - 0.25) < 0.03
    grounded = np.mean([task.evidence_correct(e, e["completion"]) for e in train])
    assert abs(grounded - 0.5) < 0.03
    assert all(task.verify(e, e["completion"]) == 1.0 for e in train)  # the teacher's answers are right
    assert all(task.evidence_correct(e, e["completion"]) for e in held)
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in held}
    assert "grid_qa" in TASKS


def test_parse():
    assert GridQA().parse("<evidence>3</evidence> g") == ("3", "g")
    assert GridQA().parse("g") == (None, "g")
    short = GridQA(evidence_open="[", evidence_close="]", evidence_noise=0.0)
    assert short.parse("[3]g") == ("3", "g") and short.parse("<evidence>3</evidence>g") == (None, "<evidence>3</evidence>g")
    e = short.example(0, "eval")
    assert e["completion"] == f"[{e['evidence']}]{e['answer']}" and short.verify(e, e["completion"]) == 1.0
    # the markers change the completion only: the same problems, in the same splits
    assert e["prompt"] == GridQA(evidence_noise=0.0).example(0, "eval")["prompt"]


@pytest.mark.parametrize("kw, field", [
    (dict(n_cells=1), "n_cells"), (dict(n_cells=7), "shapes"), (dict(shapes="SSTCHX"), "shapes"),
    (dict(colors="r"), "colors"), (dict(colors="rS"), "colors"), (dict(shortcut=1.2), "shortcut"),
    (dict(evidence_noise=-0.1), "evidence_noise"), (dict(evidence_open=""), "evidence_open"),
    (dict(evidence_open="]", evidence_close="]"), "evidence_open"), (dict(evidence_close="<1>"), "evidence_open"),
])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"grid_qa.{field}"):
        GridQA(**kw)


def test_lookup_queries_are_read_off_the_grid():
    """Every GridLookup completion holds each "which cell holds shape S" and "what colour is
    cell i" query once, answered from the prompt, in an order that varies between grids."""
    task = GridLookup()
    orders = set()
    for i in range(200):
        e = task.example(i, "train")
        cells = e["prompt"].split()
        grid = {int(tok[0]): (tok[1], tok[2]) for tok in cells}
        assert len(grid) == task.n_cells and e["prompt"].endswith(" ")
        queries = e["completion"].split(" ")
        expected = {f"?{shape}={cell}" for cell, (_, shape) in grid.items()}
        expected |= {f"#{cell}={colour}" for cell, (colour, _) in grid.items()}
        assert sorted(queries) == sorted(expected)
        orders.add(tuple(q[0] for q in queries))
        assert task.verify(e, e["completion"]) == 1.0 and task.verify(e, " ".join(reversed(queries))) == 0.0
    assert len(orders) > 100
    assert "grid_lookup" in TASKS and task.chance_accuracy() == 0.0


def test_lookup_in_evidence_form_writes_cells_as_grid_qa_evidence():
    """``query_form="evidence"``: the same queries with the cell in GridQA's markers, so that a
    GridQA completion is a shape query then a colour read; `first_query` splits off each
    kind's answer."""
    plain, ev = GridLookup(), GridLookup(query_form="evidence", evidence_open="[", evidence_close="]")
    kinds = set()
    for i in range(50):
        p, e = plain.example(i, "train"), ev.example(i, "train")
        assert p["prompt"] == e["prompt"]
        grid = {int(tok[0]): (tok[1], tok[2]) for tok in e["prompt"].split()}
        expected = {f"?{shape}=[{cell}]" for cell, (_, shape) in grid.items()}
        expected |= {f"#[{cell}]{colour}" for cell, (colour, _) in grid.items()}
        assert sorted(e["completion"].split(" ")) == sorted(expected)
        for task, ex in ((plain, p), (ev, e)):
            prefix, answer, kind = task.first_query(ex)
            query = ex["completion"].split(" ")[0]
            assert (prefix + answer).endswith(query) or (prefix + answer + "]").endswith(query)
            cell = int(answer) if kind == "shape_to_cell" else None
            if kind == "shape_to_cell":
                assert grid[cell][1] == query[1]
            else:
                assert answer == grid[int(query.strip("#[]=")[0])][0]
            kinds.add(kind)
    assert kinds == {"shape_to_cell", "cell_to_colour"}
    qa = GridQA(evidence_open="[", evidence_close="]", evidence_noise=0.0).example(3, "eval")
    cell, colour = qa["evidence"], qa["answer"]
    assert qa["completion"] == f"[{cell}]" + colour  # = the shape query's cell, then the colour read's tail
    with pytest.raises(ValueError, match="grid_lookup.query_form"):
        GridLookup(query_form="long")


def test_lookup_never_trains_on_a_held_out_grid_qa_grid():
    """A grid space small enough (6 orders x 8 colourings) that every grid is drawn: each grid
    behind a held-out GridQA problem is held out of GridLookup's training set too."""
    kw = dict(n_cells=3, shapes="STC", colors="rg")
    qa, lookup = GridQA(**kw), GridLookup(**kw)
    held = {qa.example(i, "eval")["prompt"].rsplit(" ?", 1)[0] for i in range(400)}
    train = {lookup.example(i, "train")["prompt"].strip() for i in range(400)}
    evals = {lookup.example(i, "eval")["prompt"].strip() for i in range(400)}
    assert len(train | evals) == 48 and held and train
    assert not held & train and held <= evals and not train & evals

"""Synthetic tasks: deterministic, held-out splits disjoint, verifiers accept every reference
and reject wrong or unsafe answers."""

import collections
import itertools

import numpy as np
import pytest

from jaxlm.data.tasks import (
    TASKS,
    Arithmetic,
    Countdown,
    Extraction,
    MarkovText,
    Sorting,
    SumTrace,
    make_task,
)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_references_verify_and_splits_are_disjoint(name):
    task = make_task(name)
    train = [task.example(i, "train") for i in range(300)]
    held = [task.example(i, "eval") for i in range(100)]
    assert all(task.verify(e, e["completion"]) == 1.0 for e in train + held)
    assert all(task.verify(e, e["completion"] + "0") == 0.0 for e in train[:50])
    key = lambda e: (e["prompt"], e["completion"], e.get("condition"))
    assert not {key(e) for e in train} & {key(e) for e in held}
    assert task.example(7, "train") == task.example(7, "train")  # random access, deterministic
    assert make_task(name, seed=1).example(7, "train") != task.example(7, "train")


def test_arithmetic_answers():
    task = Arithmetic(digits=3, ops=("+", "-", "*"))
    for i in range(200):
        e = task.example(i)
        assert int(e["completion"]) == eval(e["prompt"][:-1])  # noqa: S307 - test-only reference
    assert Arithmetic(digits=2).chance_accuracy() == pytest.approx(1 / 199)


def test_countdown_verifier_is_strict_and_safe():
    task = Countdown()
    e = {"numbers": [3, 7, 25], "target": 46}
    assert task.verify(e, "25+3*7") == 1.0
    assert task.verify(e, "3*7+25") == 1.0           # any valid solution
    assert task.verify(e, "25+21") == 0.0            # 21 is not given
    assert task.verify(e, "25+3*7+3-3") == 0.0       # 3 used three times
    assert task.verify(e, "(25+3)*7") == 0.0         # wrong value
    assert task.verify(e, "__import__('os').system('true')") == 0.0
    assert task.verify(e, "25+3*7; 1") == 0.0
    assert task.verify(e, "2**5") == 0.0
    assert task.verify({"numbers": [3, 7, 25], "target": 46}, "0x19+3*7") == 0.0  # decimal literals only
    assert task.verify({"numbers": [3, 7, 25], "target": 46}, "2_5+3*7") == 0.0
    assert task.verify(e, "1+" * 200_000 + "1") == 0.0  # too deep for the parser: wrong, not a crash
    assert task.verify(e, "-" * 5000 + "1") == 0.0
    # the split is the problem's (its numbers as a multiset, and the target), not the reference
    # expression's nor the order the numbers are listed in (18% of held-out problems were
    # trained with their numbers in another order)
    def problem(ex):
        return tuple(sorted(ex["numbers"])), ex["target"]

    held = {problem(task.example(i, "eval")) for i in range(1000)}
    assert not held & {problem(task.example(i, "train")) for i in range(5000)}


def test_sorting_and_bad_options():
    assert Sorting(length=3).verify({"values": [3, 1, 2]}, " 1 2 3 ") == 1.0
    with pytest.raises(ValueError, match="sorting.separator='1' must be a str without digits"):
        Sorting(separator="1")  # "sort 181910:" cannot be read back
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"Arithmetic.seed=.* must be an int >= 0"):
            Arithmetic(seed=bad)
    with pytest.raises(ValueError, match="eval_fraction='0.1'"):
        Arithmetic(eval_fraction="0.1")
    from jaxlm.data.facts import FactWorld
    with pytest.raises(ValueError, match="split='test' is invalid"):  # it returned training rows
        FactWorld().example(0, "test")
    # counts that are not ints failed later without the field's name (or, n_labels=2.5, silently)
    from jaxlm.data.audiovisual import AVTaskConfig
    from jaxlm.data.conditioned import ConditionedDigits
    from jaxlm.data.graphs import GraphLabels
    for make, match in ((lambda: GraphLabels(n_nodes=5.5), "graph_labels.n_nodes=5.5 must be an int"),
                        (lambda: GraphLabels(n_labels=2.5), "graph_labels.n_labels=2.5 must be an int"),
                        (lambda: ConditionedDigits(n_digits=0), "conditioned_digits.n_digits=0 must be an int >= 1"),
                        (lambda: ConditionedDigits(conditions=()), "conditions is empty"),
                        (lambda: ConditionedDigits(condition_in="none"), "condition_in='none' gives the model no condition"),
                        (lambda: AVTaskConfig(n_labels=2.5), "AVTaskConfig.n_labels=2.5 must be an int")):
        with pytest.raises(ValueError, match=match):
            make()
    ConditionedDigits(conditions=("copy",), held_out=(), condition_in="none")  # the one "none" task
    with pytest.raises(ValueError, match="arithmetic.digits=0 must be an int in"):
        Arithmetic(digits=0)
    with pytest.raises(ValueError, match=r"arithmetic.ops=\('/',\) is invalid"):
        Arithmetic(ops=("/",))
    with pytest.raises(ValueError, match=r"task 'sorting' has no option\(s\) \['digits'\]"):
        make_task("sorting", digits=3)
    with pytest.raises(KeyError, match=r"unknown task 'arithmetc' \(did you mean \['arithmetic'\]\?\)"):
        TASKS["arithmetc"]


def test_sorting_without_separator_is_one_byte_per_item():
    task = Sorting(length=6, max_value=9, separator="")
    for i in range(20):
        e = task.example(i, "eval")
        assert e["prompt"] == "sort " + "".join(map(str, e["values"])) + ":"
        assert e["completion"] == "".join(map(str, sorted(e["values"]))) and len(e["completion"]) == 6
        spaced = " ".join(e["completion"])
        assert task.verify(e, e["completion"]) == 1.0 and task.verify(e, spaced) == 0.0
    with pytest.raises(ValueError, match="separator='' needs single digits"):
        Sorting(separator="")


def test_choice_accepts_every_listed_word_and_keeps_prompts_in_one_split():
    from jaxlm.data.tasks import Choice
    task = Choice(words=3, length=4, letters="abcd")
    train_prompts = {task.example(i, "train")["prompt"] for i in range(400)}
    answers = {}
    for i in range(400):
        e = task.example(i, "eval")
        assert e["prompt"] not in train_prompts
        words = e["prompt"][len("pick "):-1].split(" ")
        assert words == e["words"] and len(set(words)) == 3 and all(len(w) == 4 and set(w) <= set("abcd") for w in words)
        assert e["completion"] in words
        assert all(task.verify(e, w) == 1.0 for w in words) and task.verify(e, "abcx") == 0.0
        answers[words.index(e["completion"])] = answers.get(words.index(e["completion"]), 0) + 1
    assert min(answers.values()) > 100  # the answer is drawn uniformly among the words
    with pytest.raises(ValueError, match="choice.letters"):
        Choice(letters="aa")
    with pytest.raises(ValueError, match="choice.words"):
        Choice(words=1)


def test_prefix_sums_are_running_sums_mod_the_modulus():
    from jaxlm.data.tasks import PrefixSums
    assert PrefixSums().answer([3, 8, 5, 6]) == "3162"  # 3, 11, 16, 22 mod 10
    parity = PrefixSums(length=6, modulus=2)
    assert parity.answer([1, 0, 1, 1, 0, 1]) == "110110"
    for modulus in (2, 3, 10):
        task = PrefixSums(length=12, modulus=modulus)
        for i in range(50):
            e = task.example(i, "eval")
            digits = [int(c) for c in e["prompt"][len("sums "):-1]]
            assert digits == e["values"] and len(digits) == 12 and max(digits) < modulus
            running, expected = 0, ""
            for d in digits:  # the definition, one step at a time
                running = (running + d) % modulus
                expected += str(running)
            assert e["completion"] == expected and task.verify(e, " " + expected + "\n") == 1.0
            wrong = expected[:-1] + str((int(expected[-1]) + 1) % modulus)
            assert task.verify(e, wrong) == 0.0 and task.verify(e, expected[:-1]) == 0.0
    assert PrefixSums(length=4, modulus=2).chance_accuracy() == 1 / 16
    for bad in (dict(modulus=1), dict(modulus=11), dict(length=0), dict(length=True)):
        with pytest.raises(ValueError, match="prefix_sums." + next(iter(bad))):
            PrefixSums(**bad)


def test_pointer_walk_follows_the_listed_table_from_the_start():
    from jaxlm.data.tasks import PointerWalk
    task = PointerWalk(symbols=3, hops=3)
    assert task.answer([2, 0, 1], 0) == "210"  # f(0) = 2, f(2) = 1, f(1) = 0
    for symbols, hops in ((8, 8), (5, 12), (10, 3)):
        task = PointerWalk(symbols=symbols, hops=hops)
        for i in range(50):
            e = task.example(i, "train")
            head, start = e["prompt"][len("walk "):-1].split(" from ")
            pairs = head.split(" ")
            table = {int(p[0]): int(p[1]) for p in pairs}  # parsed from the text, not the stored field
            assert sorted(table) == list(range(symbols)) and sorted(table.values()) == list(range(symbols))
            x, seen = int(start), []
            for _ in range(symbols):  # one cycle through every symbol
                x = table[x]
                seen.append(x)
            assert sorted(seen) == list(range(symbols)) and x == int(start)
            x, expected = int(start), ""
            for _ in range(hops):
                x = table[x]
                expected += str(x)
            assert e["completion"] == expected and task.verify(e, expected + " ") == 1.0
            assert task.verify(e, expected[:-1] + str((x + 1) % symbols)) == 0.0
    function = PointerWalk(symbols=6, hops=8, one_cycle=False)
    images = set()
    for i in range(50):
        e = function.example(i, "train")
        head, start = e["prompt"][len("walk "):-1].split(" from ")
        table = {int(p[0]): int(p[1]) for p in head.split(" ")}
        assert sorted(table) == list(range(6))
        images.add(len(set(table.values())))
        x, expected = int(start), ""
        for _ in range(8):
            x = table[x]
            expected += str(x)
        assert e["completion"] == expected and function.verify(e, expected) == 1.0
    assert min(images) < 6  # a function, not always a permutation
    assert PointerWalk(symbols=4, hops=2).chance_accuracy() == 1 / 16
    for bad in (dict(symbols=1), dict(symbols=11), dict(hops=0), dict(one_cycle=1)):
        with pytest.raises(ValueError, match="pointer_walk." + next(iter(bad))):
            PointerWalk(**bad)


def test_carry_slip_is_a_flawed_teacher_on_train_demonstrations_only():
    """``carry_slip``: train completions drop the ones carry with that probability; eval
    completions, ``answer`` and `verify` stay correct; other problems are untouched."""
    task = Arithmetic(digits=2, carry_slip=0.6)
    clean = Arithmetic(digits=2)
    train = [task.example(i, "train") for i in range(3000)]
    carry = [e for e in train if e["operands"][0] % 10 + e["operands"][1] % 10 >= 10]
    slipped = [e for e in carry if e["completion"] != str(e["answer"])]
    assert abs(len(slipped) / len(carry) - 0.6) < 0.04  # binomial sd ~0.014 at n ~1350
    assert all(e["completion"] == str(e["answer"] - 10) for e in slipped)  # 57+68= -> "115"
    assert all(e["completion"] == str(e["answer"]) for e in train if e not in carry)
    assert all(task.verify(e, str(e["answer"])) == 1.0 and task.verify(e, e["completion"]) == 0.0 for e in slipped)
    assert [task.example(i, "eval") for i in range(200)] == [clean.example(i, "eval") for i in range(200)]
    assert [e["prompt"] for e in train[:200]] == [clean.example(i, "train")["prompt"] for i in range(200)]
    with pytest.raises(ValueError, match="carry_slip"):
        Arithmetic(carry_slip=1.5)


@pytest.mark.parametrize("separator", ["", " "])
def test_sorting_orders_against_python_sorted(separator):
    fixed = Sorting(length=5, max_value=9, separator=separator)
    down = Sorting(length=5, max_value=9, separator=separator, order="descending")
    either = Sorting(length=5, max_value=9, separator=separator, order="either")
    seen = set()
    for i in range(60):
        e = either.example(i, "train")
        # the same lists as the ascending task, in the same splits (by the list alone)
        assert e["values"] == fixed.example(i, "train")["values"]
        assert either.example(i, "eval")["values"] == fixed.example(i, "eval")["values"]
        up = separator.join(str(v) for v in sorted(e["values"]))
        dn = separator.join(str(v) for v in sorted(e["values"], reverse=True))
        d = down.example(i, "train")
        assert d["completion"] == separator.join(str(v) for v in sorted(d["values"], reverse=True))
        assert e["completion"] in (up, dn)
        seen.add(e["completion"] == up)
        assert either.verify(e, up) == either.verify(e, dn) == 1.0
        assert fixed.verify(e, dn) == float(up == dn) and down.verify(e, up) == float(up == dn)
        if up != dn:
            mixed = up[: len(up) // 2] + dn[len(dn) // 2:]
            assert either.verify(e, mixed) == float(mixed in (up, dn))
    assert seen == {True, False}  # both orders drawn
    held_out = {either.example(i, "eval")["prompt"] for i in range(300)}
    assert not held_out & {either.example(i, "train")["prompt"] for i in range(3000)}
    # chance: guessing uniformly among the orderings of the given list, exact over every list
    for length, max_value in ((3, 3), (4, 2), (2, 5)):
        m = max_value + 1
        lists = list(itertools.product(range(m), repeat=length))
        for order, accepted in (("ascending", lambda xs: 1), ("either", lambda xs: len({xs, xs[::-1]}))):
            want = np.mean([accepted(tuple(sorted(xs))) / len(set(itertools.permutations(xs))) for xs in lists])
            got = Sorting(length=length, max_value=max_value, order=order).chance_accuracy()
            assert got == pytest.approx(want, rel=1e-12), (length, max_value, order)
    with pytest.raises(ValueError, match=r"sorting.order='up' must be one of \('ascending', 'descending', 'either'\)"):
        Sorting(order="up")


def test_markov_text_successor_frequencies_follow_the_zipf_exponent():
    """Successor frequencies by rank match ``r ** -zipf`` normalised over the fanout (the
    definition), counted over drawn sentences; words are the tokenizer-ready vocabulary."""
    from collections import Counter, defaultdict
    from itertools import pairwise

    task = MarkovText(n_words=8, fanout=4, zipf=2.0)
    vocab = set(task.vocabulary())
    follows = defaultdict(Counter)
    for i in range(3000):
        words = task.example(i)["completion"].rstrip(".").split(" ")
        assert set(words) <= vocab
        for a, b in pairwise(words):
            follows[a][b] += 1
    ranks = np.zeros(4)
    for counts in follows.values():
        assert len(counts) <= 4
        freq = np.array(sorted(counts.values(), reverse=True) + [0] * (4 - len(counts)), float)
        ranks += freq
    want = np.arange(1, 5) ** -2.0
    np.testing.assert_allclose(ranks / ranks.sum(), want / want.sum(), atol=0.01)
    with pytest.raises(ValueError, match=r"MarkovText\.zipf=-1\.0 must be a number >= 0"):
        MarkovText(zipf=-1.0)


def test_sum_trace_adds_in_any_order_and_verifies_the_final_number():
    task = SumTrace(count=3, digits=2)
    firsts = collections.Counter()
    train_prompts = {task.example(i, "train")["prompt"] for i in range(300)}
    for i in range(300):
        e = task.example(i, "eval")
        assert e["prompt"] not in train_prompts
        xs = [int(t) for t in e["prompt"].removeprefix("sum ").removesuffix(":").split()]
        assert xs == e["values"] and len(xs) == 3 and all(0 <= x < 100 for x in xs)
        steps, final = e["completion"].split(";")
        added, total = [], None
        for step in steps.split(","):  # each step "a+b=c" with c = a + b, chained
            lhs, rhs = step.split("=")
            a, b = map(int, lhs.split("+"))
            assert int(rhs) == a + b
            if total is None:
                added += [a, b]
            else:
                assert a == total
                added.append(b)
            total = int(rhs)
        assert sorted(added) == sorted(xs) and int(final) == total == sum(xs)
        firsts[xs.index(added[0])] += 1
        assert task.verify(e, e["completion"]) == 1.0 and task.verify(e, f"junk;{sum(xs)}") == 1.0
        assert task.verify(e, f"{steps};{sum(xs) + 1}") == 0.0 and task.verify(e, str(sum(xs))) == 0.0
        accepted = task.accepted_completions(e["prompt"])
        assert e["completion"] in accepted and len(accepted) == len(set(itertools.permutations(xs)))
    assert min(firsts.values()) > 70  # the order is uniform: each number leads about a third of the traces
    with pytest.raises(ValueError, match="sum_trace.count"):
        SumTrace(count=1)
    with pytest.raises(ValueError, match="sum_trace.digits"):
        SumTrace(digits=0)


def test_extraction_verifies_json_values_of_the_schemas_types():
    task = Extraction()
    e = {"answer": {"name": "Ada", "age": 1, "city": "Oslo"}}
    assert task.verify(e, '{"city": "Oslo", "name": "Ada", "age": 1}') == 1.0  # key order is free
    for wrong in ('{"name": "Ada", "age": true, "city": "Oslo"}', '{"name": "Ada", "age": 1.0, "city": "Oslo"}',
                  '{"name": "Ada", "age": 1, "city": "Oslo", "x": 0}', '[1]', "[" * 100_000, "not json"):
        assert task.verify(e, wrong) == 0.0, wrong


def test_small_eval_fractions_find_their_examples():
    """A split of share p is found within its draws (1000 draws failed 28 in 200 calls at
    p = 0.002); a fraction below the split hash's resolution is refused at the config."""
    from jaxlm.data.tasks import Arithmetic

    task = Arithmetic(digits=4, eval_fraction=0.002)
    for i in range(60):
        ex = task.example(i, "eval")
        assert task.split_of(ex) == "eval"
    assert task.split_of(Arithmetic(digits=4, eval_fraction=0.9985).example(0, "train")) == "train"
    for bad in (0.00005, 0.99999, 0.0, 1.0):
        with pytest.raises(ValueError, match=rf"Arithmetic.eval_fraction={bad!r} must be in \[0.0001, 0.9999\]"):
            Arithmetic(eval_fraction=bad)


def test_bad_task_configs_name_the_field():
    """Values numpy would only reject mid-run (low >= high, a sample larger than the population)."""
    for kwargs, match in [(dict(min_words=10, max_words=5), r"MarkovText.max_words=5 must be an int in \[10, "),
                          (dict(fanout=60), r"MarkovText.fanout=60 must be an int in \[1, 48\]"),
                          (dict(n_words=0), r"MarkovText.n_words=0 must be an int in \[1, ")]:
        with pytest.raises(ValueError, match=match):
            MarkovText(**kwargs)
    with pytest.raises(ValueError, match=r"sorting.max_value=-1 must be an int in \[0, "):
        Sorting(max_value=-1)

"""The architecture-variant experiments in miniature (docs/architectures.md), on CPU:

A. small-LM pretraining on a synthetic Markov corpus: softmax vs affine-scaled (free and
   coupled bias) vs sink attention (`configs/attn_pretrain.py`);
B. MeGan on a multi-condition digit task from a copy-trained base: hypernetwork only (base
   frozen) vs MeGan with everything trainable vs plain fine-tuning with the condition in the
   prompt; seen and held-out conditions (`configs/megan_base.py`, `configs/megan.py`);
C. Weaver (graph RoPE + graph mask) vs a plain linearised graph on neighbourhood label
   prediction (`configs/weaver_graph.py`);
D. B's three arms on compositional conditions ("reverse, add 3"; held-out pairs combine parts
   seen in other pairs; `configs/megan_compositional.py`) from a base that has the primitive
   skills with the condition in its prompt (`configs/megan_skills_base.py`), and that base
   prompted with the condition, untrained.

    python bench/architectures.py [--out runs/arch] [--scale 1.0] [--only A,B,C,D] [--seed S]

Prints markdown tables (also written to OUT/results.md), then the MeGan sections' numbers as
one JSON line (with each held-out condition's exact match apart). ``--scale`` multiplies
every step count (0.1 for a quick smoke run); ``--seed`` sets ``trainer.seed`` of every run
(initialisation and data order; the tasks' examples stay the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path


#: Numbers of the MeGan sections, printed as JSON at the end (claim tests read them).
RESULTS: dict[str, dict] = {}
#: Overrides added to every run (``--seed``).
EXTRA_OVERRIDES: list[str] = []


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _spikes(grad_norms: list[float], window: int = 20, factor: float = 3.0) -> int:
    return sum(
        1 for i in range(window, len(grad_norms))
        if grad_norms[i] > factor * statistics.median(grad_norms[i - window : i])
    )


def run(name: str, overrides: list[str]):
    from trainers.recipes import load_config
    from trainers.loop import train

    t0 = time.perf_counter()
    result = train(load_config(name, list(overrides) + EXTRA_OVERRIDES))
    return result, time.perf_counter() - t0


def evaluate(model_dir: Path, cfg_name: str, overrides: list[str]) -> dict:
    """Held-out metrics of a saved model on the data a config (with overrides) describes."""
    import jaxlm
    from flax import nnx

    from jaxlm.data.pipeline import eval_batches
    from trainers.recipes import load_config
    from trainers.evaluate import heldout_metrics
    from trainers.step import make_eval_loss

    cfg = load_config(cfg_name, overrides)
    model = jaxlm.load_checkpoint(model_dir)
    graphdef, state = nnx.split(model)
    fn = make_eval_loss(graphdef, sliding_window=model.config.sliding_window)
    out = heldout_metrics(fn, nnx.to_pure_dict(state), eval_batches(cfg.data, jaxlm.ByteTokenizer()))
    source = cfg.data.source
    if getattr(source, "eval_on", None) == "held_out" and len(source.held_out) > 1:  # each held-out condition
        out["by_condition"] = {}
        for c in source.held_out:
            data = dataclasses.replace(cfg.data, source=dataclasses.replace(source, held_out=(c,)))
            out["by_condition"][c] = heldout_metrics(fn, nnx.to_pure_dict(state),
                                                     eval_batches(data, jaxlm.ByteTokenizer()))["exact_match"]
    return out


def experiment_a(out: Path, scale: float) -> str:
    steps = max(int(300 * scale), 10)
    arms = {
        "softmax": ("softmax", ["model.attention=softmax"]),
        "affine-scaled (free bias)": ("affine_free", ["model.attention=affine_scaled", "model.affine_bias=free"]),
        "affine-scaled (coupled bias)": ("affine_coupled", ["model.attention=affine_scaled", "model.affine_bias=coupled"]),
        "sink": ("sink", ["model.attention=sink"]),
    }
    lines = ["| attention | final train loss | held-out loss | grad-norm max / median | grad-norm spikes (>3x running median) | attention entropy (nats) | first-token mass | time |",
             "|---|---|---|---|---|---|---|---|"]
    for label, (key, over) in arms.items():
        d = out / "A" / key
        result, secs = run("attn_pretrain", over + [f"trainer.out_dir={d}", f"trainer.steps={steps}",
                                                    f"trainer.eval_every={max(steps // 4, 1)}", "trainer.progress=false",
                                                    f"trainer.save_every={steps}"])
        recs = _records(d)
        train = [r for r in recs if r["kind"] == "train"]
        gn = [r["grad_norm"] for r in train]
        final = statistics.mean(r["loss"] for r in train[-5:])
        e = result.final_eval
        lines.append(
            f"| {label} | {final:.3f} | {e['loss']:.3f} | {max(gn):.2f} / {statistics.median(gn):.2f} | {_spikes(gn)} "
            f"| {e['attn_entropy']:.3f} | {e['first_token_mass']:.3f} | {secs:.0f} s |"
        )
    return f"### A. Pretraining with attention variants ({steps} steps)\n\n" + "\n".join(lines)


def experiment_b(out: Path, scale: float, config: str = "megan", section: str = "B", steps: int = 500,
                 base_config: str = "megan_base", base_steps: int = 200, prompt_baseline: bool = False,
                 title: str = "MeGan on conditioned digits", base_what: str = "copying") -> str:
    base_steps, steps = max(int(base_steps * scale), 10), max(int(steps * scale), 10)
    base_dir = out / section / "base"
    run(base_config, [f"trainer.out_dir={base_dir}", f"trainer.steps={base_steps}", "trainer.progress=false",
                      f"trainer.save_every={base_steps}"])
    arms = {
        "MeGan, hypernetwork only (base frozen)": ("hyper", []),
        "MeGan, everything trainable": ("hyper_full", ["optimizer.trainable="]),
        "fine-tuning, condition in the prompt": ("prompt_ft", ["model.mlp=swiglu", "data.source.condition_in=prompt",
                                                               "optimizer.trainable="]),
    }
    lines = ["| method | trainable params | seen conditions: exact match | held-out conditions: exact match | held-out loss (seen) | time |",
             "|---|---|---|---|---|---|"]
    for label, (key, over) in arms.items():
        d = out / section / key
        common = over + [f"init_from={base_dir / 'model'}"]
        result, secs = run(config, common + [f"trainer.out_dir={d}", f"trainer.steps={steps}", "trainer.progress=false",
                                              f"trainer.eval_every={max(steps // 2, 1)}", f"trainer.save_every={steps}"])
        held = evaluate(d / "model", config, common + ["data.source.eval_on=held_out"])
        from trainers.recipes import load_config

        cfg = load_config(config, common)
        n_train = _count_trainable(cfg)
        lines.append(f"| {label} | {n_train:,} | {result.final_eval['exact_match']:.1%} | {held['exact_match']:.1%} "
                     f"| {result.final_eval['loss']:.3f} | {secs:.0f} s |")
        RESULTS.setdefault(section, {})[key] = {"seen": result.final_eval["exact_match"], "held_out": held["exact_match"],
                                                "loss": result.final_eval["loss"]}
        if "by_condition" in held:
            RESULTS[section][key]["held_out_by_condition"] = held["by_condition"]
    if prompt_baseline:  # the base as it is, the condition written in its prompt
        prompt = ["model.mlp=swiglu", "data.source.condition_in=prompt"]
        seen = evaluate(base_dir / "model", config, prompt)
        held = evaluate(base_dir / "model", config, prompt + ["data.source.eval_on=held_out"])
        RESULTS[section]["base_prompt"] = {"seen": seen["exact_match"], "held_out": held["exact_match"],
                                           "loss": seen["loss"]}
        if "by_condition" in held:
            RESULTS[section]["base_prompt"]["held_out_by_condition"] = held["by_condition"]
        lines.append(f"| base, condition in the prompt, no training | 0 | {seen['exact_match']:.1%} "
                     f"| {held['exact_match']:.1%} | {seen['loss']:.3f} | - |")
    return (f"### {section}. {title} (base: {base_steps} steps of {base_what}; arms: {steps} steps)\n\n"
            + "\n".join(lines))


def experiment_d(out: Path, scale: float) -> str:
    """B's arms on compositional conditions (`configs/megan_compositional.py`: held-out pairs
    combine parts seen in other pairs), from a base that has the primitive skills with the
    condition in its prompt (`configs/megan_skills_base.py`)."""
    return experiment_b(out, scale, config="megan_compositional", section="D", steps=1000,
                        base_config="megan_skills_base", base_steps=600, prompt_baseline=True,
                        title="MeGan on compositional conditions", base_what="the primitive skills, condition in the prompt")


def _count_trainable(cfg) -> int:
    import re

    import numpy as np

    from jaxlm.models.params import param_shapes

    shapes = param_shapes(cfg.model)
    pattern = cfg.optimizer.trainable
    return int(sum(np.prod(s.shape) for n, s in shapes.items() if not pattern or re.search(pattern, n)))


def experiment_c(out: Path, scale: float) -> str:
    steps = max(int(500 * scale), 10)
    every = max(steps // 5, 1)
    arms = {"Weaver (graph RoPE + graph mask)": ("weaver", []),
            "plain linearised graph (causal, edge list)": ("plain", ["data.source.structure=plain", "model.rope=default"])}
    curves, lines = {}, ["| model | held-out exact match | held-out loss | time |", "|---|---|---|---|"]
    for label, (key, over) in arms.items():
        d = out / "C" / key
        result, secs = run("weaver_graph", over + [f"trainer.out_dir={d}", f"trainer.steps={steps}",
                                                   f"trainer.eval_every={every}", "trainer.progress=false",
                                                   f"trainer.save_every={steps}"])
        curves[label] = [(r["step"], r["exact_match"]) for r in _records(d) if r["kind"] == "eval"]
        lines.append(f"| {label} | {result.final_eval['exact_match']:.1%} | {result.final_eval['loss']:.3f} | {secs:.0f} s |")
    from jaxlm.data.graphs import GraphLabels

    answers = [GraphLabels().example(i, "eval")["answer"] for i in range(256)]
    majority = max(answers.count(a) for a in set(answers)) / len(answers)
    steps_row = "| step | " + " | ".join(str(s) for s, _ in next(iter(curves.values()))) + " |"
    curve_lines = [steps_row, "|---|" + "---|" * len(next(iter(curves.values())))]
    for label, pts in curves.items():
        curve_lines.append(f"| {label} | " + " | ".join(f"{v:.1%}" for _, v in pts) + " |")
    return (f"### C. Graph reasoning: Weaver vs plain linearisation ({steps} steps)\n\n" + "\n".join(lines)
            + f"\n\nMajority-class baseline: {majority:.1%}. Held-out exact match during training:\n\n"
            + "\n".join(curve_lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/arch")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--only", default="A,B,C,D")
    ap.add_argument("--seed", type=int, default=None, help="trainer.seed of every run (default: each config's)")
    args = ap.parse_args()
    if args.seed is not None:
        EXTRA_OVERRIDES.append(f"trainer.seed={args.seed}")
    out = Path(args.out)
    sections = []
    for key, fn in (("A", experiment_a), ("B", experiment_b), ("C", experiment_c), ("D", experiment_d)):
        if key in args.only.split(","):
            sections.append(fn(out, args.scale))
            print(sections[-1] + "\n", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n\n".join(sections) + "\n")
    print(json.dumps(RESULTS))


if __name__ == "__main__":
    main()

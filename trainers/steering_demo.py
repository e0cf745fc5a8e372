"""The emotion-circuit steering claim in miniature (Wang et al. 2025, "Do LLMs 'Feel'?",
arXiv 2510.11328): a class direction extracted by centred mean difference steers a model's
output class, and ablating that direction removes the effect.

A tiny byte-level model is trained on `jaxlm.data.polarity.Polarity` (cue words of one
class amid filler -> ``"pos"`` / ``"neg"``). Then:

1. ``v_pos [L, D]`` = `mean_difference_directions` of the ``hidden`` site at every layer
   (last prompt token), grouped by filler skeleton (the paper's scenario groups);
2. negative-class held-out prompts are steered with ``alpha * v_pos^(l) * RMS(h)`` at layer
   ``l``, last position only (the paper's ``scale="rms"``, ``last_k=1``), and a prompt
   *flips* when the logit of ``"p"`` beats that of ``"n"`` at the last prompt token;
3. the same runs with the direction ablated (``h - (h.u) u``), see ``ABLATIONS``.

Run ``python -m trainers.steering_demo`` for the markdown table (docs/interp.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tempfile
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlm
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.polarity import Polarity
from jaxlm.interp.directions import capture, mean_difference_directions
from jaxlm.interp.interventions import ablate, steer
from trainers.config import ExperimentConfig, OptimizerConfig, TrainerConfig
from trainers.loop import train

#: ``same``: ablate ``v^(l)`` at the steered layer ``l`` after the addition; ``next``: ablate
#: ``v^(l+1)`` at layer ``l + 1`` instead (the direction the steering must travel through).
ABLATIONS = ("none", "same", "next")
DEFAULT_DOSES = (0.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0)


def experiment_config(out_dir, *, steps: int = 250, n_layers: int = 3, lr: float = 5e-3, seed: int = 0):
    """The platform config (`trainers.loop.train`) of the tiny polarity model."""
    return ExperimentConfig(
        model=jaxlm.ModelConfig.tiny(d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64),
        data=DataConfig(source=Polarity(seed=seed), seq_len=64, batch_size=32, pack=True, eval_examples=64),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=20, min_lr_ratio=0.1),
        trainer=TrainerConfig(steps=steps, seed=seed, out_dir=str(out_dir), progress=False, log_every=50,
                              eval_generate=0, save_every=steps, async_checkpoint=False),
    )


def train_model(out_dir, **kw):
    """Train (or resume) the polarity model under ``out_dir``; returns the trained model."""
    result = train(experiment_config(out_dir, **kw))
    return jaxlm.load_checkpoint(Path(result.out_dir) / "model")


def encode_prompts(tokenizer, prompts: Sequence[str]) -> tuple[jax.Array, jax.Array]:
    """BOS + prompt, left-padded to one block: ``tokens [B, T]``, ``mask [B, T]``. Left padding
    puts every last prompt token at ``T - 1``, where ``where="last"`` steers (as in generate)."""
    ids = [tokenizer.encode(p, add_bos=True) for p in prompts]
    T = max(map(len, ids))
    tokens = np.full((len(ids), T), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(ids), T), bool)
    for b, row in enumerate(ids):
        tokens[b, T - len(row):] = row
        mask[b, T - len(row):] = True
    return jnp.asarray(tokens), jnp.asarray(mask)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_logits(graphdef, state, tokens, mask, interventions):
    return nnx.merge(graphdef, state)(tokens, mask=mask, interventions=interventions).logits[:, -1]


def next_token_logits(model, tokens, mask, interventions=()) -> np.ndarray:
    """``[B, V]`` logits of the token after each left-padded prompt (`encode_prompts`)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_last_logits(graphdef, state, tokens, mask, tuple(interventions)))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _all_logits(graphdef, state, tokens, mask, interventions):
    return nnx.merge(graphdef, state)(tokens, mask=mask, interventions=interventions).logits


def prompt_steered_completions(model, tokens, mask, make_interventions, *, max_new_tokens: int) -> list[str]:
    """Greedy completions of left-padded prompts with ``make_interventions(where)`` applied at
    the last prompt token only (``where [B, T]`` marks it), not at the generated tokens as
    ``generate(..., interventions=(steer(..., where="last"),))`` does. One fixed-shape forward
    per new token (causal, so the unfilled slots after it do not matter)."""
    tok = model.tokenizer
    B, P = tokens.shape
    seq = np.concatenate([np.asarray(tokens), np.full((B, max_new_tokens), tok.pad_id, np.int32)], axis=1)
    full_mask = jnp.concatenate([jnp.asarray(mask, bool), jnp.ones((B, max_new_tokens), bool)], axis=1)
    where = np.zeros(seq.shape, bool)
    where[:, P - 1] = True
    ivs = tuple(make_interventions(where))
    graphdef, state = nnx.split(model)
    for k in range(max_new_tokens):
        logits = _all_logits(graphdef, state, jnp.asarray(seq), full_mask, ivs)
        seq[:, P + k] = np.asarray(logits[:, P - 1 + k].argmax(-1))
    texts = []
    for row in seq[:, P:].tolist():
        end = row.index(tok.eos_id) if tok.eos_id in row else len(row)
        texts.append(tok.decode(row[:end]))
    return texts


def polarity_direction(model, task: Polarity, *, n_groups: int, site: str = "hidden") -> jax.Array:
    """``v_pos [L, D]`` at ``site`` from ``n_groups`` train skeletons, each rendered once per
    class (groups = skeletons), read at the last prompt token. A skeleton whose other-class
    rendering is a held-out prompt is skipped: the direction reads train prompts only."""
    prompts, labels, groups = [], [], []
    index = 0
    while len(set(groups)) < n_groups:
        ex = task.example(index, "train")
        index += 1
        renders = [{"prompt": text, "completion": task.labels[label]} for label, text in enumerate(ex["variants"])]
        if any(task.split_of(r) != "train" for r in renders):
            continue
        g = len(set(groups))
        for label, r in enumerate(renders):
            prompts.append(r["prompt"])
            labels.append(label)
            groups.append(g)
    tokens, mask = encode_prompts(model.tokenizer, prompts)
    acts = capture(model, tokens, mask, sites=(site,))[site]
    return mean_difference_directions(acts, np.asarray(labels), np.asarray(groups))[0]


@dataclasses.dataclass
class SteeringResult:
    layer: int  # steered layer (site "hidden", last position, rms scaling)
    n_negative: int  # negative held-out prompts steered
    base_accuracy: float  # "p" vs "n" logit on all held-out prompts, unsteered
    ablated_accuracy: dict[str, float]  # ablation -> the same accuracy, unsteered, direction ablated
    doses: list[float]
    flip: dict[str, list[float]]  # ablation -> per dose: fraction with logit "p" > logit "n"
    argmax_flip: list[float]  # per dose, no ablation: fraction whose full-vocabulary argmax is "p"
    chosen_dose: float | None  # smallest dose whose flip rate (no ablation) >= target
    # at chosen_dose, greedy completions of the negative prompts: mode -> (fraction starting with
    # "pos", fraction equal to "pos"); "every_token": generate() steering the last prompt token and
    # every new token (the paper's last_k=1 hook); "prompt_only": the last prompt token only
    generated: dict[str, tuple[float, float]] | None

    def table(self) -> str:
        rows = ["| dose alpha | flip rate | argmax is 'p' | flip rate, ablate same layer | flip rate, ablate next layer |",
                "|---:|---:|---:|---:|---:|"]
        for i, a in enumerate(self.doses):
            f = self.flip
            rows.append(f"| {a:g} | {f['none'][i]:.3f} | {self.argmax_flip[i]:.3f} | {f['same'][i]:.3f} | {f['next'][i]:.3f} |")
        return "\n".join(rows)


def run(model, *, layer: int = 0, doses: Sequence[float] = DEFAULT_DOSES, n_groups: int = 64,
        n_eval: int = 256, target: float = 0.9, generate_check: bool = True, seed: int = 0) -> SteeringResult:
    """Steer the negative ones of ``n_eval`` held-out prompts toward ``pos`` at ``layer`` with
    each dose, alone and with the direction ablated (``ABLATIONS``); see the module docstring."""
    c = model.config
    L = c.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L - 1:
        raise ValueError(f"layer={layer!r} is invalid: must be an int in [0, {L - 1}) (a next layer must exist)")
    task = Polarity(seed=seed)
    tok = model.tokenizer
    p_id, n_id = (tok.encode(label)[0] for label in task.labels)
    v = polarity_direction(model, task, n_groups=n_groups)  # [L, D]: v_pos at every layer
    held = [task.example(i, "eval") for i in range(n_eval)]
    tokens, mask = encode_prompts(tok, [e["prompt"] for e in held])
    is_pos = np.asarray([e["label"] == 0 for e in held])
    neg_tokens, neg_mask = tokens[~is_pos], mask[~is_pos]
    ablations = {
        "none": (),
        "same": (ablate("hidden", v, n_layers=L, layers=[layer], where="last"),),
        "next": (ablate("hidden", v, n_layers=L, layers=[layer + 1], where="last"),),
    }

    def accuracy(ivs):
        logits = next_token_logits(model, tokens, mask, ivs)
        return float(np.mean((logits[:, p_id] > logits[:, n_id]) == is_pos))

    flip = {m: [] for m in ABLATIONS}
    argmax_flip = []
    for alpha in doses:
        push = steer("hidden", v, alpha=alpha, n_layers=L, layers=[layer], where="last", rms_scale=True)
        for m in ABLATIONS:
            logits = next_token_logits(model, neg_tokens, neg_mask, (push, *ablations[m]))
            flip[m].append(float(np.mean(logits[:, p_id] > logits[:, n_id])))
            if m == "none":
                argmax_flip.append(float(np.mean(logits.argmax(-1) == p_id)))
    hits = [a for a, f in zip(doses, flip["none"]) if f >= target]
    chosen = min(hits) if hits else None
    generated = None
    if generate_check and chosen is not None:
        def push_at(where):
            return (steer("hidden", v, alpha=chosen, n_layers=L, layers=[layer], where=where, rms_scale=True),)

        prompts = [e["prompt"] for e in held if e["label"] == 1]
        every = jaxlm.generate(model, prompts, max_new_tokens=4, temperature=0.0, interventions=push_at("last")).texts
        prompt_only = prompt_steered_completions(model, neg_tokens, neg_mask, push_at, max_new_tokens=4)
        pos = task.labels[0]
        generated = {
            name: (float(np.mean([t.startswith(pos) for t in texts])), float(np.mean([t == pos for t in texts])))
            for name, texts in (("every_token", every), ("prompt_only", prompt_only))
        }
    return SteeringResult(
        layer=layer, n_negative=int((~is_pos).sum()), base_accuracy=accuracy(()),
        ablated_accuracy={m: accuracy(ablations[m]) for m in ("same", "next")}, doses=[float(a) for a in doses],
        flip=flip, argmax_flip=argmax_flip, chosen_dose=chosen, generated=generated,
    )


def main(argv: Sequence[str] | None = None) -> SteeringResult:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out_dir", default=None, help="run directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="steering_demo_")
    t0 = time.time()
    model = train_model(out_dir, steps=args.steps, seed=args.seed)
    t1 = time.time()
    res = run(model, layer=args.layer, seed=args.seed)
    print(f"trained in {t1 - t0:.0f} s ({out_dir}); analysis {time.time() - t1:.0f} s")
    print(f"base accuracy {res.base_accuracy:.3f}; {res.n_negative} negative prompts steered at layer {res.layer} "
          f"(site hidden, last position, rms scaling)\n")
    print(res.table())
    print("\nunsteered accuracy with the direction ablated: "
          + ", ".join(f"{m} layer {a:.3f}" for m, a in res.ablated_accuracy.items()))
    if res.chosen_dose is None:
        print("no dose reached a flip rate of 0.9")
    else:
        print(f"smallest dose with flip rate >= 0.9: {res.chosen_dose:g}")
        for mode, (starts, exact) in (res.generated or {}).items():
            print(f"  greedy completions, steering {mode.replace('_', ' ')}: {starts:.3f} start with 'pos', "
                  f"{exact:.3f} are exactly 'pos'")
    return res


if __name__ == "__main__":
    main()

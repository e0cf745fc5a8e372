"""ME-DLM's mask + edit training batches (Ren et al., arXiv 2605.09603; ``utils/edit_trainer.py``),
built on the host from SFT rows (one example per row: prompt, answer, EOS padding).

A batch is one of two kinds (drawn per batch, as the reference draws per packed batch):

* **mask** (`mask_batch`): each document draws ``t ~ U(0, 1)``; answer tokens are masked with
  ``p = (1 - eps) t + eps``; the current-token head learns the clean token at masked slots and
  the next-token head at slot ``i`` learns the current label of slot ``i + 1``.
* **intermediate** (`intermediate_batch`, probability ``edit_intermediate_ratio``): the masked
  answers are filled by the live model (``k`` tokens per forward, ``k`` drawn from
  ``edit_fill_per_step``; ``<|del|>`` and [MASK] banned), the response's EOS tokens dropped and
  one EOS appended, then ``rounds`` self edit rounds run (`jaxlm.inference.diffusion.edit`); both
  heads learn the edit labels of the result against the clean answer
  (`jaxlm.data.edit_labels`; the trailing EOS's current label is EOS), or, given the task's
  other accepted answers, against the nearest of them.

Rows: ``tokens``, ``cur_labels`` and ``next_labels`` (``IGNORE`` where untrained), ``segment_ids``,
``positions`` ``[B, T]`` and ``weight [B] = 1 / p``; the loss is
``sum_b weight_b (mean CE_cur_b + mean CE_next_b)`` over documents with a label. Departures
from the reference: ``t`` is drawn per document (LLaDA's per-document ``t``) with the ``eps``
floor, and the means are per document rather than per packed batch.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.data.edit_labels import edit_distance, edit_labels, position_labels
from jaxlm.inference.diffusion import edit

IGNORE = -1


def split_rows(batch: dict[str, np.ndarray]) -> list[tuple[list[int], list[int]]]:
    """``(prompt, answer)`` token lists of each row (the answer is every trained token, EOS
    padding included)."""
    tokens, seg, trained = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_mask"))
    rows = []
    for b in range(tokens.shape[0]):
        real = seg[b] > 0
        if len(np.unique(seg[b][real])) > 1:
            raise ValueError("edit batches need one example per row (data.pack=False)")
        rows.append((tokens[b][real & ~trained[b]].tolist(), tokens[b][real & trained[b]].tolist()))
    return rows


def _draw_masks(rows, rng: np.random.Generator, eps: float):
    """Per row: ``p`` and a boolean mask over its answer tokens."""
    out = []
    for _, answer in rows:
        p = (1.0 - eps) * rng.random() + eps
        out.append((p, rng.random(len(answer)) < p))
    return out


def _layout(rows_tokens, cur, nxt, weights, T: int) -> dict[str, np.ndarray]:
    B = len(rows_tokens)
    batch = {
        "tokens": np.zeros((B, T), np.int32), "cur_labels": np.full((B, T), IGNORE, np.int32),
        "next_labels": np.full((B, T), IGNORE, np.int32), "segment_ids": np.zeros((B, T), np.int32),
        "positions": np.zeros((B, T), np.int32), "weight": np.asarray(weights, np.float32),
    }
    for b, (x, c, n) in enumerate(zip(rows_tokens, cur, nxt)):
        if len(x) > T:
            raise ValueError(f"row {b} has {len(x)} tokens, more than the {T} slots of the batch")
        L = len(x)
        batch["tokens"][b, :L], batch["cur_labels"][b, :L], batch["next_labels"][b, :L] = x, c, n
        batch["segment_ids"][b, :L], batch["positions"][b, :L] = 1, np.arange(L)
    return batch


def mask_batch(batch: dict[str, np.ndarray], rng: np.random.Generator, *, mask_id: int, eps: float
               ) -> dict[str, np.ndarray]:
    """The mask kind (see the module docstring) in the rows' own layout."""
    T = batch["tokens"].shape[1]
    rows = split_rows(batch)
    xs, curs, nxts, weights = [], [], [], []
    for (prompt, answer), (p, masked) in zip(rows, _draw_masks(rows, rng, eps)):
        answer = np.asarray(answer, np.int64)
        x = np.concatenate([prompt, np.where(masked, mask_id, answer)])
        cur = np.concatenate([np.full(len(prompt), IGNORE), np.where(masked, answer, IGNORE)])
        xs.append(x)
        curs.append(cur)
        nxts.append(np.append(cur[1:], IGNORE))
        weights.append(1.0 / p)
    return _layout(xs, curs, nxts, weights, T)


@functools.partial(jax.jit, static_argnames=("graphdef", "mask_id", "del_id", "eos_id", "order"))
def _intermediate_responses(graphdef, params, prompts, prompt_valid, answers, answer_valid, max_len, per_step,
                            rounds, rng, *, mask_id: int, del_id: int, eos_id: int, order: str):
    """Fill the masked answers, close them with one EOS and run the self edit rounds:
    ``(responses [B, W], lengths [B])`` (lengths with the EOS)."""
    model = nnx.merge(graphdef, params)
    P, W = prompts.shape[1], answers.shape[1]
    x = jnp.concatenate([prompts, answers], 1)
    valid = jnp.concatenate([prompt_valid, answer_valid], 1)
    x = edit.fill_masks(model, x, valid, mask_id=mask_id, per_step=per_step, rng=rng, order=order,
                        banned=(del_id, mask_id))
    response, lengths = edit.close_response(x[:, P:], (x[:, P:] == eos_id) | ~answer_valid, eos_id=eos_id, width=W,
                                            max_len=max_len)
    response, lengths, _, _ = edit.edit_rounds(model, prompts, prompt_valid, response, lengths, rounds=rounds,
                                               del_id=del_id, eos_id=eos_id, max_len=max_len, banned=(mask_id,))
    return response, lengths


def nearest_answer(noisy, candidates: Sequence[Sequence[int]]) -> list[int]:
    """The candidate at the least unit-cost edit distance from ``noisy`` (the first on ties)."""
    dist = [edit_distance(noisy, c) for c in candidates]
    return list(candidates[int(np.argmin(dist))])


def intermediate_batch(batch: dict[str, np.ndarray], rng: np.random.Generator, model, *, mask_id: int, del_id: int,
                       eos_id: int, eps: float, per_step: int, rounds: int, order: str = "random",
                       swap_rule: str = "reference",
                       accepted: Sequence[Sequence[Sequence[int]]] | None = None) -> dict[str, np.ndarray]:
    """The intermediate kind (see the module docstring), from the live ``model``.

    ``accepted``: per row, the other answers the task accepts (token lists without EOS); each
    output is then labelled against the nearest of its row's answer and these."""
    T = batch["tokens"].shape[1]
    rows = split_rows(batch)
    B = len(rows)
    P = -(-max(len(prompt) for prompt, _ in rows) // 8) * 8  # left-padded to a multiple of 8: few compiled shapes
    prompts, prompt_valid = np.zeros((B, P), np.int32), np.zeros((B, P), bool)
    answers, answer_valid = np.full((B, T), eos_id, np.int32), np.zeros((B, T), bool)
    weights, cleans = [], []
    for b, ((prompt, answer), (p, masked)) in enumerate(zip(rows, _draw_masks(rows, rng, eps))):
        if not prompt:
            raise ValueError(f"row {b} has no prompt: an edit row needs at least one prompt token")
        prompts[b, P - len(prompt):], prompt_valid[b, P - len(prompt):] = prompt, True
        answers[b, :len(answer)] = np.where(masked, mask_id, answer)
        answer_valid[b, :len(answer)] = True
        weights.append(1.0 / p)
        cleans.append([t for t in answer if t != eos_id])
    max_len = np.asarray([T - len(prompt) - 1 for prompt, _ in rows], np.int32)
    graphdef, state = nnx.split(model)
    response, lengths = _intermediate_responses(
        graphdef, state, jnp.asarray(prompts), jnp.asarray(prompt_valid), jnp.asarray(answers),
        jnp.asarray(answer_valid), jnp.asarray(max_len), jnp.asarray(per_step, jnp.int32),
        jnp.asarray(rounds, jnp.int32), jax.random.key(int(rng.integers(2**31))), mask_id=mask_id, del_id=del_id,
        eos_id=eos_id, order=order)
    response, lengths = np.asarray(response), np.asarray(lengths)
    xs, curs, nxts = [], [], []
    for b, (prompt, _) in enumerate(rows):
        noisy = response[b, :lengths[b] - 1]
        clean = cleans[b] if accepted is None else nearest_answer(noisy, [cleans[b], *accepted[b]])
        tokens, nexts = edit_labels(noisy, clean, del_id=del_id, eos_id=eos_id, ignore_id=IGNORE,
                                    swap_rule=swap_rule)
        cur, nxt = position_labels(tokens, nexts, prompt_len=len(prompt), eos_id=eos_id, ignore_id=IGNORE)
        xs.append(np.concatenate([prompt, noisy, [eos_id]]))
        curs.append(cur)
        nxts.append(nxt)
    return _layout(xs, curs, nxts, weights, T)

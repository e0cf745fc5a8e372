"""On-policy distillation rows: the batch's completions replaced by the live student's own samples.

Generalized knowledge distillation (Agarwal et al., ICLR 2024, "On-Policy Distillation of
Language Models") trains the student on sequences it samples itself, with probability
``lambda`` per batch, so the divergence is minimised where the student goes at inference rather
than only along the data. Align-TI's token-transition alignment (method card B.9) is defined
along a sequence of tokens, the data's or the student's own; on a sampled batch the
divergence and TPA of `trainers.distill.loss` run along the sampled tokens unchanged.

`sample_rows` keeps each row's prompt (every token before the first trained one), samples a
completion of at most ``max_new_tokens`` from the student (stopping at EOS, which is kept and
trained) and lays the rows out as the SFT pipeline does: ``tokens``, ``loss_mask`` (the
sampled tokens), ``segment_ids`` (1 on the example) and ``positions``; a MeGan row's
``condition`` is sampled under and kept. Rows with per-token columns are refused.
"""

from __future__ import annotations

import numpy as np

from jaxlm.inference.sampler import generate

ROW_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")
CONDITION_KEYS = ("condition", "condition_mask")  # per row, not per token: kept with the new completion


def split_prompts(batch: dict[str, np.ndarray]) -> list[list[int] | None]:
    """Each row's prompt: its example's tokens before the first trained token (None for an empty
    row). A row must hold one example whose trained tokens are one span at its end (a single-turn
    completion)."""
    tokens, seg, trained = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_mask"))
    prompts = []
    for b in range(tokens.shape[0]):
        real = seg[b] > 0
        ids = np.unique(seg[b][real])
        if len(ids) > 1:
            raise ValueError(f"row {b} packs {len(ids)} examples: on-policy distillation needs one example per row "
                             "(data.pack=False)")
        n = int(real.sum())
        if n == 0:
            prompts.append(None)
            continue
        if not real[:n].all():
            raise ValueError(f"row {b} is not left-aligned: on-policy rows are built from one example starting "
                             "at slot 0")
        where = np.flatnonzero(trained[b][:n])
        if where.size == 0 or where[0] == 0:
            raise ValueError(f"row {b} has {'no trained token' if where.size == 0 else 'no prompt'}: on-policy "
                             "distillation samples a completion after a prompt")
        if not trained[b][where[0]:n].all():
            raise ValueError(f"row {b}'s trained tokens are not one span at the end of its example (e.g. a "
                             "multi-turn chat): on-policy distillation resamples a single final completion")
        prompts.append(tokens[b, : where[0]].tolist())
    return prompts


def sample_rows(model, batch: dict[str, np.ndarray], *, seed: int, temperature: float, max_new_tokens: int | None,
                eos_id: int | None, pad_id: int = 0) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """``batch`` with every row's completion sampled from ``model`` (see the module docstring) and
    ``(rows, info)``, info the mean sampled length and the fraction of rows that reached EOS.
    ``max_new_tokens`` None: as many as the row's slots leave after its prompt (the longest
    prompt decides, so every completion fits)."""
    T = np.asarray(batch["tokens"]).shape[1]
    other = sorted(set(batch) - set(ROW_KEYS) - set(CONDITION_KEYS))
    if other:  # per-token columns (stored teacher log-probs, a graph mask) do not describe new tokens
        raise ValueError(f"the batch's rows carry {other}, which describe the data's tokens: on-policy distillation "
                         "resamples the completions and cannot carry them (set algorithm.distill.on_policy=0)")
    prompts = split_prompts(batch)
    live = [b for b, p in enumerate(prompts) if p is not None]
    if not live:
        raise ValueError("the batch has no example to sample a completion for")
    room = T - max(len(prompts[b]) for b in live)
    if room < 1:
        raise ValueError(f"the longest prompt ({T - room} tokens) leaves no slot of the {T}-token rows for a "
                         "completion: raise data.seq_len")
    n_new = room if max_new_tokens is None else min(int(max_new_tokens), room)
    condition = None
    if "condition" in batch:  # a MeGan row's condition text: the student samples under it, as trained
        ids = np.asarray(batch["condition"])[live]
        condition = (ids, np.asarray(batch["condition_mask"])[live]) if "condition_mask" in batch else ids
    out = generate(model, [prompts[b] for b in live], max_new_tokens=n_new, temperature=temperature, rng=seed,
                   add_bos=False, stop_tokens=() if eos_id is None else (eos_id,), pad_id=pad_id, condition=condition)
    completions = out.completions()
    rows = {k: np.zeros((len(prompts), T), np.asarray(batch[k]).dtype) for k in ROW_KEYS}
    rows.update({k: np.asarray(batch[k]) for k in CONDITION_KEYS if k in batch})  # one per row, unchanged
    rows["tokens"][:] = pad_id
    for b, completion in zip(live, completions):
        prompt = prompts[b]
        P, L = len(prompt), len(prompt) + len(completion)
        rows["tokens"][b, :P], rows["tokens"][b, P:L] = prompt, completion
        rows["loss_mask"][b, P:L] = True
        rows["segment_ids"][b, :L] = 1
        rows["positions"][b, :L] = np.arange(L)
    ended = [bool(c) and eos_id is not None and c[-1] == eos_id for c in completions]
    info = {"on_policy_length": float(np.mean([len(c) for c in completions])),
            "on_policy_eos": float(np.mean(ended))}
    return rows, info

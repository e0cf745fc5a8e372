"""Per-token log-prob columns for a training file (``jaxlm logprobs``): the behaviour policy's
log-probs that PEAR reweights by, a fixed target policy's, or a teacher's (its top-K for
offline distillation).

Each row is encoded as training encodes it (`jaxlm.data.encoding.encode`, so the columns line
up with the tokens a run sees) and gets one entry per token: entry ``i`` is ``log p(token_i |
tokens_<i)`` (entry 0, which nothing predicts, is 0; its top-K entry is unused). The row's
other keys are kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.data.encoding import encode
from jaxlm.data.files import TOKEN_FIELDS, TOPK_FIELDS, DataError, read_rows
from jaxlm.fileio import atomic_write_text, jsonl_lines
from jaxlm.models.masks import segment_mask

ROLES_AS = ("behavior", "target", "teacher")


def _bucket(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def token_logprobs(model, examples: list[dict[str, Any]], *, top_k: int = 0, batch_size: int = 16
                   ) -> list[dict[str, np.ndarray]]:
    """For each example (a data row): ``logprobs [n]`` and, with ``top_k``, ``topk_ids [n, K]``
    and ``topk_logprobs [n, K]`` of the model's next-token distributions along its encoding."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the model has no tokenizer: cannot encode the rows as training does")
    encoded = [encode(e, tok)["tokens"] for e in examples]
    limit = model.config.max_seq_len
    over = [i for i, x in enumerate(encoded) if len(x) > limit]
    if over:  # scores at positions the model was not built for
        raise DataError(f"row {over[0]} encodes to {len(encoded[over[0]])} tokens, more than the model's "
                        f"ModelConfig.max_seq_len={limit} ({len(over)} row(s) too long)")
    graphdef, state = nnx.split(model)

    @jax.jit
    def scores(state, tokens, seg):
        m = nnx.merge(graphdef, state)
        positions = jnp.where(seg > 0, jnp.arange(tokens.shape[1])[None], 0)
        mask = segment_mask(seg, sliding_window=m.config.sliding_window)  # as training masks the rows
        logits = m(tokens, positions, mask=mask).logits.astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # position t scores token t + 1
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        out = {"logprobs": jnp.pad(picked, ((0, 0), (1, 0)))}
        if top_k:
            vals, ids = jax.lax.top_k(logp, top_k)
            first = jnp.broadcast_to(jnp.arange(top_k), (tokens.shape[0], 1, top_k))
            out["topk_ids"] = jnp.concatenate([first.astype(ids.dtype), ids], axis=1)
            out["topk_logprobs"] = jnp.concatenate(
                [jnp.full((tokens.shape[0], 1, top_k), -np.log(logp.shape[-1]), jnp.float32), vals], axis=1)
        return out

    results: list[dict[str, np.ndarray]] = [{} for _ in encoded]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        T = min(_bucket(max(len(encoded[i]) for i in idx)), limit)
        tokens = np.full((batch_size, T), tok.pad_id or 0, np.int32)
        seg = np.zeros((batch_size, T), np.int32)
        for r, i in enumerate(idx):
            tokens[r, :len(encoded[i])] = encoded[i]
            seg[r, :len(encoded[i])] = 1
        out = jax.device_get(scores(state, tokens, seg))
        for r, i in enumerate(idx):
            n = len(encoded[i])
            results[i] = {k: np.asarray(v[r, :n]) for k, v in out.items()}
    return results


def annotate_file(model, data: str | Path, out: str | Path, *, as_: str = "behavior", top_k: int = 0,
                  batch_size: int = 16, overwrite: bool = False) -> Path:
    """Write ``data``'s rows to ``out`` (jsonl) with ``{as_}_logprobs`` (and, for a teacher with
    ``top_k``, ``teacher_topk_ids`` / ``teacher_topk_logprobs``) added to each."""
    if as_ not in ROLES_AS:
        raise ValueError(f"--as={as_!r} is invalid: must be one of {list(ROLES_AS)}")
    if top_k and as_ != "teacher":
        raise ValueError("--top-k is for a teacher's log-probs (--as teacher)")
    if top_k < 0 or batch_size < 1:
        raise ValueError(f"--top-k={top_k} must be >= 0 and --batch-size={batch_size} >= 1")
    if top_k > model.config.vocab_size:
        raise ValueError(f"--top-k={top_k} exceeds the model's vocab_size={model.config.vocab_size}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    if Path(data).suffix != ".jsonl":
        raise DataError(f"{data}: `jaxlm logprobs` reads and writes .jsonl files")
    rows = read_rows(data)  # validated (a bad line is named): the same rows as `raw`, in order
    raw = [json.loads(line) for _, line in jsonl_lines(data)]
    # after the input is read (bad input leaves nothing behind), before the model's work
    out.parent.mkdir(parents=True, exist_ok=True)
    scores = token_logprobs(model, [{k: v for k, v in r.items() if k not in TOKEN_FIELDS + TOPK_FIELDS} for r in rows],
                            top_k=top_k, batch_size=batch_size)
    lines = []
    for row, s in zip(raw, scores):
        row = dict(row)
        row[f"{as_}_logprobs"] = [float(x) for x in s["logprobs"]]
        if top_k:
            row["teacher_topk_ids"] = s["topk_ids"].astype(int).tolist()
            row["teacher_topk_logprobs"] = [[float(x) for x in r] for r in s["topk_logprobs"]]
        lines.append(json.dumps(row))
    return atomic_write_text(out, "\n".join(lines) + "\n")

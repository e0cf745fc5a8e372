"""One example -> ``tokens`` and ``loss_mask``: what every data source's rows become.

A prompt/completion example is ``segments`` ``[(text, trainable), ...]``: BOS, the prompt
(not trained), the completion and EOS (trained). Chat ``messages`` are rendered in the
tokenizer's chat format and only the assistant output is trained (`jaxlm.data.chat.encode_chat`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxlm.data.chat import builtin_segments, encode_chat
from jaxlm.data.files import TOKEN_FIELDS, TOPK_FIELDS, DataError


def to_segments(example: dict[str, Any]) -> list[tuple[str, bool]]:
    """Prompt (untrained) and completion; chat ``messages`` in the built-in format."""
    if "messages" in example:
        return builtin_segments(example["messages"])
    return [(example["prompt"], False), (example["completion"], True)]


def _with_token_fields(enc: dict[str, np.ndarray], example: dict[str, Any]) -> dict[str, np.ndarray]:
    """Attach the example's per-token columns (`jaxlm.data.files.TOKEN_FIELDS`), each checked to
    have one entry per token of the encoding."""
    n = len(enc["tokens"])
    for k in TOKEN_FIELDS + TOPK_FIELDS:
        if k not in example:
            continue
        v = np.asarray(example[k], np.int32 if k == "teacher_topk_ids" else np.float32)
        if len(v) != n:
            text = example.get("prompt", example.get("messages", [{}])[0].get("content", ""))
            raise DataError(
                f"a row's {k!r} has {len(v)} entries but the row encodes to {n} tokens (row starting "
                f"{str(text)[:40]!r}): it was computed with another tokenizer or chat format; recompute it with "
                "`jaxlm logprobs` and this run's tokenizer")
        enc[k] = v
    return enc


def encode(example: dict[str, Any], tokenizer) -> dict[str, np.ndarray]:
    """BOS + segments + EOS as ``tokens`` and ``loss_mask`` (EOS is trained); chat
    ``messages``: the tokenizer's chat format with its assistant mask (`encode_chat`). The
    example's per-token columns (behaviour / teacher log-probs) come along, one per token."""
    if "messages" in example:
        tokens, mask = encode_chat(tokenizer, example["messages"])
        enc = {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, bool)}
        return _with_token_fields(enc, example)
    tokens: list[int] = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    mask: list[bool] = [False] * len(tokens)
    for text, trainable in to_segments(example):
        ids = tokenizer.encode(text)
        tokens += ids
        mask += [trainable] * len(ids)
    if tokenizer.eos_id is not None:
        tokens.append(tokenizer.eos_id)
        mask.append(True)
    return _with_token_fields({"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, bool)}, example)

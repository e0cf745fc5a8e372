"""One example -> ``tokens`` and ``loss_mask``: what every data source's rows become.

A prompt/completion example is ``segments`` ``[(text, trainable), ...]``: BOS, the prompt
(not trained), the completion and EOS (trained). Chat ``messages`` are rendered in the
tokenizer's chat format and only the assistant output is trained (`jaxlm.data.chat.encode_chat`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxlm.data.chat import builtin_segments, encode_chat


def to_segments(example: dict[str, Any]) -> list[tuple[str, bool]]:
    """Prompt (untrained) and completion; chat ``messages`` in the built-in format."""
    if "messages" in example:
        return builtin_segments(example["messages"])
    return [(example["prompt"], False), (example["completion"], True)]


def encode(example: dict[str, Any], tokenizer) -> dict[str, np.ndarray]:
    """BOS + segments + EOS as ``tokens`` and ``loss_mask`` (EOS is trained); chat
    ``messages``: the tokenizer's chat format with its assistant mask (`encode_chat`)."""
    if "messages" in example:
        tokens, mask = encode_chat(tokenizer, example["messages"])
        return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, bool)}
    tokens: list[int] = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    mask: list[bool] = [False] * len(tokens)
    for text, trainable in to_segments(example):
        ids = tokenizer.encode(text)
        tokens += ids
        mask += [trainable] * len(ids)
    if tokenizer.eos_id is not None:
        tokens.append(tokenizer.eos_id)
        mask.append(True)
    return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, bool)}

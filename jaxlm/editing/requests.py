"""Edit requests as arrays: right-padded ``prompt + target`` rows with the target's mask
and the position of the subject's last token (the "key" position of locate-then-edit)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from flax import struct


@struct.dataclass
class EncodedPairs:
    tokens: np.ndarray  # int32 [N, T]
    valid: np.ndarray  # bool [N, T]
    target_mask: np.ndarray  # bool [N, T]: token t is a target token (predicted from t-1)
    key_position: np.ndarray  # int32 [N]: subject's last token (or the prompt's last token)


def _split_encoding(tokenizer, prompt: str, target: str, add_bos: bool, i: int):
    """``(prompt ids, target ids, prompt token offsets or None)`` as the model reads
    ``prompt + target``. Encoding the two apart is the same for most tokenizers; where it is
    not (a SentencePiece-style normalizer turns a target's leading space into a token of its
    own), the whole text is encoded and cut where the target starts."""
    prompt_ids, target_ids = tokenizer.encode(prompt, add_bos=add_bos), tokenizer.encode(target)
    if prompt_ids + target_ids == tokenizer.encode(prompt + target, add_bos=add_bos):
        return prompt_ids, target_ids, None
    if not hasattr(tokenizer, "encode_with_offsets"):
        return prompt_ids, target_ids, None  # no character offsets to cut the whole text by
    ids, offsets = tokenizer.encode_with_offsets(prompt + target)
    cut = sum(start < len(prompt) for start, _ in offsets)
    if any(start < len(prompt) < stop for start, stop in offsets):
        raise ValueError(f"request {i}: a token spans the end of the prompt and the start of the target "
                         f"({prompt[-10:]!r} + {target[:10]!r}); end the prompt, or start the target, at a word")
    bos = [tokenizer.bos_id] if add_bos and getattr(tokenizer, "bos_id", None) is not None else []
    return bos + list(ids[:cut]), list(ids[cut:]), offsets[:cut]


def encode_pairs(
    tokenizer,
    prompts: Sequence[str],
    targets: Sequence[str],
    *,
    subjects: Sequence[str | None] | None = None,
    seq_len: int | None = None,
    add_bos: bool = True,
    append_eos: bool = False,
) -> EncodedPairs:
    """Encode ``prompt + target`` pairs. ``subjects[i]`` (a substring of ``prompts[i]``)
    sets ``key_position`` to its last token; otherwise the prompt's last token."""
    if len(prompts) != len(targets):
        raise ValueError(f"{len(prompts)} prompts but {len(targets)} targets")
    if subjects is not None and len(subjects) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(subjects)} subjects (one per prompt, or None)")
    if not prompts:
        raise ValueError("no prompts to encode")
    rows = []
    for i, (p, t) in enumerate(zip(prompts, targets)):
        prompt_ids, target_ids, offsets = _split_encoding(tokenizer, p, t, add_bos, i)
        if append_eos and tokenizer.eos_id is not None:
            target_ids = target_ids + [tokenizer.eos_id]
        if not target_ids:
            raise ValueError(f"target {i} ({t!r}) encodes to no tokens")
        key = len(prompt_ids) - 1
        subject = None if subjects is None else subjects[i]
        if subject:
            at = p.find(subject)
            if at < 0:
                raise ValueError(f"subject {subject!r} does not occur in prompt {i} ({p!r})")
            end = at + len(subject)
            if offsets is None:
                key = len(tokenizer.encode(p[:end], add_bos=add_bos)) - 1
            else:  # the last token of the whole text that starts inside the subject
                key = len(prompt_ids) - len(offsets) + sum(start < end for start, _ in offsets) - 1
        rows.append((prompt_ids + target_ids, len(prompt_ids), key))
    T = max(len(r[0]) for r in rows) if seq_len is None else seq_len
    too_long = [i for i, r in enumerate(rows) if len(r[0]) > T]
    if too_long:
        raise ValueError(f"prompt+target {too_long[:5]} longer than seq_len={T}")
    N = len(rows)
    tokens = np.zeros((N, T), np.int32)
    valid = np.zeros((N, T), bool)
    target = np.zeros((N, T), bool)
    keys = np.zeros((N,), np.int32)
    for i, (ids, n_prompt, key) in enumerate(rows):
        tokens[i, : len(ids)] = ids
        valid[i, : len(ids)] = True
        target[i, n_prompt : len(ids)] = True
        keys[i] = key
    return EncodedPairs(tokens=tokens, valid=valid, target_mask=target, key_position=keys)


def rewrite_pairs(tokenizer, requests: Sequence[dict[str, Any]], *, field: str = "target_new", **kw) -> EncodedPairs:
    """The requests' rewrite prompts with ``field`` as the target (keys at the subject)."""
    return encode_pairs(
        tokenizer, [r["prompt"] for r in requests], [r[field] for r in requests],
        subjects=[r.get("subject") for r in requests], **kw,
    )

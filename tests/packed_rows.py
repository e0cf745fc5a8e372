"""Packed training rows built by hand from encoded examples (tests of the step and losses)."""

import jax.numpy as jnp
import numpy as np

from jaxlm.data.encoding import encode


def packed_row(examples, tokenizer, T=48):
    """Encoded examples packed into one row (segments 1, 2, ...), the rest padding."""
    tokens, mask, seg, pos = [], [], [], []
    for i, ex in enumerate(examples, 1):
        enc = encode(ex, tokenizer)
        n = len(enc["tokens"])
        tokens += enc["tokens"].tolist()
        mask += enc["loss_mask"].tolist()
        seg += [i] * n
        pos += list(range(n))
    pad = T - len(tokens)
    return {
        "tokens": np.array(tokens + [0] * pad, np.int32), "loss_mask": np.array(mask + [False] * pad),
        "segment_ids": np.array(seg + [0] * pad, np.int32), "positions": np.array(pos + [0] * pad, np.int32),
    }


def stacked(rows):
    """Rows -> a batch of device arrays."""
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}

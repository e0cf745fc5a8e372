"""Block expansion (LLaMA Pro, Wu et al. 2024, arXiv 2401.02415): deepen a trained model with
identity blocks.

Each inserted block is a copy of the block before it with its output projections (attention
``o_proj``, MLP ``down_proj``) set to zero. A pre-norm block computes
``x + o_proj(attn(norm(x)))`` then ``x + down_proj(mlp(norm(x)))``, so the copy adds nothing to
the residual stream: the expanded model computes exactly the function of the original (bit for
bit), and fine-tuning can put new computation in the added depth without first undoing the
old. LLaMA Pro trains only the inserted blocks (`inserted_block_indices` gives them, for
``OptimizerConfig.trainable``); training everything from the expanded weights also works.

Works on unrolled and scanned (``scan_layers``) stacks, per-layer widths (the copy takes the
widths of the block it copies) and MeGan's per-layer embedding (the copy takes its row).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.config import _LAYER_FIELDS
from jaxlm.models.transformer import Transformer, abstract_model

ZEROED = (("attn", "o_proj"), ("mlp", "down_proj"))  # the block's writes to the residual stream


def _check_after(after: Sequence[int], n_layers: int) -> list[int]:
    after = list(after)
    if not after:
        raise ValueError("expand_blocks: after is empty; name at least one block to copy")
    for i in after:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers:
            raise ValueError(f"expand_blocks: after={after!r} holds {i!r}; each entry must be a block index "
                             f"in [0, n_layers={n_layers})")
    return sorted(after)


def source_blocks(after: Sequence[int], n_layers: int) -> list[int]:
    """For each block of the expanded stack, the index of the original block it starts from."""
    after = _check_after(after, n_layers)
    out = []
    for i in range(n_layers):
        out.append(i)
        out += [i] * after.count(i)
    return out


def inserted_block_indices(after: Sequence[int], n_layers: int) -> list[int]:
    """Indices, in the expanded stack, of the inserted (identity) blocks."""
    src = source_blocks(after, n_layers)
    return [j for j in range(len(src)) if j > 0 and src[j] == src[j - 1]]


def _zero_outputs(block: dict) -> dict:
    for module, proj in ZEROED:
        for name, value in block[module][proj].items():
            if value is not None:
                block[module][proj][name] = jnp.zeros_like(value)
    return block


def expand_blocks(model: Transformer, after: Sequence[int]) -> Transformer:
    """The model with an identity copy of block ``i`` inserted after block ``i`` for each ``i``
    in ``after`` (an index given k times inserts k copies). Pure: ``model`` is not changed.

    >>> bigger = expand_blocks(model, after=[model.config.n_layers - 1])   # one block on top
    """
    c = model.config
    structured = sorted({type(leaf).__name__ for leaf in jax.tree.leaves(
        nnx.to_pure_dict(nnx.state(model)), is_leaf=lambda x: not isinstance(x, dict))
        if leaf is not None and not isinstance(leaf, (jax.Array, np.ndarray))})
    if structured:
        raise ValueError(f"expand_blocks needs dense weights, but the model holds {structured} (a quantized "
                         "model): expand the blocks before quantizing")
    src = source_blocks(after, c.n_layers)
    inserted = set(inserted_block_indices(after, c.n_layers))
    changes = {"n_layers": len(src)}
    for name in _LAYER_FIELDS:
        values = getattr(c, name)
        if values is not None:
            changes[name] = tuple(values[s] for s in src)
    new_config = c.replace(**changes)
    old = nnx.to_pure_dict(nnx.state(model))
    new = dict(old)
    if c.scan_layers:
        idx = jnp.asarray(src)
        layers = jax.tree.map(lambda a: a[idx], old["layers"])
        mask = jnp.asarray([j not in inserted for j in range(len(src))])
        for module, proj in ZEROED:
            for name, value in layers[module][proj].items():
                if value is not None:
                    keep = mask.reshape((-1,) + (1,) * (value.ndim - 1))
                    layers[module][proj][name] = jnp.where(keep, value, jnp.zeros_like(value))
        new["layers"] = layers
    else:
        blocks = {}
        for j, s in enumerate(src):
            block = jax.tree.map(lambda a: a, old["layers"][s])  # a fresh dict tree (arrays are immutable)
            blocks[j] = _zero_outputs(block) if j in inserted else block
        new["layers"] = blocks
    if old.get("meta_gate"):
        gate = dict(old["meta_gate"])
        gate["layer_emb"] = old["meta_gate"]["layer_emb"][jnp.asarray(src)]
        new["meta_gate"] = gate
    target = abstract_model(new_config)
    graphdef, state = nnx.split(target)
    nnx.replace_by_pure_dict(state, new)
    out = nnx.merge(graphdef, state)
    out.tokenizer = model.tokenizer
    return out

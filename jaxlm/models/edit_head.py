"""Turn a masked diffusion LM into an edit model (ME-DLM, Ren et al., arXiv 2605.09603): one new
token, ``<|del|>``, appended to the vocabulary, and a next-token head initialised as a copy of
the current-token head (the reference's ``--copy_head``), so the new model starts out predicting
"insert nothing" wherever it predicts the current token."""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxlm.checkpoint import load_model, save_checkpoint
from jaxlm.models.transformer import Transformer, build_model


def add_edit_head(model: Transformer) -> Transformer:
    """A new model: vocabulary ``V + 1`` with ``delete_token_id = V`` (its embedding row the
    mean of the others, its current-token logit column zero) and ``next_token_head`` a copy of
    the new current-token head, so both heads give the same logits at first. With tied
    embeddings the current-token head is the embedding, so ``<|del|>``'s column there is the
    mean embedding (not zero), and the copy has it too. Every other parameter is shared by
    value, and so is every other piece of state (a compressed model's kept RoPE frequencies)."""
    c = model.config
    if c.mode != "diffusion":
        raise ValueError(f"add_edit_head needs a masked diffusion LM (mode='diffusion'), got mode={c.mode!r}")
    if c.next_token_head:
        raise ValueError("add_edit_head: the model already has a next-token head")
    V = c.vocab_size
    new_config = dataclasses.replace(c, vocab_size=V + 1, next_token_head=True, delete_token_id=V)
    params = nnx.to_pure_dict(nnx.state(model))
    embed = params["embed"]
    params["embed"] = jnp.concatenate([embed, embed.mean(0, keepdims=True)], 0)
    if c.tie_embeddings:  # the current-token head is the new embedding, its <|del|> row included
        head = params["embed"].T
    else:
        head = params["lm_head"]["kernel"]
        head = jnp.concatenate([head, jnp.zeros((head.shape[0], 1), head.dtype)], 1)
        params["lm_head"]["kernel"] = head
    params["next_head"] = {"kernel": head}
    new = build_model(new_config, seed=0, tokenizer=model.tokenizer)
    state = nnx.state(new)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(new, state)
    return new


def main(argv=None) -> None:
    """``python -m jaxlm.models.edit_head SRC DST``: `add_edit_head` on a saved diffusion model."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("src", help="a masked diffusion checkpoint (mode='diffusion')")
    ap.add_argument("dst", help="where to write the edit model")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    model = add_edit_head(load_model(args.src))
    print(save_checkpoint(model, args.dst, overwrite=args.overwrite))


if __name__ == "__main__":
    main()

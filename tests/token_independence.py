"""A quantized model whose activations are quantized per token: a token's logits must not
depend on the other tokens of the call (left padding, the cache length, which changes what
padded query rows see) and cached greedy decoding must equal recomputation without a cache."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlm

PROMPTS = [[5, 9, 200, 17], [3, 40], [44, 45, 46, 47, 48, 49]]


def _left_padded(seqs, width):
    return jnp.asarray([[0] * (width - len(s)) + s for s in seqs], jnp.int32)


def assert_independent_of_padding_and_cache(model, *, new_tokens: int = 6, atol: float = 1e-5):
    forward = nnx.jit(lambda m, t, v: m(t, mask=v).logits)
    prefill = nnx.jit(lambda m, t, v, c: m(t, mask=v, cache=c).logits)  # eager: 15 s of op compiles
    prompts = _left_padded(PROMPTS, 8)
    valid = prompts > 0
    a, b = (prefill(model, prompts, valid, model.init_cache(3, S)) for S in (12, 16))
    c = forward(model, prompts, valid)
    m = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(a)[m], np.asarray(b)[m], rtol=1e-5, atol=atol)
    np.testing.assert_allclose(np.asarray(a)[m], np.asarray(c)[m], rtol=1e-5, atol=atol)
    result = jaxlm.generate(model, PROMPTS, max_new_tokens=new_tokens, temperature=0)
    seqs = [list(s) for s in PROMPTS]
    for _ in range(new_tokens):
        t = _left_padded(seqs, 12)
        nxt = np.asarray(jnp.argmax(forward(model, t, t > 0)[:, -1], axis=-1))
        seqs = [s + [int(x)] for s, x in zip(seqs, nxt)]
    np.testing.assert_array_equal(np.asarray(result.tokens), np.array([s[len(p):] for s, p in zip(seqs, PROMPTS)]))

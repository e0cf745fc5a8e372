"""The Pallas grammar-mask kernel (`kernels_pallas.grammar_mask`) against the definition of
the bitmask (token ``v`` allowed iff bit ``v % 32`` of int32 word ``v // 32`` is set,
XGrammar's layout), written here with Python integers, and inside constrained generation
against the jnp path (``mask_backend("reference")``).

As in tests/quant/test_kernels.py, the base class runs the compiled kernel where a GPU/TPU is
present and the ``Interpret`` subclass runs the same tests in Pallas interpret mode on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.inference.grammar import compile_regex, mask_backend, set_mask_backend
from jaxlm.inference.grammar.decoding import MASK_BACKEND
from kernels_pallas import grammar_mask

ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")


def masked_by_definition(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    out = np.array(logits, copy=True)
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            if not (int(words[b, v // 32]) & 0xFFFFFFFF) >> (v % 32) & 1:
                out[b, v] = -np.inf
    return out


def random_words(rng, B, V, density):
    """Packed words of a random mask; bits past ``V`` random too (they must be ignored)."""
    bits = rng.random((B, -(-V // 32), 32)) < density
    return (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32).view(np.int32)


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=64), tokenizer=jaxlm.ByteTokenizer(),
                             seed=0)


class TestGrammarMaskKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _backend(self):
        if not self.INTERPRET and not ON_ACCELERATOR:
            # JAX's own convention: on CPU the compiled kernels cannot run, the Interpret
            # subclass below runs the same tests.
            pytest.skip("compiled Pallas kernels need a GPU/TPU; CPU runs TestGrammarMaskKernelInterpret")

    @pytest.mark.parametrize("B,V,bb,bw", [(1, 1, 8, 128), (2, 31, 8, 128), (3, 32, 8, 128), (5, 33, 2, 1),
                                           (9, 259, 8, 4), (16, 1000, 8, 8), (4, 4127, 8, 128)])
    def test_matches_the_bitmask_definition(self, B, V, bb, bw):
        """Vocabularies that are and are not multiples of 32, grids that overhang B and W."""
        rng = np.random.default_rng(V)
        logits = rng.standard_normal((B, V)).astype(np.float32)
        logits[0, 0] = np.nan  # a NaN stays NaN where allowed, -inf where masked
        words = random_words(rng, B, V, density=0.4)
        words[-1] = -1  # every token allowed (the sign bit included)
        got = grammar_mask.masked_logits(jnp.asarray(logits), jnp.asarray(words), bb=bb, bw=bw,
                                         interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(got), masked_by_definition(logits, words))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(grammar_mask.reference(logits, words)))

    def test_bfloat16_logits_keep_their_dtype_and_values(self):
        rng = np.random.default_rng(1)
        logits = jnp.asarray(rng.standard_normal((4, 300)), jnp.bfloat16)
        words = random_words(rng, 4, 300, density=0.5)
        got = grammar_mask.masked_logits(logits, jnp.asarray(words), interpret=self.INTERPRET)
        assert got.dtype == jnp.bfloat16
        want = masked_by_definition(np.asarray(logits, np.float32), words)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)

    def test_bad_words_are_refused(self):
        logits = jnp.zeros((2, 64))
        with pytest.raises(ValueError, match=r"need \(2, 2\)"):
            grammar_mask.masked_logits(logits, jnp.zeros((2, 3), jnp.int32), interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="must be int32"):
            grammar_mask.masked_logits(logits, jnp.zeros((2, 2), jnp.uint32), interpret=self.INTERPRET)

    def test_constrained_generation_equals_the_jnp_path(self, model, monkeypatch):
        """Greedy and sampled, one grammar and one per row with a free row: the same tokens
        through the kernel as through the jnp mask."""
        traced = []
        kernel = grammar_mask.masked_logits
        monkeypatch.setattr(grammar_mask, "masked_logits", lambda *a, **kw: traced.append(kw) or kernel(*a, **kw))
        tok = model.tokenizer
        pets = compile_regex(r"(cat|dog|bird)s? [0-9]{1,2}\.", tok, cache_dir=None)
        yes_no = compile_regex(r"(yes|no)!", tok, cache_dir=None)
        mode = "interpret" if self.INTERPRET else "kernel"
        for grammar, temperature in ((pets, 0.0), ([pets, yes_no, None], 2.0)):
            outs = {}
            for m in (mode, "reference"):
                with mask_backend(m):
                    outs[m] = jaxlm.generate(model, ["Pet: ", "x", "ok? "], max_new_tokens=10,
                                             temperature=temperature, rng=3, grammar=grammar)
            assert outs[mode].completions() == outs["reference"].completions()
            rows = grammar if isinstance(grammar, list) else [grammar] * 3
            for g, text in zip(rows, outs[mode].texts):
                if g is not None:
                    assert g.matches(text) or len(text) == 10  # complete, or cut by max_new_tokens
        assert traced and all(kw["interpret"] == self.INTERPRET for kw in traced)


class TestGrammarMaskKernelInterpret(TestGrammarMaskKernel):
    INTERPRET = True


def test_backend_names_are_checked_and_auto_is_the_jnp_path():
    with pytest.raises(ValueError, match="grammar mask backend 'gpu' is invalid"):
        set_mask_backend("gpu")
    assert MASK_BACKEND.resolved() == "reference"  # auto: not yet measured on hardware
    with mask_backend("interpret"):
        assert MASK_BACKEND.resolved() == "interpret"
    assert MASK_BACKEND.resolved() == "reference"

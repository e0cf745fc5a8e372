"""Block expansion (LLaMA Pro): the expanded model computes the original function exactly, the
inserted blocks are copies with zero output projections, and bad indices are named."""

import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.models.expansion import inserted_block_indices, source_blocks

BASE = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def _tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 200, (2, 9)).astype(np.int32)
    return tokens, np.broadcast_to(np.arange(9, dtype=np.int32), (2, 9))


@pytest.mark.parametrize("extra", [{}, {"scan_layers": True}, {"layer_ffn_dims": (64, 32, 48)},
                                   {"qkv_bias": True}, {"mlp": "meta_swiglu"}],
                         ids=["unrolled", "scanned", "per_layer_ffn", "qkv_bias", "meta_swiglu"])
def test_expanded_model_computes_the_same_logits(extra):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(**BASE, **extra), seed=1)
    bigger = jaxlm.expand_blocks(model, [0, 2, 2])
    assert bigger.config.n_layers == 6
    tokens, positions = _tokens()
    np.testing.assert_array_equal(np.asarray(bigger(tokens, positions).logits),
                                  np.asarray(model(tokens, positions).logits))
    assert model.config.n_layers == 3  # the source is untouched
    if "layer_ffn_dims" in extra:
        assert bigger.config.layer_ffn_dims == (64, 64, 32, 48, 48, 48)


def test_inserted_blocks_copy_their_source_with_zero_outputs():
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(**BASE), seed=2)
    bigger = jaxlm.expand_blocks(model, [1])
    assert source_blocks([1], 3) == [0, 1, 1, 2] and inserted_block_indices([1], 3) == [2]
    old, new = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(bigger))
    for j, s in enumerate([0, 1, 1, 2]):
        for module, proj in (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("mlp", "gate_proj"),
                             ("mlp", "up_proj")):
            np.testing.assert_array_equal(new["layers"][j][module][proj]["kernel"],
                                          old["layers"][s][module][proj]["kernel"])
        for module, proj in (("attn", "o_proj"), ("mlp", "down_proj")):
            kernel = np.asarray(new["layers"][j][module][proj]["kernel"])
            if j == 2:
                assert not kernel.any()
            else:
                np.testing.assert_array_equal(kernel, old["layers"][s][module][proj]["kernel"])
    np.testing.assert_array_equal(new["embed"], old["embed"])


def test_expanded_model_trains_and_round_trips(tmp_path):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(**BASE), seed=3, tokenizer=jaxlm.ByteTokenizer())
    bigger = jaxlm.expand_blocks(model, [2])
    jaxlm.save_checkpoint(bigger, tmp_path / "m")
    loaded = jaxlm.load_checkpoint(tmp_path / "m")
    assert loaded.config.n_layers == 4 and loaded.tokenizer is not None
    tokens, positions = _tokens()
    np.testing.assert_array_equal(np.asarray(loaded(tokens, positions).logits),
                                  np.asarray(model(tokens, positions).logits))


@pytest.mark.parametrize("after", [[], [3], [-1], [1.0], [True]])
def test_bad_indices_are_named(after):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(**BASE), seed=0)
    with pytest.raises(ValueError, match="after"):
        jaxlm.expand_blocks(model, after)


def test_a_quantized_model_is_refused_by_name():
    """Its projections are QArray codes, not arrays to copy and zero (this crashed inside
    jnp.zeros_like, printing the whole array)."""
    from jaxlm.quant import QuantRecipe, quantize_model

    q = quantize_model(jaxlm.build_model(jaxlm.ModelConfig.tiny(**BASE), seed=1), QuantRecipe())
    with pytest.raises(ValueError, match=r"expand_blocks needs dense weights, but the model holds \['QArray'\]"):
        jaxlm.expand_blocks(q, [1])

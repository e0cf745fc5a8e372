"""LLaDA checkpoints -> `jaxlm.load_hf` diffusion models, against transformers' Llama run with a
bidirectional (custom 4-D) attention mask: LLaDA is Llama's block without the causal mask.

The tiny checkpoints are written in LLaDA's own layout (``LLaDAModelLM``: OLMo-style config,
``model.transformer.*`` tensors) and in the Llama-named layout with ME-DLM's next-token head."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jax.numpy as jnp  # noqa: E402

import jaxlm  # noqa: E402
from jaxlm.models.hf.families import UnsupportedConfigError  # noqa: E402

V, D, LAYERS, HEADS, KV, FFN = 96, 32, 2, 4, 2, 64
MASK_ID = 95

# LLaDA's tensor names for a Llama module name (from the block layout of LLaDA's remote code)
_LLADA_NAMES = {
    "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out", "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm",
    "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out",
}


def _llada_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "model.transformer.wte.weight", "model.norm.weight":
           "model.transformer.ln_f.weight", "lm_head.weight": "model.transformer.ff_out.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"model.transformer.blocks.{layer}.{_LLADA_NAMES[module]}.weight"


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
        intermediate_size=FFN, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    next_head = torch.randn(V, D) * 0.3
    return model, next_head


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V - 1, (3, 9))
    tokens[1, 4:7] = MASK_ID
    mask = np.ones((3, 9), bool)
    mask[2, :3] = False  # left padding
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


def _bidirectional(model, tokens, mask, positions):
    """transformers' Llama with a custom 4-D mask: every real key visible to every query."""
    visible = np.broadcast_to(mask[:, None, None, :], (3, 1, 9, 9))
    attn = torch.as_tensor(np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32))  # additive
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens), attention_mask=attn, position_ids=torch.as_tensor(positions),
                    output_hidden_states=True)
    return out.logits.numpy(), out.hidden_states[-1]


def _write(path, tensors, config):
    path.mkdir()
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def test_llada_native_layout_matches_bidirectional_llama(reference, tmp_path):
    model, _ = reference
    tensors = {_llada_name(k): v for k, v in model.state_dict().items() if "rotary" not in k}
    config = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": D, "n_layers": LAYERS,
              "n_heads": HEADS, "n_kv_heads": KV, "mlp_hidden_size": FFN, "vocab_size": V, "embedding_size": V,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "weight_tying": False, "mask_token_id": MASK_ID,
              "max_sequence_length": 64, "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms",
              "include_bias": False, "include_qkv_bias": False, "rope": True, "alibi": False}
    _write(tmp_path / "llada", tensors, config)
    loaded = jaxlm.load_hf(tmp_path / "llada", dtype="float32")
    assert loaded.config.mode == "diffusion" and loaded.config.mask_token_id == MASK_ID
    assert not loaded.config.next_token_head
    tokens, mask, positions = _batch()
    ref, _ = _bidirectional(model, tokens, mask, positions)
    got = np.asarray(loaded(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask)).logits)
    np.testing.assert_allclose(got[mask], ref[mask], atol=1e-4, rtol=0)
    # the reference is really bidirectional: the first position sees the last one
    causal = model(input_ids=torch.as_tensor(tokens[:1])).logits.detach().numpy()
    assert np.abs(causal[0, 0] - ref[0, 0]).max() > 1e-3


def test_llada_llama_named_layout_with_the_next_token_head(reference, tmp_path):
    model, next_head = reference
    tensors = {k: v for k, v in model.state_dict().items() if "rotary" not in k}
    tensors["next_token_head.weight"] = next_head
    config = {**model.config.to_dict(), "architectures": ["LLaDAForCausalLM"], "model_type": "llada"}
    config.pop("mask_token_id", None)  # LLaDA's default id applies: override it for this vocabulary
    _write(tmp_path / "medlm", tensors, config)
    loaded = jaxlm.load_hf(tmp_path / "medlm", dtype="float32", mask_token_id=MASK_ID)
    assert loaded.config.mode == "diffusion" and loaded.config.next_token_head
    tokens, mask, positions = _batch()
    ref, hidden = _bidirectional(model, tokens, mask, positions)
    out = loaded(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out.logits)[mask], ref[mask], atol=1e-4, rtol=0)
    ref_next = (hidden @ next_head.T).numpy()
    np.testing.assert_allclose(np.asarray(out.next_logits)[mask], ref_next[mask], atol=1e-4, rtol=0)


def test_llada_unsupported_options_and_default_mask_id(reference, tmp_path):
    model, _ = reference
    tensors = {_llada_name(k): v for k, v in model.state_dict().items() if "rotary" not in k}
    base = {"architectures": ["LLaDAModelLM"], "d_model": D, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV,
            "mlp_hidden_size": FFN, "vocab_size": V, "max_sequence_length": 64}
    _write(tmp_path / "bias", tensors, {**base, "include_qkv_bias": True})
    with pytest.raises(UnsupportedConfigError, match="include_qkv_bias=True is not supported"):
        jaxlm.load_hf(tmp_path / "bias")
    _write(tmp_path / "nomask", tensors, base)
    with pytest.raises(ValueError, match="mask_token_id"):  # LLaDA's 126336 is outside this vocabulary
        jaxlm.load_hf(tmp_path / "nomask")
    _write(tmp_path / "noheads", tensors, {k: v for k, v in base.items() if k != "n_heads"})
    with pytest.raises(UnsupportedConfigError, match="no 'n_heads' field"):
        jaxlm.load_hf(tmp_path / "noheads")


def test_llada_width_from_mlp_ratio_and_kv_heads_from_multi_query_attention(reference, tmp_path):
    """OLMo-style configs: no mlp_hidden_size but mlp_ratio (the width is ratio x d_model; it
    failed asking for an 'intermediate_size' field), and multi_query_attention with n_kv_heads
    unset (one K/V head; it was read as n_heads and failed on the tensor shapes)."""
    from jaxlm.models.hf.llada import as_llama

    model, _ = reference
    tensors = {_llada_name(k): v for k, v in model.state_dict().items() if "rotary" not in k}
    config = {"architectures": ["LLaDAModelLM"], "d_model": D, "n_layers": LAYERS, "n_heads": HEADS,
              "n_kv_heads": KV, "multi_query_attention": None, "mlp_hidden_size": None, "mlp_ratio": FFN // D,
              "vocab_size": V, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "mask_token_id": MASK_ID,
              "max_sequence_length": 64}
    _write(tmp_path / "ratio", tensors, config)
    loaded = jaxlm.load_hf(tmp_path / "ratio", dtype="float32")
    assert loaded.config.ffn_dim == FFN and loaded.config.n_kv_heads == KV
    tokens, mask, positions = _batch()
    ref, _ = _bidirectional(model, tokens, mask, positions)
    got = np.asarray(loaded(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask)).logits)
    np.testing.assert_allclose(got[mask], ref[mask], atol=1e-4, rtol=0)
    base = {"d_model": 64, "n_layers": 1, "n_heads": 8, "vocab_size": 10, "mlp_hidden_size": 128}
    assert as_llama({**base, "n_kv_heads": None, "multi_query_attention": True})["num_key_value_heads"] == 1
    assert as_llama({**base, "n_kv_heads": None, "multi_query_attention": False})["num_key_value_heads"] == 8
    assert as_llama({**base, "n_kv_heads": 1, "multi_query_attention": True})["num_key_value_heads"] == 1
    with pytest.raises(UnsupportedConfigError, match="n_kv_heads=2 contradicts multi_query_attention=True"):
        as_llama({**base, "n_kv_heads": 2, "multi_query_attention": True})
    assert as_llama({**base, "mlp_hidden_size": None})["intermediate_size"] == 4 * 64  # OLMo's default ratio
    with pytest.raises(UnsupportedConfigError, match="mlp_ratio=0"):
        as_llama({**base, "mlp_hidden_size": None, "mlp_ratio": 0})


@pytest.mark.parametrize("edit_head", [False, True])
def test_save_hf_of_a_diffusion_model_round_trips_as_llada(tmp_path, edit_head):
    """A diffusion model is written in the Llama-named LLaDA layout (never as a causal Llama):
    reloading it gives the same mode, ids, logits and next-token logits."""
    config = jaxlm.ModelConfig.tiny(vocab_size=V, mode="diffusion", mask_token_id=MASK_ID, next_token_head=edit_head,
                                    delete_token_id=MASK_ID - 1 if edit_head else None)
    model = jaxlm.build_model(config, seed=3)
    jaxlm.save_hf(model, tmp_path / "saved")
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert written["architectures"] == ["LLaDAForCausalLM"] and written["mask_token_id"] == MASK_ID
    loaded = jaxlm.load_hf(tmp_path / "saved")
    assert loaded.config == config
    tokens, mask, positions = _batch()
    want = model(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask))
    got = loaded(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    if edit_head:
        np.testing.assert_array_equal(np.asarray(got.next_logits), np.asarray(want.next_logits))
    with pytest.raises(UnsupportedConfigError, match="mode='diffusion' with family='qwen2'"):
        jaxlm.save_hf(model, tmp_path / "qwen2", family="qwen2")

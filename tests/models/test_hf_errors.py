"""Bad HF checkpoints fail with errors that name the key, the shapes or the file."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxlm
from jaxlm.models.hf import UnsupportedConfigError

pytest.importorskip("torch")
from hf_reference import build_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    build_hf_model("llama_llama3_rope").save_pretrained(path)
    return path


def _copy(good_dir, tmp_path, edit_tensors=None, edit_config=None):
    tensors = load_file(str(good_dir / "model.safetensors"))
    config = json.loads((good_dir / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_load_hf_takes_jnp_and_numpy_dtypes(good_dir):
    import jax.numpy as jnp

    for dtype, name in ((jnp.float32, "float32"), (np.float16, "float16"), (jnp.bfloat16, "bfloat16")):
        model = jaxlm.load_hf(good_dir, dtype=dtype)
        assert model.config.dtype == model.config.param_dtype == name
        assert model.embed[...].dtype == np.dtype(name)
    model = jaxlm.load_hf(good_dir, dtype=np.float32, param_dtype=jnp.bfloat16)
    assert (model.config.dtype, model.config.param_dtype) == ("float32", "bfloat16")
    out = jaxlm.generate(model, [[5, 6, 7]], max_new_tokens=2, temperature=0, cache_dtype=jnp.bfloat16)
    assert out.tokens.shape == (1, 2)
    with pytest.raises(ValueError, match=r"load_hf\(dtype\)=<class 'jax.numpy.int8'> is invalid: must be one of"):
        jaxlm.load_hf(good_dir, dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"generate\(cache_dtype\)=.* is invalid"):
        jaxlm.generate(model, [[5]], max_new_tokens=1, cache_dtype="int4")


def test_unknown_architecture_lists_supported(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path, edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        jaxlm.load_hf(path)


def test_a_config_without_architectures_is_read_by_its_model_type(good_dir, tmp_path):
    """As transformers' Auto classes read it (it was refused); without either, the error stays."""
    want = np.asarray(jaxlm.load_hf(good_dir)(np.asarray([[5, 6, 7]], np.int32)).logits)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    path = _copy(good_dir, tmp_path / "a", edit_config=lambda c: c.pop("architectures"))
    np.testing.assert_array_equal(np.asarray(jaxlm.load_hf(path)(np.asarray([[5, 6, 7]], np.int32)).logits), want)
    bare = _copy(good_dir, tmp_path / "b", edit_config=lambda c: (c.pop("architectures"), c.pop("model_type")))
    with pytest.raises(UnsupportedConfigError, match="'architectures'=None is invalid"):
        jaxlm.load_hf(bare)


def test_a_tied_checkpoint_storing_only_its_head_loads_as_transformers_loads_it(tmp_path):
    """tie_word_embeddings with only lm_head.weight stored: transformers ties the embedding to
    it; jaxlm raised a shape error naming a None embedding."""
    import torch
    import transformers

    build_hf_model("qwen2_bias_tied").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = np.asarray([[1, 5, 9, 30]], np.int64)
    want = ref(torch.as_tensor(tokens)).logits.detach().numpy()
    got = np.asarray(jaxlm.load_hf(tmp_path, dtype="float32")(tokens.astype(np.int32)).logits)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_missing_tensor_is_named(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path, edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(jaxlm.CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\].*\(96, 64\)"):
        jaxlm.load_hf(path)


def test_extra_tensor_is_named(good_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)

    path = _copy(good_dir, tmp_path, edit_tensors=add)
    with pytest.raises(jaxlm.CheckpointError, match=r"unexpected tensor 'model.layers.0.self_attn.extra.weight' \(2, 2\)"):
        jaxlm.load_hf(path)


def test_layer_beyond_config_is_unexpected(good_dir, tmp_path):
    def add(t):
        t["model.layers.5.input_layernorm.weight"] = np.ones((64,), np.float32)

    path = _copy(good_dir, tmp_path, edit_tensors=add)
    with pytest.raises(jaxlm.CheckpointError, match="unexpected tensor 'model.layers.5.input_layernorm.weight'"):
        jaxlm.load_hf(path)


def test_misshaped_tensor_names_both_shapes(good_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    path = _copy(good_dir, tmp_path, edit_tensors=shrink)
    with pytest.raises(jaxlm.CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(16, 64\), expected \(32, 64\)"):
        jaxlm.load_hf(path)


def test_truncated_file_is_a_clear_error(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(jaxlm.CheckpointError, match="model.safetensors"):
        jaxlm.load_hf(path)


def test_corrupt_header_is_a_clear_error(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(jaxlm.CheckpointError, match="model.safetensors"):
        jaxlm.load_hf(path)


def test_tiny_file_is_a_clear_error(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    (path / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(jaxlm.CheckpointError, match="truncated"):
        jaxlm.load_hf(path)


def test_pickles_are_refused(good_dir, tmp_path):
    (tmp_path / "config.json").write_text((good_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(jaxlm.CheckpointError, match="never unpickles"):
        jaxlm.load_hf(tmp_path)


def test_index_naming_missing_shard(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")  # sharded: no model.safetensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors",
                                   "lm_head.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(jaxlm.CheckpointError, match=r"lists shard files that do not exist: \['model-00002-of-00002"):
        jaxlm.load_hf(path)


def test_missing_config_and_bad_json(tmp_path):
    with pytest.raises(jaxlm.CheckpointError, match="config.json does not exist"):
        jaxlm.load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(jaxlm.CheckpointError, match="not valid JSON"):
        jaxlm.load_hf(tmp_path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope type 'yarn'"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(num_key_value_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
    ],
)
def test_unsupported_config_values(good_dir, tmp_path, edit, match):
    path = _copy(good_dir, tmp_path, edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=match):
        jaxlm.load_hf(path)


def test_save_hf_refuses_what_the_family_cannot_express(tmp_path):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(qk_norm=True, family="llama"))
    with pytest.raises(UnsupportedConfigError, match="LlamaForCausalLM.*qk_norm=True"):
        jaxlm.save_hf(model, tmp_path)
    jaxlm.save_hf(model, tmp_path, family="qwen3")  # the family that has qk-norm
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    # six heads of 16 over width 64: saved as Llama, transformers refused to load the directory
    # (and the save had replaced whatever was there)
    odd = jaxlm.build_model(jaxlm.ModelConfig(vocab_size=101, d_model=64, n_layers=1, n_heads=6, n_kv_heads=2,
                                              head_dim=16, ffn_dim=64, family="llama"), seed=0)
    with pytest.raises(UnsupportedConfigError, match="d_model=64 is not a multiple of n_heads=6"):
        jaxlm.save_hf(odd, tmp_path / "odd")
    assert not (tmp_path / "odd").exists()
    jaxlm.save_hf(odd, tmp_path / "odd", family="mistral")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "odd", dtype=torch.float32)
    tokens = np.asarray([[1, 2, 3, 4, 5]], np.int32)
    with torch.no_grad():
        ref = back(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(odd(tokens).logits), ref, atol=1e-5)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.pop("vocab_size"), "config.json has no 'vocab_size' field"),
        (lambda c: c.pop("intermediate_size"), "config.json has no 'intermediate_size' field"),
        (lambda c: c.update(hidden_size="64"), r"config.json field 'hidden_size'='64' is not an integer"),
        (lambda c: c.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
         "config.json rope_parameters has no 'factor' field"),
    ],
)
def test_missing_or_mistyped_config_fields_are_named(good_dir, tmp_path, edit, match):
    path = _copy(good_dir, tmp_path, edit_config=edit)
    with pytest.raises(UnsupportedConfigError, match=match):
        jaxlm.load_hf(path)


def test_null_optional_fields_take_their_defaults(good_dir, tmp_path):
    """HF writes ``null`` for an unset optional field: the default applies, as for a missing one."""
    path = _copy(good_dir, tmp_path, edit_config=lambda c: c.update(rms_norm_eps=None, sliding_window=None))
    assert jaxlm.load_hf(path).config.norm_eps == 1e-6


def test_config_json_must_be_an_object(good_dir, tmp_path):
    path = _copy(good_dir, tmp_path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(jaxlm.CheckpointError, match="config.json holds a JSON list, not an object"):
        jaxlm.load_hf(path)


def test_save_hf_refuses_quantized_weights(tmp_path):
    from jaxlm.quant.apply import quantize_with

    model = quantize_with(jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=97)), "rtn", "mxfp4", weights_only=True)
    with pytest.raises(UnsupportedConfigError, match="quantized or transformed weight.*save_checkpoint"):
        jaxlm.save_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_model_safetensors_wins_over_a_stale_index(good_dir, tmp_path):
    """transformers' save_pretrained of one file over a sharded directory leaves the old index:
    model.safetensors is read first, as transformers does (the stale index was refused)."""
    path = _copy(good_dir, tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00014.safetensors"}}))
    tokens = np.asarray([[1, 5, 9]], np.int32)
    np.testing.assert_array_equal(np.asarray(jaxlm.load_hf(path)(tokens).logits),
                                  np.asarray(jaxlm.load_hf(good_dir)(tokens).logits))


def test_only_model_safetensors_is_read_beside_other_safetensors_files(good_dir, tmp_path):
    """Without an index, transformers reads model.safetensors alone: a PEFT adapter, a
    consolidated.safetensors or a backup copy beside it made every load fail."""
    path = _copy(good_dir, tmp_path)
    save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((2, 2), np.float32)},
              str(path / "adapter_model.safetensors"))
    (path / "backup.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    want = jaxlm.load_hf(good_dir)
    got = jaxlm.load_hf(path)
    tokens = np.asarray([[1, 5, 9]], np.int32)
    np.testing.assert_array_equal(np.asarray(got(tokens).logits), np.asarray(want(tokens).logits))


@pytest.mark.parametrize("edit", [
    dict(hidden_act="swish"),  # transformers' ACT2FN: SiLU
    dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "rope_theta": 500000.0}),  # no original_max_position_embeddings: max_position_embeddings
    # a top-level original_max_position_embeddings wins over the rope dict's (from_pretrained)
    dict(original_max_position_embeddings=64,
         rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "rope_theta": 500000.0, "original_max_position_embeddings": 16}),
])
def test_configs_transformers_completes_load_as_transformers_reads_them(good_dir, tmp_path, edit):
    import torch
    import transformers

    path = _copy(good_dir, tmp_path, edit_config=lambda c: c.update(edit))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens = (np.arange(48, dtype=np.int64)[None] * 7) % 31 + 1  # long enough for the RoPE scaling to show
    want = ref(torch.as_tensor(tokens)).logits.detach().numpy()
    np.testing.assert_allclose(np.asarray(jaxlm.load_hf(path)(tokens.astype(np.int32)).logits), want, atol=2e-5)


def test_qwen_config_edges_read_as_the_config_classes_read_them():
    """An explicit null num_key_value_heads is n_heads (a missing key the class default); a
    use_sliding_window whose max_window_layers covers every layer slides none."""
    import transformers

    from jaxlm.models.hf.configs import config_from_hf

    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128}
    ref = transformers.Qwen2Config(**{**base, "num_key_value_heads": None})
    assert config_from_hf({**base, "num_key_value_heads": None}).n_kv_heads == ref.num_key_value_heads == 4
    base["num_key_value_heads"] = 2
    ref = transformers.Qwen2Config(**{**base, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2})
    assert set(ref.layer_types) == {"full_attention"}
    cfg = config_from_hf({**base, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2})
    assert cfg.sliding_window is None
    with pytest.raises(UnsupportedConfigError, match="use_sliding_window=True"):
        config_from_hf({**base, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    # refused before though transformers runs them with full attention in every layer: no window
    # (null), the class's max_window_layers (28) covering both layers, explicit all-full layer_types
    for arch, cls in (("Qwen2ForCausalLM", transformers.Qwen2Config), ("Qwen3ForCausalLM", transformers.Qwen3Config)):
        for extra in ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1},
                      {"use_sliding_window": True, "sliding_window": 8},
                      {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                       "layer_types": ["full_attention"] * 2}):
            edited = {**base, "architectures": [arch], **extra}
            assert set(cls(**{k: v for k, v in edited.items() if k != "architectures"}).layer_types) == {"full_attention"}
            assert config_from_hf(edited).sliding_window is None
        with pytest.raises(UnsupportedConfigError, match="per-layer sliding windows"):
            config_from_hf({**base, "architectures": [arch], "layer_types": ["full_attention", "sliding_attention"]})
    # options the class does not read: Mistral has no biases, only Llama has MLP biases, Llama
    # has no layer_types (transformers builds each without them)
    mistral = {**base, "architectures": ["MistralForCausalLM"]}
    for extra in ({"attention_bias": True}, {"mlp_bias": True}):
        assert config_from_hf({**mistral, **extra}) == config_from_hf(mistral)
        assert config_from_hf({**base, "mlp_bias": True}) == config_from_hf(base)  # Qwen2
    llama = {**base, "architectures": ["LlamaForCausalLM"]}
    assert config_from_hf({**llama, "layer_types": ["sliding_attention"] * 2}) == config_from_hf(llama)
    with pytest.raises(UnsupportedConfigError, match="mlp_bias=True"):
        config_from_hf({**llama, "mlp_bias": True})
    with pytest.raises(UnsupportedConfigError, match="attention_bias=True"):
        config_from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True})


def test_save_hf_keeps_the_loaded_checkpoints_generation_settings(good_dir, tmp_path):
    """load_hf -> save_hf into a new directory kept only the special ids of
    generation_config.json: sampling defaults (do_sample, temperature, top_p, ...) were lost."""
    (tmp_path / "src").mkdir()
    src = _copy(good_dir, tmp_path / "src")
    settings = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 7}
    (src / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": 2}))
    jaxlm.save_hf(jaxlm.load_hf(src), tmp_path / "dst")
    saved = json.loads((tmp_path / "dst" / "generation_config.json").read_text())
    assert {k: saved.get(k) for k in settings} == settings
    # through a jaxlm checkpoint (quantize / edit / train write one) and back out to HF
    jaxlm.save_checkpoint(jaxlm.load_hf(src), tmp_path / "ckpt")
    jaxlm.save_hf(jaxlm.load_checkpoint(tmp_path / "ckpt"), tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "generation_config.json").read_text())
    assert {k: saved.get(k) for k in settings} == settings

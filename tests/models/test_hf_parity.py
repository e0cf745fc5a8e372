"""HF parity: tiny random transformers models -> load_hf -> logits; save_hf -> transformers reload.

Reference: HuggingFace `transformers` (PyTorch, CPU, eager attention), fp32, 1e-4 max abs
on every real (non-pad) position of a left-padded batch.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the reference implementation
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import jaxlm  # noqa: E402
from hf_reference import CASES, build_hf_model, hf_logits, padded_batch  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    model = build_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tokens, mask, positions = padded_batch()
    ref = hf_logits(model, tokens, mask, positions, output_hidden_states=True)
    return dict(name=request.param, model=model, path=path, batch=(tokens, mask, positions), ref=ref)


def _jaxlm_logits(model, tokens, mask, positions, **kw):
    return model(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask), **kw)


def test_load_hf_logits_match_transformers(hf_case):
    tokens, mask, positions = hf_case["batch"]
    model = jaxlm.load_hf(hf_case["path"], dtype="float32")
    out = _jaxlm_logits(model, tokens, mask, positions, collect=("hidden",))
    ref = hf_case["ref"].logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits)[mask], ref[mask], atol=ATOL, rtol=0)
    # Per-layer residual stream: HF hidden_states[1:-1] are the outputs of layers 0..L-2
    # (the last one is returned after the final norm, which is out.hidden).
    hidden = np.asarray(out.collected["hidden"])
    for layer, ref_h in enumerate(hf_case["ref"].hidden_states[1:-1]):
        np.testing.assert_allclose(hidden[layer][mask], ref_h.numpy()[mask], atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        np.asarray(out.hidden)[mask], hf_case["ref"].hidden_states[-1].numpy()[mask], atol=ATOL, rtol=0
    )


def test_load_hf_scanned_layers_match(hf_case):
    tokens, mask, positions = hf_case["batch"]
    model = jaxlm.load_hf(hf_case["path"], dtype="float32", scan_layers=True)
    assert model.config.scan_layers
    out = _jaxlm_logits(model, tokens, mask, positions)
    np.testing.assert_allclose(
        np.asarray(out.logits)[mask], hf_case["ref"].logits.numpy()[mask], atol=ATOL, rtol=0
    )


def test_save_hf_reloads_in_transformers(hf_case, tmp_path):
    tokens, mask, positions = hf_case["batch"]
    model = jaxlm.load_hf(hf_case["path"], dtype="float32")
    jaxlm.save_hf(model, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(reloaded) is type(hf_case["model"])
    logits = hf_logits(reloaded, tokens, mask, positions).logits.numpy()
    np.testing.assert_allclose(logits[mask], hf_case["ref"].logits.numpy()[mask], atol=ATOL, rtol=0)
    ref_state = hf_case["model"].state_dict()
    for key, value in reloaded.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), ref_state[key].numpy(), err_msg=key)


def test_config_fields_follow_hf(hf_case):
    cfg = hf_case["model"].config
    jcfg = jaxlm.load_hf(hf_case["path"], dtype="float32").config
    assert jcfg.n_kv_heads == cfg.num_key_value_heads
    assert jcfg.tie_embeddings == cfg.tie_word_embeddings
    assert jcfg.head_dim == getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert jcfg.num_params() == sum(p.numel() for p in hf_case["model"].parameters())


def test_rope_scaling_changes_logits(tmp_path):
    """Guard against the scaling being silently ignored: same weights, no scaling -> different."""
    model = build_hf_model("llama_llama3_rope")
    model.save_pretrained(tmp_path)
    tokens, mask, positions = padded_batch(length=40)
    scaled = jaxlm.load_hf(tmp_path, dtype="float32")
    plain = jaxlm.load_hf(tmp_path, dtype="float32", rope_scaling=jaxlm.RopeScaling())
    a = _jaxlm_logits(scaled, tokens, mask, positions).logits
    b = _jaxlm_logits(plain, tokens, mask, positions).logits
    ref = hf_logits(model, tokens, mask, positions).logits.numpy()
    np.testing.assert_allclose(np.asarray(a)[mask], ref[mask], atol=ATOL, rtol=0)
    assert np.abs(np.asarray(b)[mask] - ref[mask]).max() > 1e-3


def test_sharded_checkpoint_with_index(tmp_path):
    model = build_hf_model("qwen2_bias_tied")
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    tokens, mask, positions = padded_batch()
    jmodel = jaxlm.load_hf(tmp_path / "hf", dtype="float32")
    ref = hf_logits(model, tokens, mask, positions).logits.numpy()
    out = _jaxlm_logits(jmodel, tokens, mask, positions).logits
    np.testing.assert_allclose(np.asarray(out)[mask], ref[mask], atol=ATOL, rtol=0)
    # and jaxlm writes sharded checkpoints with an index that transformers reads
    jaxlm.save_hf(jmodel, tmp_path / "out", max_shard_bytes=20_000)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    logits = hf_logits(reloaded, tokens, mask, positions).logits.numpy()
    np.testing.assert_allclose(logits[mask], ref[mask], atol=ATOL, rtol=0)


def test_bfloat16_load_is_close(tmp_path):
    """bf16 weights and compute: loose agreement with the fp32 reference (bf16 has ~3 digits)."""
    model = build_hf_model("llama_llama3_rope")
    model.save_pretrained(tmp_path)
    tokens, mask, positions = padded_batch()
    jmodel = jaxlm.load_hf(tmp_path, dtype="bfloat16")
    assert jmodel.embed[...].dtype == jnp.bfloat16
    out = np.asarray(_jaxlm_logits(jmodel, tokens, mask, positions).logits)
    assert out.dtype == np.float32
    ref = hf_logits(model, tokens, mask, positions).logits.numpy()
    assert np.abs(out[mask] - ref[mask]).max() < 0.05


def test_legacy_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path):
    """A config.json with both keys (a ``rope_scaling`` added by hand to extend the context):
    transformers applies ``rope_scaling``."""
    import json

    model = build_hf_model("qwen2_bias_tied")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg.get("rope_parameters", {}).get("rope_type", "default") == "default"
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens, mask, positions = padded_batch(length=40)
    ref = hf_logits(ref_model, tokens, mask, positions).logits.numpy()
    plain = hf_logits(model, tokens, mask, positions).logits.numpy()
    assert np.abs(ref[mask] - plain[mask]).max() > 1e-3  # the scaling matters at this length
    ours = jaxlm.load_hf(tmp_path, dtype="float32")
    assert ours.config.rope_scaling.kind == "linear" and ours.config.rope_scaling.factor == 4.0
    out = _jaxlm_logits(ours, tokens, mask, positions).logits
    np.testing.assert_allclose(np.asarray(out)[mask], ref[mask], atol=ATOL, rtol=0)


def test_tied_config_with_a_different_stored_head_loads_it_untied(tmp_path):
    """transformers does not tie when the stored ``lm_head.weight`` differs from the
    embedding (it warns and uses the stored head); the same head must be used here."""
    from safetensors.torch import load_file, save_file

    model = build_hf_model("llama_linear_rope_tied")
    model.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    torch.manual_seed(1)
    tensors["lm_head.weight"] = 0.02 * torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, file, metadata={"format": "pt"})
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens, mask, positions = padded_batch()
    ref = hf_logits(ref_model, tokens, mask, positions).logits.numpy()
    with pytest.warns(UserWarning, match="lm_head.weight differs"):
        ours = jaxlm.load_hf(tmp_path, dtype="float32")
    assert not ours.config.tie_embeddings
    out = _jaxlm_logits(ours, tokens, mask, positions).logits
    np.testing.assert_allclose(np.asarray(out)[mask], ref[mask], atol=ATOL, rtol=0)
    # a stored copy equal to the embedding stays tied
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    assert jaxlm.load_hf(tmp_path, dtype="float32").config.tie_embeddings


def test_save_hf_writes_the_special_token_ids_transformers_generate_stops_on(tmp_path):
    import json

    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64),
                              seed=0)
    tok = model.tokenizer or jaxlm.ByteTokenizer()
    model.tokenizer = tok
    jaxlm.save_hf(model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    want = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    assert {k: cfg[k] for k in want} == want and {k: gen[k] for k in want} == want
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.generation_config.eos_token_id == tok.eos_id
    # an existing generation config's other settings survive a save over it
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6}))
    jaxlm.save_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["temperature"] == 0.6


def test_a_new_tokenizer_leaves_the_old_ones_files_and_ids_behind(tmp_path):
    """Saved with its own tokenizer over a HF directory: the old tokenizer's other files
    (special_tokens_map.json gave transformers an EOS id past the vocabulary) and the old
    generation config's ids the new tokenizer lacks (a BOS) do not survive."""
    import json

    class NoBos(jaxlm.ByteTokenizer):
        bos_id = None

    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64),
                              seed=0)
    model.tokenizer = NoBos()
    old = tmp_path / "hf"
    old.mkdir()
    (old / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    (old / "added_tokens.json").write_text(json.dumps({"</s>": 300}))
    (old / "vocab.json").write_text("{}")
    (old / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "temperature": 0.6}))
    (old / "README.md").write_text("kept")
    jaxlm.save_hf(model, old)
    names = {p.name for p in old.iterdir()}
    assert not names & {"special_tokens_map.json", "added_tokens.json", "vocab.json"} and "README.md" in names
    gen = json.loads((old / "generation_config.json").read_text())
    assert gen["bos_token_id"] is None and gen["eos_token_id"] == model.tokenizer.eos_id and gen["temperature"] == 0.6
    hf = transformers.AutoModelForCausalLM.from_pretrained(old)
    assert hf.generation_config.bos_token_id is None and hf.generation_config.eos_token_id == model.tokenizer.eos_id


def test_a_model_loaded_without_its_tokenizer_keeps_its_special_ids(tmp_path):
    """A weights-only directory (or tokenizer=False): config.json's BOS / EOS / PAD ids travel
    to a save_hf (transformers fell back to its class defaults, 1 and 2, and generate no
    longer stopped where the original did)."""
    import json

    hf = build_hf_model("llama_llama3_rope")
    hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id = 5, 6, 7
    hf.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "generation_config.json").unlink(missing_ok=True)
    model = jaxlm.load_hf(tmp_path / "src", tokenizer=False)
    assert model.tokenizer is None
    jaxlm.save_hf(model, tmp_path / "dst")
    cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (5, 6, 7)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    assert back.generation_config.eos_token_id == 6 and back.config.bos_token_id == 5
    jaxlm.save_checkpoint(model, tmp_path / "ckpt")  # through a jaxlm checkpoint too
    jaxlm.save_hf(jaxlm.load_checkpoint(tmp_path / "ckpt"), tmp_path / "dst2")
    assert json.loads((tmp_path / "dst2" / "config.json").read_text())["eos_token_id"] == 6


@pytest.mark.parametrize("field", [{"qat_format": "nvfp4"}, {"kv_quant": "e1m2"}])
def test_save_hf_refuses_forwards_hf_cannot_run(tmp_path, field):
    cfg = jaxlm.ModelConfig.tiny(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, **field)
    model = jaxlm.build_model(cfg, seed=0)
    name = next(iter(field))
    with pytest.raises(jaxlm.models.hf.UnsupportedConfigError, match=f"{name}="):
        jaxlm.save_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()

"""Orbax round trip with the config beside the arrays."""

import numpy as np
import pytest

import jaxlm
from jaxlm.checkpoint import load_checkpoint, read_config, save_checkpoint
from jaxlm.models.params import flat_params


@pytest.mark.parametrize("scan", [False, True])
def test_round_trip_is_exact(tmp_path, scan):
    cfg = jaxlm.ModelConfig.tiny(scan_layers=scan, qk_norm=True, tie_embeddings=True, family="qwen3")
    model = jaxlm.build_model(cfg, seed=4)
    save_checkpoint(model, tmp_path / "ckpt")
    assert read_config(tmp_path / "ckpt") == cfg
    restored = load_checkpoint(tmp_path / "ckpt")
    assert restored.config == cfg
    a, b = flat_params(model), flat_params(restored)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
        assert a[k].dtype == b[k].dtype


def test_bf16_params_round_trip(tmp_path):
    cfg = jaxlm.ModelConfig.tiny(param_dtype="bfloat16", dtype="bfloat16")
    model = jaxlm.build_model(cfg)
    save_checkpoint(model, tmp_path / "ckpt")
    restored = load_checkpoint(tmp_path / "ckpt")
    assert str(restored.embed[...].dtype) == "bfloat16"
    np.testing.assert_array_equal(np.asarray(model.embed[...]), np.asarray(restored.embed[...]))


def test_bad_restores(tmp_path):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny())
    save_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(jaxlm.CheckpointError, match="config mismatch.*n_layers: stored 2 vs requested 3"):
        load_checkpoint(tmp_path / "ckpt", config=jaxlm.ModelConfig.tiny(n_layers=3))
    with pytest.raises(jaxlm.CheckpointError, match="not a jaxlm checkpoint"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(model, tmp_path / "ckpt")
    save_checkpoint(model, tmp_path / "ckpt", overwrite=True)


@pytest.mark.parametrize("edit, match", [
    ({"n_layers": 1}, r"params/ holds layers\.1\.\S+, which config/ has no place for"),
    ({"tie_embeddings": True}, r"params/ holds lm_head\.kernel, which config/ has no place for"),
    ({"n_layers": 3}, r"layers\.2\.\S+ is missing from params/"),
    # a dtype edit cast every weight on the way in, silently
    ({"param_dtype": "bfloat16"}, r"embed is float32 in params/ but bfloat16 by config/"),
])
def test_edited_config_is_named_in_both_directions(tmp_path, edit, match):
    """A stored config that implies fewer (or more) weights than params/ holds is a config
    mismatch, not file damage."""
    import json

    save_checkpoint(jaxlm.build_model(jaxlm.ModelConfig.tiny()), tmp_path / "ckpt")
    meta = tmp_path / "ckpt" / "config" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), **edit}))
    with pytest.raises(jaxlm.CheckpointError, match=match + ".*config/ was edited or belongs to another model"):
        load_checkpoint(tmp_path / "ckpt")


def test_load_model_refuses_hf_options_for_a_jaxlm_checkpoint(tmp_path):
    from jaxlm.checkpoint import load_model

    save_checkpoint(jaxlm.build_model(jaxlm.ModelConfig.tiny()), tmp_path / "ckpt")
    with pytest.raises(TypeError, match=r"load_model\(\['dtype'\]\): these options apply to HF directories"):
        load_model(tmp_path / "ckpt", dtype="bfloat16")


def test_a_damaged_or_oversized_tokenizer_is_named(tmp_path):
    """A truncated tokenizer_config.json raised a bare JSONDecodeError; a tokenizer with more
    ids than the embedding has rows loaded, and its top ids gave NaN logits."""
    save_checkpoint(jaxlm.build_model(jaxlm.ModelConfig.tiny(), tokenizer=jaxlm.ByteTokenizer()), tmp_path / "ok")
    (tmp_path / "ok" / "tokenizer_config.json").write_text('{"tokenizer_class": ')
    with pytest.raises(jaxlm.CheckpointError, match=r"tokenizer could not be read: .*tokenizer_config.json could not "
                                                    r"be read as JSON"):
        load_checkpoint(tmp_path / "ok")
    small = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=200), tokenizer=jaxlm.ByteTokenizer())
    save_checkpoint(small, tmp_path / "small")
    with pytest.raises(jaxlm.CheckpointError, match=r"the tokenizer has 259 ids but ModelConfig.vocab_size=200"):
        load_checkpoint(tmp_path / "small")


@pytest.mark.parametrize("scan", [False, True])
def test_a_quantized_checkpoint_checks_its_config_too(tmp_path, scan):
    """The structure check skipped quantized checkpoints: an edited ffn_dim loaded with the old
    128-wide weights under a config saying 96, fewer layers gave a bare KeyError, more layers
    read as file damage."""
    import json
    import shutil

    from jaxlm.models.params import flat_params
    from jaxlm.quant.recipe import QuantRecipe, quantize_model

    model = quantize_model(jaxlm.build_model(jaxlm.ModelConfig.tiny(scan_layers=scan), seed=1),
                           QuantRecipe(format="nvfp4"))
    save_checkpoint(model, tmp_path / "q")
    back = load_checkpoint(tmp_path / "q")  # an unedited one still loads exactly
    tokens = np.arange(8)[None]
    np.testing.assert_array_equal(np.asarray(back(tokens).logits), np.asarray(model(tokens).logits))
    assert sorted(flat_params(back)) == sorted(flat_params(model))
    edits = [({"ffn_dim": 96}, r"the quantized layers\.\S*down_proj\.kernel is \(.*128.*\) in params/ but")]
    if not scan:
        edits += [({"n_layers": 1}, r"params/ holds the quantized layers\.1\.\S+, which config/ has no place for"),
                  ({"n_layers": 3}, r"layers\.2\.\S+ is missing from params/")]
    for edit, match in edits:
        d = tmp_path / f"edited{len(edit)}{list(edit.values())[0]}"
        shutil.copytree(tmp_path / "q", d)
        meta = d / "config" / "metadata"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), **edit}))
        with pytest.raises(jaxlm.CheckpointError, match=match + ".*config/ was edited or belongs to another model"):
            load_checkpoint(d)

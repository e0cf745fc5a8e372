"""ModelConfig: validation names the field and the allowed values; presets have the
published parameter counts (checked against transformers on the meta device too)."""

import dataclasses

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm.models.config import PRESETS, ModelConfig, RopeScaling, preset


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(n_heads=12, n_kv_heads=5, d_model=96), "n_heads=12 is not divisible by n_kv_heads=5"),
        (dict(vocab_size=0), r"vocab_size=0 is invalid: must be a positive int"),
        (dict(n_layers=-1), r"n_layers=-1 is invalid"),
        (dict(d_model=2.5), r"d_model=2.5 is invalid"),
        (dict(d_model=65), r"d_model=65 is not divisible by n_heads=4"),
        (dict(head_dim=15), r"head_dim=15 is invalid: must be even"),
        (dict(norm_eps=0.0), r"norm_eps=0.0 is invalid: must be a finite number > 0"),
        (dict(norm_eps=float("nan")), r"norm_eps=nan is invalid: must be a finite number > 0"),
        (dict(rope_theta=-1.0), r"rope_theta=-1.0 is invalid"),
        (dict(rope_theta=float("inf")), r"rope_theta=inf is invalid"),
        (dict(init_std=float("nan")), r"init_std=nan is invalid"),
        (dict(sink_init=float("nan")), r"sink_init=nan is invalid: must be a finite number or -inf"),
        (dict(sink_init=float("inf")), r"sink_init=inf is invalid"),
        (dict(rope_scaling=RopeScaling(kind="linear", factor=2.0), norm_eps=True), r"norm_eps=True is invalid"),
        (dict(sliding_window=0), r"sliding_window=0 is invalid"),
        (dict(dtype="float8"), r"dtype='float8' is invalid: must be one of \('float32', 'bfloat16', 'float16'\)"),
        (dict(param_dtype="int8"), r"param_dtype='int8' is invalid"),
        (dict(attention="flashy"), r"attention='flashy' is invalid: must be one of \['affine_scaled', 'sink', 'softmax'\]"),
        (dict(mlp="gelu"), r"mlp='gelu' is invalid: must be one of \['meta_swiglu', 'swiglu'\]"),
        (dict(rope="yarn"), r"rope='yarn' is invalid: must be one of \['default', 'graph', 'mrope', 'none'\]"),
        (dict(affine_bias="both"), r"affine_bias='both' is invalid: must be 'free' or 'coupled'"),
        (dict(graph_rope_pairs=99), r"graph_rope_pairs=99 is invalid: must be in \[0, head_dim/2 = 8\]"),
        (dict(graph_rope_pairs=2.5), r"graph_rope_pairs=2.5 is invalid: must be an int or None"),
        (dict(graph_rope_pairs=True), r"graph_rope_pairs=True is invalid: must be an int or None"),
        (dict(family="gpt2"), r"family='gpt2' is invalid: must be one of \['llama', 'mistral', 'qwen2', 'qwen3'\]"),
        (dict(remat="some"), r"remat='some' is invalid"),
        (dict(qk_norm="yes"), r"qk_norm='yes' is invalid: must be a bool"),
        (dict(max_seq_len=0), r"max_seq_len=0 is invalid"),
        # the tiny preset's head_dim is 16, d_model 64, ffn_dim 128: the format's block must divide them
        (dict(kv_quant="mxfp4"), r"kv_quant='mxfp4' is invalid: needs qk_head_dim and v_head_dim divisible by its "
                                 r"block 32, got 16 and 16"),
        (dict(kv_quant="int4"), r"kv_quant='int4' is invalid: .* block 128"),
        (dict(qat_format="int4"), r"qat_format='int4' is invalid: needs projection input widths divisible by its "
                                  r"block 128, got \{'d_model': 64, 'o_proj input n_heads \* v_head_dim': 64\}"),
        (dict(qat_format="nvfp4", ffn_dim=120), r"qat_format='nvfp4' is invalid: .*\{'ffn_dim': 120\}"),
    ],
)
def test_bad_values_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.tiny(**changes)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="yarn"), r"RopeScaling.kind='yarn' is invalid: must be one of \('none', 'linear', 'llama3'\)"),
        (dict(kind="linear", factor=0.0), r"RopeScaling.factor=0.0 is invalid"),
        (dict(kind="linear", factor=float("nan")), r"RopeScaling.factor=nan is invalid: must be a finite number > 0"),
        (dict(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=float("inf")), r"high_freq_factor=inf"),
        (dict(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0), r"high_freq_factor=1.0 must be > low_freq_factor=4.0"),
    ],
)
def test_bad_rope_scaling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**kwargs)


@pytest.mark.parametrize("value, name", [
    ("bfloat16", "bfloat16"), (jax.numpy.float32, "float32"), (jax.numpy.bfloat16, "bfloat16"),
    (np.float16, "float16"), (np.dtype("float32"), "float32"), (jax.numpy.dtype("bfloat16"), "bfloat16"),
])
def test_dtype_fields_accept_jnp_and_numpy_dtypes_and_store_the_name(value, name):
    cfg = ModelConfig.tiny(dtype=value, param_dtype=value)
    assert cfg.dtype == name and cfg.param_dtype == name and isinstance(cfg.dtype, str)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg == ModelConfig.tiny(dtype=name, param_dtype=name)
    assert jaxlm.KVCache.init(cfg, 1, 4, value).k.dtype == np.dtype(name)


@pytest.mark.parametrize(
    "value",
    [np.float64, jax.numpy.int32, int, float, 3, "fp32", None, object(),
     # arrays and scalars are data, not dtypes (numpy would read their dtype)
     np.zeros(3, np.float32), jax.numpy.zeros((), jax.numpy.bfloat16), np.float32(1.0)],
)
def test_other_dtypes_get_the_same_clear_error(value):
    with pytest.raises(ValueError, match=r"ModelConfig.dtype=.* is invalid: must be one of \('float32', 'bfloat16', 'float16'\)"):
        ModelConfig.tiny(dtype=value)
    with pytest.raises(ValueError, match=r"KVCache dtype=.* is invalid"):
        jaxlm.KVCache.init(ModelConfig.tiny(), 1, 4, value if value is not None else "none")


def test_frozen_and_json_round_trip():
    cfg = ModelConfig.llama3_1_8b()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['hidden_size'\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "hidden_size": 3})


def test_replace_rederives_defaults():
    cfg = ModelConfig.tiny(n_kv_heads=None)
    wider = cfg.replace(d_model=128)
    assert wider.head_dim == 32
    more_heads = cfg.replace(n_heads=8)
    assert (more_heads.head_dim, more_heads.n_kv_heads) == (8, 8)
    pinned = ModelConfig.qwen3_0_6b().replace(d_model=2048)
    assert pinned.head_dim == 128  # explicit head_dim (not d_model / n_heads) stays


# Published parameter counts (model cards / safetensors index totals).
PUBLISHED = {
    "llama2_7b": 6_738_415_616,
    "llama3_8b": 8_030_261_248,
    "llama3_1_8b": 8_030_261_248,
    "qwen2_5_7b": 7_615_616_512,
    "qwen3_0_6b": 596_049_920,
    "qwen3_8b": 8_190_735_360,
    "mistral_7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_published_sizes(name):
    cfg = preset(name)
    assert cfg.num_params() == PUBLISHED[name]
    # the module builds exactly those parameters (abstractly: nothing is allocated)
    abstract = jaxlm.abstract_model(cfg.replace(scan_layers=True))
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == PUBLISHED[name]


@pytest.mark.parametrize("name", ["llama3_1_8b", "qwen2_5_7b", "qwen3_0_6b", "mistral_7b"])
def test_presets_export_to_transformers_configs(name):
    """config_to_hf(preset) builds the same-size model in transformers (meta device)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxlm.models.hf.configs import config_from_hf, config_to_hf
    from jaxlm.models.hf.families import FAMILIES

    cfg = preset(name)
    hf = config_to_hf(cfg, FAMILIES[cfg.family])
    hf_cfg = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert config_from_hf(hf) == cfg


def test_preset_lookup():
    assert preset("tiny", n_layers=3).n_layers == 3
    assert set(PRESETS) >= {"tiny", "llama2_7b", "llama3_8b", "llama3_1_8b", "qwen2_5_7b", "qwen3_0_6b", "qwen3_8b", "mistral_7b"}
    with pytest.raises(ValueError, match="unknown preset 'llama9'"):
        preset("llama9")


def test_quant_blocks_are_the_formats_own():
    from jaxlm.models.config import QUANT_BLOCKS
    from jaxlm.quant.formats import get_format

    assert QUANT_BLOCKS == {name: get_format(name).block for name in QUANT_BLOCKS}


@pytest.mark.parametrize("variant", [dict(attention="sink"), dict(attention="affine_scaled"),
                                     dict(mlp="meta_swiglu", meta_rank=8), dict(k_shift=True, qk_norm=True),
                                     dict(next_token_head=True, tie_embeddings=True, mode="diffusion", mask_token_id=258),
                                     dict(attention="sink", scan_layers=True)])
def test_num_params_counts_the_variants_parameters(variant):
    """num_params (printed by compression reports) equals the parameters the module builds."""
    from flax import nnx

    cfg = jaxlm.ModelConfig.tiny(n_layers=3, **variant)
    leaves = jax.tree.leaves(nnx.state(jaxlm.abstract_model(cfg), nnx.Param))
    assert cfg.num_params() == sum(int(np.prod(x.shape)) for x in leaves)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_omitted_config_keys_take_the_transformers_config_class_defaults(family):
    """A config.json that leaves out num_key_value_heads, head_dim, sliding_window or
    max_position_embeddings loads as transformers' own config class fills them in (a Mistral
    config without sliding_window is a 4096 window there, not full attention)."""
    import transformers

    from jaxlm.models.hf.configs import config_from_hf
    from jaxlm.models.hf.families import FAMILIES

    fam = FAMILIES[family]
    hf = {"architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": 300, "hidden_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 32, "intermediate_size": 128}
    ref = transformers.AutoConfig.for_model(fam.model_type, **{k: v for k, v in hf.items() if k != "model_type"})
    cfg = config_from_hf(dict(hf))
    assert cfg.n_kv_heads == ref.num_key_value_heads
    assert cfg.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert cfg.sliding_window == (getattr(ref, "sliding_window", None) if fam.sliding_window else None)
    assert cfg.max_seq_len == ref.max_position_embeddings
    if fam.sliding_window:  # an explicit null is no window, in both
        assert config_from_hf({**hf, "sliding_window": None}).sliding_window is None

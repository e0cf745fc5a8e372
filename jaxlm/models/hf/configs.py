"""HF ``config.json`` <-> `ModelConfig`, through the family tables of
`jaxlm.models.hf.families`."""

from __future__ import annotations

from typing import Any

from jaxlm.models.config import ModelConfig, RopeScaling
from jaxlm.models.hf import llada
from jaxlm.models.hf.families import Family, UnsupportedConfigError, family_for_architecture

_REQUIRED = object()


def _field(hf: dict[str, Any], name: str, default: Any = _REQUIRED, *, kind: type = int, where: str = "config.json"):
    """``hf[name]`` as ``kind`` (a missing or null entry: ``default``); an entry that is
    missing without a default, or not a number of that kind, raises naming the field."""
    value = hf.get(name)
    if value is None:
        if default is _REQUIRED:
            raise UnsupportedConfigError(f"{where} has no {name!r} field")
        return default
    number = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not number:
        raise UnsupportedConfigError(f"{where} field {name!r}={value!r} is not {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _rope_from_hf(hf: dict[str, Any]):
    params = hf.get("rope_parameters")
    where = "config.json rope_parameters"
    # transformers < 5 wrote rope_theta + rope_scaling; as transformers does, a non-empty
    # rope_scaling wins over rope_parameters (e.g. one added by hand to extend the context)
    legacy = hf.get("rope_scaling")
    if legacy or params is None:
        params, where = legacy or {}, "config.json rope_scaling"
        if isinstance(params, dict):
            params = {**params, "rope_theta": params.get("rope_theta", hf.get("rope_theta"))}
    if not isinstance(params, dict):
        raise UnsupportedConfigError(f"{where}={params!r} is not an object")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _field(params, "rope_theta", _field(hf, "rope_theta", 10_000.0, kind=float), kind=float, where=where)
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=_field(params, "factor", kind=float, where=where))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=_field(params, "factor", kind=float, where=where),
            low_freq_factor=_field(params, "low_freq_factor", kind=float, where=where),
            high_freq_factor=_field(params, "high_freq_factor", kind=float, where=where),
            # as transformers' from_pretrained (standardize_rope_params): a top-level
            # original_max_position_embeddings wins, then the rope dict's, then max_position_embeddings
            original_max_len=_field(hf, "original_max_position_embeddings",
                                    _field(params, "original_max_position_embeddings",
                                           _field(hf, "max_position_embeddings"), where=where)),
        )
    raise UnsupportedConfigError(
        f"rope type {kind!r} is not supported; supported: ['default', 'linear', 'llama3']"
    )


def config_from_hf(hf: dict[str, Any], **overrides: Any):
    """HF ``config.json`` dict -> `ModelConfig` (``overrides`` win, e.g. dtype)."""
    fam = family_for_architecture(hf.get("architectures"), hf.get("model_type"))
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # the same function in transformers' ACT2FN
        raise UnsupportedConfigError(f"hidden_act={act!r} is not supported; jaxlm implements 'silu'")
    # the options each transformers class reads (the others are ignored there, so here too):
    # Llama has MLP biases and q/k/v/o biases, Qwen3 q/k/v/o biases (Qwen2's q/k/v bias is
    # the family's own); Mistral's layers have no bias at all
    if fam.name == "llama" and hf.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias=True is not supported")
    if fam.name in ("llama", "qwen3") and hf.get("attention_bias"):
        raise UnsupportedConfigError(
            f"attention_bias=True ({fam.architecture}: biases on q/k/v and o) is not supported"
        )
    if fam.name in ("qwen2", "qwen3"):
        # as the config classes resolve it: layer_types when given, else layers i >=
        # max_window_layers slide when use_sliding_window is set and sliding_window is not null
        layer_types = hf.get("layer_types")
        if layer_types is None and hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
            layers = _field(hf, "num_hidden_layers")
            first = _field(hf, "max_window_layers", fam.hf_default("max_window_layers"))
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise UnsupportedConfigError(
                f"per-layer sliding windows on {fam.architecture} (use_sliding_window={hf.get('use_sliding_window')}, "
                f"layer_types={sorted(set(layer_types))}) are not supported")
    theta, scaling = _rope_from_hf(hf)
    n_heads = _field(hf, "num_attention_heads")
    d_model = _field(hf, "hidden_size")
    fields = dict(
        vocab_size=_field(hf, "vocab_size"),
        d_model=d_model,
        n_layers=_field(hf, "num_hidden_layers"),
        n_heads=n_heads,
        # an explicit null is n_heads (the config classes' __post_init__); a missing key the class default
        n_kv_heads=_field(hf, "num_key_value_heads", n_heads if "num_key_value_heads" in hf
                          else fam.hf_default("num_key_value_heads") or n_heads),
        head_dim=_field(hf, "head_dim", fam.hf_default("head_dim")) or (d_model // n_heads if n_heads > 0 else None),
        ffn_dim=_field(hf, "intermediate_size"),
        norm_eps=_field(hf, "rms_norm_eps", 1e-6, kind=float),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=fam.qkv_bias,
        qk_norm=fam.qk_norm,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # a missing key takes the config class's default (Mistral: 4096); an explicit null is no window
        sliding_window=(_field(hf, "sliding_window", None) if "sliding_window" in hf
                        else fam.hf_default("sliding_window")) if fam.sliding_window else None,
        max_seq_len=_field(hf, "max_position_embeddings", fam.hf_default("max_position_embeddings") or 2048),
        family=fam.name,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(config: ModelConfig, family: Family) -> dict[str, Any]:
    """`ModelConfig` -> HF ``config.json`` dict; raises if the family cannot express it."""
    problems = []
    if config.qkv_bias != family.qkv_bias:
        problems.append(f"qkv_bias={config.qkv_bias} (the family has {family.qkv_bias})")
    if config.qk_norm != family.qk_norm:
        problems.append(f"qk_norm={config.qk_norm} (the family has {family.qk_norm})")
    for name in ("qk_head_dim", "v_head_dim"):
        if getattr(config, name) != config.head_dim:
            problems.append(f"{name}={getattr(config, name)} != head_dim={config.head_dim} (compressed heads; "
                            "HF attention has one head width)")
    for name in ("layer_qk_head_dims", "layer_v_head_dims", "layer_ffn_dims"):
        if getattr(config, name) is not None:
            problems.append(f"{name}={getattr(config, name)} (per-layer widths from A^3 mixed ranks; HF configs "
                            "have one width for all layers)")
    if config.k_shift:
        problems.append("k_shift=True (HF attention has no post-RoPE key shift)")
    if config.qat_format is not None:
        problems.append(f"qat_format={config.qat_format!r} (the forward quantizes every projection's input; HF "
                        "runs them in float: export the quantized model with jaxlm.quant.qat_export.export_qat "
                        "and save it with jaxlm.save_checkpoint)")
    if config.kv_quant is not None:
        problems.append(f"kv_quant={config.kv_quant!r} (the forward quantizes keys and values; HF attention does "
                        "not: save it with jaxlm.save_checkpoint)")
    if config.sliding_window is not None and not family.sliding_window:
        problems.append(f"sliding_window={config.sliding_window} (the family has none)")
    for name, default in (("attention", "softmax"), ("mlp", "swiglu"), ("rope", "default")):
        if getattr(config, name) != default:
            problems.append(f"{name}={getattr(config, name)!r} (the family has {default!r})")
    if family.name == "llama" and config.d_model % config.n_heads:  # LlamaConfig refuses it when loaded
        problems.append(f"d_model={config.d_model} is not a multiple of n_heads={config.n_heads} (transformers' "
                        "LlamaConfig refuses it even with head_dim set; family='mistral' stores the same tensors)")
    if config.mode == "diffusion" and family.name != "llama":
        problems.append(f"mode='diffusion' with family={family.name!r} (a diffusion model is saved in the "
                        "Llama-named LLaDA layout: family='llama')")
    if problems:
        raise UnsupportedConfigError(
            f"this model cannot be saved as {family.architecture}: " + "; ".join(problems)
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    s = config.rope_scaling
    if s.kind == "linear":
        rope.update(rope_type="linear", factor=s.factor)
    elif s.kind == "llama3":
        rope.update(
            rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_len,
        )
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": rope,
        # transformers < 5 reads these two instead of rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_scaling": None if s.kind == "none" else {**rope, "type": rope["rope_type"]},
        "dtype": config.param_dtype,
        "torch_dtype": config.param_dtype,
        "initializer_range": config.init_std,
    }
    if config.mode == "diffusion":  # the Llama-named LLaDA layout `jaxlm.models.hf.llada` reads
        hf.update(architectures=list(llada.ARCHITECTURES[1:]), model_type="llada",
                  mask_token_id=config.mask_token_id)
        if config.delete_token_id is not None:
            hf["delete_token_id"] = config.delete_token_id
    if family.name in ("llama", "qwen3"):
        hf["attention_bias"] = False
    if family.name == "llama":
        hf["mlp_bias"] = False
    if family.name in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
    if family.name == "mistral":
        hf["sliding_window"] = config.sliding_window
    return hf

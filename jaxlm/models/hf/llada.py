"""LLaDA checkpoints (Nie et al. 2025) read as jaxlm diffusion models.

Two layouts occur:

* **LLaDA's own** (``architectures: ["LLaDAModelLM"]``, remote code derived from OLMo): config
  fields ``d_model``, ``n_layers``, ``n_heads``, ``n_kv_heads`` / ``multi_query_attention``,
  ``mlp_hidden_size`` / ``mlp_ratio``,
  ``embedding_size``, ``weight_tying``, ``rope_theta``, ``rms_norm_eps``, ``mask_token_id``;
  tensors under ``model.transformer.`` (``wte``, ``blocks.{i}.q_proj/k_proj/v_proj/attn_out``,
  ``attn_norm``, ``ff_norm``, ``ff_proj`` (gate), ``up_proj``, ``ff_out`` (down), ``ln_f`` and
  the LM head ``ff_out``). The architecture is Llama's with bidirectional attention.
* **Llama-named** (``architectures: ["LLaDAForCausalLM"]``, ``model_type: "llada"``, e.g.
  ME-DLM's converted checkpoints, and what `jaxlm.save_hf` writes for a diffusion model):
  Llama's config fields and tensor names, plus ME-DLM's ``next_token_head.weight`` when the
  model has the edit head (and its ``delete_token_id``).

`as_llama` rewrites the config to Llama's and `tensor_name` the tensor names, so `load_hf`
reads both through the Llama table; the model is ``mode="diffusion"`` with the checkpoint's
``mask_token_id`` (LLaDA's 126336 when absent) and ``next_token_head`` when the file has one.
"""

from __future__ import annotations

import re
from typing import Any

from jaxlm.models.hf.families import UnsupportedConfigError

ARCHITECTURES = ("LLaDAModelLM", "LLaDAForCausalLM")
#: LLaDA's [MASK] id (its tokenizer's), used when config.json does not name one
DEFAULT_MASK_TOKEN_ID = 126336

_BLOCK = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.weight$")
_BLOCK_NAMES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj", "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj",
}
_TOP_NAMES = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}


def is_llada(hf: dict[str, Any]) -> bool:
    archs = hf.get("architectures") or []
    return (isinstance(archs, list) and bool(archs) and archs[0] in ARCHITECTURES) or hf.get("model_type") == "llada"


def _native(hf: dict[str, Any]) -> bool:
    return "d_model" in hf or (hf.get("architectures") or [None])[0] == "LLaDAModelLM"


def as_llama(hf: dict[str, Any]) -> dict[str, Any]:
    """A LLaDA ``config.json`` as the equivalent ``LlamaForCausalLM`` one (unsupported
    options of LLaDA's own layout raise `UnsupportedConfigError` naming the field)."""
    if not _native(hf):
        return {**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    must = {"block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
            "alibi": False, "include_bias": False, "include_qkv_bias": False, "scale_logits": False,
            "input_emb_norm": False, "attention_layer_norm": False, "layer_norm_with_affine": True}
    for field, allowed in must.items():
        if field in hf and hf[field] is not None and hf[field] != allowed:
            raise UnsupportedConfigError(f"LLaDA config {field}={hf[field]!r} is not supported; jaxlm reads "
                                         f"{field}={allowed!r} (the Llama-style block)")
    try:
        n_heads = hf["n_heads"]
        out = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hf["d_model"], "num_hidden_layers": hf["n_layers"], "num_attention_heads": n_heads,
            "num_key_value_heads": _kv_heads(hf, n_heads),
            "intermediate_size": _mlp_width(hf),
            "vocab_size": hf.get("embedding_size") or hf["vocab_size"],
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-5), "rope_theta": hf.get("rope_theta", 10_000.0),
            "max_position_embeddings": hf.get("max_sequence_length", 4096),
            "tie_word_embeddings": bool(hf.get("weight_tying", False)), "hidden_act": "silu",
        }
    except KeyError as e:
        raise UnsupportedConfigError(f"LLaDA config.json has no {e.args[0]!r} field") from None
    for key in ("torch_dtype", "dtype", "mask_token_id", "eos_token_id", "pad_token_id"):
        if key in hf:
            out[key] = hf[key]
    return out


def _kv_heads(hf: dict[str, Any], n_heads: int) -> int:
    """OLMo's effective K/V heads: ``n_kv_heads``, or with it unset 1 under
    ``multi_query_attention`` and ``n_heads`` otherwise (the two must agree when both are set)."""
    n_kv, mqa = hf.get("n_kv_heads"), hf.get("multi_query_attention")
    if n_kv is None:
        return 1 if mqa is True else n_heads
    if mqa is not None and n_kv != (1 if mqa else n_heads):
        raise UnsupportedConfigError(f"LLaDA config n_kv_heads={n_kv} contradicts multi_query_attention={mqa} "
                                     f"(which means {1 if mqa else n_heads} K/V heads)")
    return n_kv


def _mlp_width(hf: dict[str, Any]) -> int:
    """OLMo's MLP width: ``mlp_hidden_size``, else ``mlp_ratio * d_model`` (ratio 4 by default)."""
    if hf.get("mlp_hidden_size") is not None:
        return hf["mlp_hidden_size"]
    ratio = hf.get("mlp_ratio", 4)
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise UnsupportedConfigError(f"LLaDA config has no mlp_hidden_size and mlp_ratio={ratio!r} is not a "
                                     "positive int")
    return ratio * hf["d_model"]


def tensor_name(name: str) -> str:
    """A LLaDA tensor name as the Llama (or ME-DLM next-head) name; others unchanged."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
    return name


def diffusion_overrides(hf: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """The `ModelConfig` fields that make the Llama reading a LLaDA model."""
    mask = hf.get("mask_token_id", DEFAULT_MASK_TOKEN_ID)
    out = {"mode": "diffusion", "mask_token_id": int(mask),
           "next_token_head": "next_token_head.weight" in tensor_names}
    if hf.get("delete_token_id") is not None:  # written by `jaxlm.save_hf` for an edit model
        out["delete_token_id"] = int(hf["delete_token_id"])
    return out

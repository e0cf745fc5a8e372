"""One table per HuggingFace family: tensor names and config fields.

A table row is ``(hf_name, jaxlm_name, transpose)`` where ``{i}`` stands for the
layer index. jaxlm names are the model's parameter paths with the layer index
spelled out (``layers.3.attn.q_proj.kernel``); HF linear weights are ``[out, in]``
and jaxlm kernels ``[in, out]``, hence ``transpose``. Both directions (load and
save) are compiled from the same rows.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from jaxlm.models.config import HF_FAMILIES

Row = tuple[str, str, bool]

_LLAMA_ROWS: tuple[Row, ...] = (
    ("model.embed_tokens.weight", "embed", False),
    ("model.norm.weight", "final_norm.scale", False),
    ("lm_head.weight", "lm_head.kernel", True),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.scale", False),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.scale", False),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attn.q_proj.kernel", True),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attn.k_proj.kernel", True),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attn.v_proj.kernel", True),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attn.o_proj.kernel", True),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj.kernel", True),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj.kernel", True),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.kernel", True),
    # ME-DLM's next-token head of a diffusion edit model (`jaxlm.models.hf.llada`)
    ("next_token_head.weight", "next_head.kernel", True),
)
_QKV_BIAS_ROWS: tuple[Row, ...] = (
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.attn.q_proj.bias", False),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.attn.k_proj.bias", False),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.attn.v_proj.bias", False),
)
_QK_NORM_ROWS: tuple[Row, ...] = (
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attn.q_norm.scale", False),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attn.k_norm.scale", False),
)
# Buffers some exporters write; they carry no weights.
_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    model_type: str
    rows: tuple[Row, ...]
    qkv_bias: bool  # the family's attention has q/k/v biases
    qk_norm: bool
    sliding_window: bool  # the family applies a uniform sliding window
    # transformers' config-class defaults for keys a config.json may omit (None: computed)
    hf_defaults: tuple[tuple[str, Any], ...] = ()

    def hf_default(self, key: str) -> Any:
        return dict(self.hf_defaults).get(key)

    def _compile(self, src: int, dst: int):
        out = []
        for row in self.rows:
            pattern = re.escape(row[src]).replace(r"\{i\}", r"(?P<i>\d+)")
            out.append((re.compile(pattern + "$"), row[dst], row[2]))
        return tuple(out)

    @functools.cached_property
    def _from_hf(self):
        return self._compile(0, 1)

    @functools.cached_property
    def _from_jaxlm(self):
        return self._compile(1, 0)

    @staticmethod
    def _lookup(table, name: str) -> tuple[str, bool] | None:
        for pattern, target, transpose in table:
            m = pattern.match(name)
            if m:
                return target.replace("{i}", m.groupdict().get("i") or ""), transpose
        return None

    def to_jaxlm(self, hf_name: str) -> tuple[str, bool] | None:
        """HF tensor name -> (jaxlm name, transpose), or None if not in the table."""
        return self._lookup(self._from_hf, hf_name)

    def to_hf(self, name: str) -> tuple[str, bool] | None:
        """jaxlm parameter name -> (HF tensor name, transpose), or None."""
        return self._lookup(self._from_jaxlm, name)

    def ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in _IGNORED)


FAMILIES: dict[str, Family] = {  # keyed by `jaxlm.models.config.HF_FAMILIES`
    "llama": Family("llama", "LlamaForCausalLM", "llama", _LLAMA_ROWS, False, False, False,
                    (("max_position_embeddings", 2048),)),
    "mistral": Family("mistral", "MistralForCausalLM", "mistral", _LLAMA_ROWS, False, False, True,
                      (("num_key_value_heads", 8), ("sliding_window", 4096), ("max_position_embeddings", 131072))),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "qwen2", _LLAMA_ROWS + _QKV_BIAS_ROWS, True, False, False,
                    (("num_key_value_heads", 32), ("max_position_embeddings", 32768), ("max_window_layers", 28))),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "qwen3", _LLAMA_ROWS + _QK_NORM_ROWS, False, True, False,
                    (("num_key_value_heads", 32), ("head_dim", 128), ("max_position_embeddings", 32768),
                     ("max_window_layers", 28))),
}
ARCHITECTURES: dict[str, str] = {f.architecture: f.name for f in FAMILIES.values()}
if sorted(FAMILIES) != sorted(HF_FAMILIES):
    raise ImportError(f"FAMILIES {sorted(FAMILIES)} must match ModelConfig's HF_FAMILIES {sorted(HF_FAMILIES)}")


class UnsupportedConfigError(ValueError):
    pass


def family_for_architecture(architectures: Any, model_type: Any = None) -> Family:
    """The family of config.json's ``architectures`` (its first entry); without that key, the
    family whose ``model_type`` it names (as transformers' Auto classes read such a config)."""
    if architectures is None and isinstance(model_type, str):
        by_type = [f for f in FAMILIES.values() if f.model_type == model_type]
        if by_type:
            return by_type[0]
    if not architectures or not isinstance(architectures, list):
        raise UnsupportedConfigError(
            f"config.json 'architectures'={architectures!r} is invalid: expected a list "
            f"naming one of {sorted(ARCHITECTURES)}"
        )
    arch = architectures[0]
    if arch not in ARCHITECTURES:
        raise UnsupportedConfigError(
            f"architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return FAMILIES[ARCHITECTURES[arch]]

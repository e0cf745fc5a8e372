"""`ModelConfig`: the one frozen, validated description of a decoder-only transformer.

Variants are config fields, not subclasses: ``attention``, ``mlp`` and ``rope`` are
string keys into the layer registries (`jaxlm.models.layers`), RoPE frequency
scaling is a nested `RopeScaling`, and the HF family a model came from (or is
exported to) is a plain string. Every field is checked on construction and a bad
value raises ``ValueError`` naming the field, the value and what is allowed.

Presets give the published shapes of common checkpoints (nothing downloads):
``ModelConfig.llama3_8b()``, ``ModelConfig.qwen3_0_6b()`` ... and ``tiny()`` for tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

import jax.numpy as jnp

from jaxlm.dtypes import dtype_name
from jaxlm.models.layers import ATTENTION, MLP, ROPE
from jaxlm.models.layers.attention import ATTENTION_IMPLS

_ROPE_SCALINGS = ("none", "linear", "llama3")
#: the HuggingFace families a model maps to (their tables: `jaxlm.models.hf.families`)
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_REMAT = ("none", "full", "dots")
#: ``ModelConfig.mode``: a left-to-right decoder, or a masked diffusion LM (LLaDA)
MODES = ("causal", "diffusion")
#: per-layer field -> the scalar field it overrides
#: the block (group) size of each ``qat_format`` / ``kv_quant`` format (`jaxlm.quant.formats`)
QUANT_BLOCKS = {"mxfp4": 32, "nvfp4": 16, "int4": 128, "e1m2": 16}
_LAYER_FIELDS = {"layer_qk_head_dims": "qk_head_dim", "layer_v_head_dims": "v_head_dim", "layer_ffn_dims": "ffn_dim"}


def _err(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"ModelConfig.{field}={value!r} is invalid: {allowed}")


def _check_positive_int(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{field}={value!r} is invalid: must be a positive int")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in HF ``rope_parameters`` / ``rope_scaling``.

    kind: ``"none"``; ``"linear"`` (position interpolation, Chen et al. 2023: every
      inverse frequency divided by ``factor``); ``"llama3"`` (Llama 3.1: wavelengths
      longer than ``original_max_len / low_freq_factor`` are divided by ``factor``,
      those shorter than ``original_max_len / high_freq_factor`` are kept, and the
      band between is interpolated smoothly).
    """

    kind: str = "none"
    """none | linear | llama3."""
    factor: float = 1.0
    """linear / llama3: the scaling factor."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_len / low_freq_factor are scaled."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_len / high_freq_factor are kept."""
    original_max_len: int = 8192
    """llama3: the context length the model was pretrained at."""

    def __post_init__(self):
        if self.kind not in _ROPE_SCALINGS:
            raise ValueError(
                f"RopeScaling.kind={self.kind!r} is invalid: must be one of {_ROPE_SCALINGS}"
            )
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not 0 < self.factor < math.inf:
            raise ValueError(f"RopeScaling.factor={self.factor!r} is invalid: must be a finite number > 0")
        if self.kind == "llama3":
            if not math.inf > self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError(
                    "RopeScaling.high_freq_factor="
                    f"{self.high_freq_factor!r} must be > low_freq_factor={self.low_freq_factor!r}"
                    " > 0 for kind='llama3'"
                )
            _check_positive_int("RopeScaling", "original_max_len", self.original_max_len)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama/Qwen/Mistral-family decoder.

    Field names follow the paper-level quantities: ``d_model`` (hidden size),
    ``n_heads`` query heads, ``n_kv_heads`` key/value heads (GQA when smaller,
    MQA when 1), ``head_dim`` (defaults to ``d_model // n_heads``), ``ffn_dim``
    (SwiGLU inner width).
    """

    vocab_size: int = 256
    """Rows of the embedding and the LM head (at least the tokenizer's vocabulary)."""
    d_model: int = 64
    """Width of the residual stream (HF hidden_size)."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads: fewer than n_heads is GQA, 1 is MQA (None: n_heads, plain multi-head)."""
    head_dim: int | None = None
    """Width of each head (None: d_model // n_heads)."""
    qk_head_dim: int | None = None
    """Query/key width per head (None: head_dim; smaller after A^3-QK compression)."""
    v_head_dim: int | None = None
    """Value width per head (None: head_dim; smaller after A^3-OV compression)."""
    ffn_dim: int = 128
    """SwiGLU inner width (HF intermediate_size)."""
    layer_qk_head_dims: tuple[int, ...] | None = None
    """Per-layer query/key widths (A^3 with mixed ranks; unrolled layers only): None = every
    layer uses qk_head_dim. `layer_config` is the view each Block is built from, and the KV
    cache then stores keys/values per layer."""
    layer_v_head_dims: tuple[int, ...] | None = None
    """Per-layer value widths (as layer_qk_head_dims; None = every layer uses v_head_dim)."""
    layer_ffn_dims: tuple[int, ...] | None = None
    """Per-layer MLP widths (as layer_qk_head_dims; None = every layer uses ffn_dim)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10_000.0
    """RoPE base: inverse frequencies theta^(-2i/head_dim)."""
    rope_scaling: RopeScaling = RopeScaling()
    """RoPE frequency scaling (linear position interpolation, Llama 3.1)."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """The LM head is the transposed embedding."""
    sliding_window: int | None = None
    """Each query sees at most this many latest keys (Mistral); None: full causal attention."""
    max_seq_len: int = 2048
    """Longest sequence (prompt + generated tokens) the model and its KV cache hold."""
    dtype: str = "float32"
    """Compute dtype: float32 | bfloat16 | float16 (a jnp/numpy dtype is accepted and stored by name)."""
    param_dtype: str = "float32"
    """Weight dtype (as dtype)."""
    attention: str = "softmax"
    """Attention variant: softmax | affine_scaled | sink."""
    attention_impl: str = "auto"
    """How softmax attention computes its context when nothing asks for the probabilities:
    auto | reference | chunked | xla | cudnn."""
    mlp: str = "swiglu"
    """MLP variant: swiglu | meta_swiglu (MeGan)."""
    rope: str = "default"
    """Position encoding: default (RoPE) | none | graph (Weaver's two-axis RoPE) | mrope
    (Qwen2-VL / Qwen2.5-Omni three-axis RoPE over time, height, width)."""
    # Variant options (read only by the variant that names them):
    affine_bias: str = "free"
    """affine_scaled: free per-head bias b_i, or coupled b_i = (1 - s_i) / n_i."""
    affine_scale_act: str = "sigmoid2"
    """affine_scaled: s_i = 2 sigmoid(z) (sigmoid2) or exp(z); both 1 at z = 0."""
    sink_init: float = 0.0
    """sink: initial per-head sink logit."""
    meta_rank: int = 64
    """meta_swiglu: width r of the hypernetwork's cross-attention."""
    graph_rope_pairs: int | None = None
    """graph: frequency pairs driven by the graph coordinate."""
    graph_rope_band: str = "low"
    """graph: those pairs are the lowest (low) or highest (high) frequencies."""
    mrope_section: tuple[int, ...] | None = None
    """mrope: frequency pairs per axis (time, height, width), summing to head_dim/2, in pair
    order (None: a quarter for time, the rest split between height and width, as Qwen2.5-Omni's
    [16, 24, 24] at head_dim 128)."""
    qat_format: str | None = None
    """Quantization-aware training: fake-quantize attention/MLP projections (inputs and
    weights, straight-through) in this format (mxfp4 | nvfp4 | int4 | e1m2)."""
    kv_quant: str | None = None
    """Fake-quantize post-RoPE keys and values in this format (a simulated low-bit KV cache)."""
    k_shift: bool = False
    """A per-layer post-RoPE key shift parameter [n_kv_heads, qk_head_dim] (Q-FIT)."""
    k_shift_trainable: bool = False
    """Train the key shift (default frozen: ReQAT applies a fixed calibrated shift)."""
    scan_layers: bool = False
    """Stack the blocks' parameters [L, ...] and run them with lax.scan (compile time independent of depth)."""
    remat: str = "none"
    """Rematerialise each block in the backward pass: none | full | dots (keep matmul outputs)."""
    family: str = "llama"
    """HF family this model maps to: llama | qwen2 | qwen3 | mistral."""
    mode: str = "causal"
    """causal (next-token decoder) | diffusion (masked diffusion LM, LLaDA: attention is
    bidirectional by default and mask_token_id marks the noised positions)."""
    mask_token_id: int | None = None
    """diffusion: the [MASK] id (required; < vocab_size)."""
    next_token_head: bool = False
    """diffusion: a second LM head beside the current-token one whose logits at position i
    predict the token to insert after i (ME-DLM's edit model); ``ModelOutput.next_logits``."""
    delete_token_id: int | None = None
    """next_token_head: the id the current-token head predicts for a token to delete (ME-DLM's
    ``<|del|>``; < vocab_size, not mask_token_id); needed by edit decoding and edit training."""
    init_std: float = 0.02
    """Standard deviation of the random initial weights."""

    def __post_init__(self):
        # Resolve the derived defaults first so every later check sees concrete values.
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            if isinstance(self.d_model, int) and isinstance(self.n_heads, int) and self.n_heads > 0:
                if self.d_model % self.n_heads:
                    raise ValueError(
                        f"ModelConfig.d_model={self.d_model} is not divisible by "
                        f"n_heads={self.n_heads}; set head_dim explicitly"
                    )
                object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        for name in ("qk_head_dim", "v_head_dim"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.head_dim)
        for name in ("dtype", "param_dtype"):  # a name, a jnp or a numpy dtype -> its name
            object.__setattr__(self, name, dtype_name(getattr(self, name), field=f"ModelConfig.{name}"))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in _LAYER_FIELDS:  # JSON gives lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()
        self._validate_layer_dims()

    def validate(self) -> None:
        for name in (
            "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
            "qk_head_dim", "v_head_dim", "ffn_dim", "max_seq_len",
        ):
            _check_positive_int("ModelConfig", name, getattr(self, name))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise _err("head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        if self.qk_head_dim % 2 and self.rope != "none":
            raise _err("qk_head_dim", self.qk_head_dim, "must be even with RoPE (it rotates pairs)")
        if self.qk_head_dim != self.head_dim:
            if self.rope != "none" and self.qk_head_dim > self.head_dim:
                raise _err("qk_head_dim", self.qk_head_dim,
                           f"must be <= head_dim={self.head_dim} with RoPE (the kept pairs are a subset)")
            if self.rope not in ("default", "none"):
                raise _err("qk_head_dim", self.qk_head_dim,
                           f"must equal head_dim={self.head_dim} with rope={self.rope!r} (compressed "
                           "query/key heads support rope='default' or 'none')")
            if self.qk_norm:
                raise _err("qk_head_dim", self.qk_head_dim,
                           f"must equal head_dim={self.head_dim} with qk_norm=True (the norm is over head_dim)")
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise _err(name, value, "must be a finite number > 0")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise _err("rope_scaling", self.rope_scaling, "must be a RopeScaling")
        if self.sliding_window is not None:
            _check_positive_int("ModelConfig", "sliding_window", self.sliding_window)
        for name in ("dtype", "param_dtype"):
            dtype_name(getattr(self, name), field=f"ModelConfig.{name}")
        if self.affine_bias not in ("free", "coupled"):
            raise _err("affine_bias", self.affine_bias, "must be 'free' or 'coupled'")
        if self.affine_scale_act not in ("sigmoid2", "exp"):
            raise _err("affine_scale_act", self.affine_scale_act, "must be 'sigmoid2' or 'exp'")
        _check_positive_int("ModelConfig", "meta_rank", self.meta_rank)
        if isinstance(self.sink_init, bool) or not isinstance(self.sink_init, (int, float)) \
                or not -math.inf <= self.sink_init < math.inf:
            raise _err("sink_init", self.sink_init, "must be a finite number or -inf (no sink: plain softmax)")
        if self.graph_rope_pairs is not None and (isinstance(self.graph_rope_pairs, bool)
                                                  or not isinstance(self.graph_rope_pairs, int)):
            raise _err("graph_rope_pairs", self.graph_rope_pairs, "must be an int or None")
        if self.graph_rope_pairs is not None and not 0 <= self.graph_rope_pairs <= self.head_dim // 2:
            raise _err("graph_rope_pairs", self.graph_rope_pairs, f"must be in [0, head_dim/2 = {self.head_dim // 2}]")
        if self.graph_rope_band not in ("low", "high"):
            raise _err("graph_rope_band", self.graph_rope_band, "must be 'low' or 'high'")
        if self.mrope_section is not None:
            if isinstance(self.mrope_section, list):
                object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
            sec = self.mrope_section
            if (not isinstance(sec, tuple) or len(sec) != 3 or any(isinstance(v, bool) or not isinstance(v, int)
                                                                  or v < 0 for v in sec)
                    or sum(sec) != self.head_dim // 2):
                raise _err("mrope_section", sec, f"must be 3 ints >= 0 (time, height, width) summing to head_dim/2 = "
                           f"{self.head_dim // 2}")
        quant_formats = ("mxfp4", "nvfp4", "int4", "e1m2")
        for name in ("qat_format", "kv_quant"):
            if getattr(self, name) is not None and getattr(self, name) not in quant_formats:
                raise _err(name, getattr(self, name), f"must be None or one of {quant_formats}")
        if self.kv_quant is not None:  # keys and values are quantized in blocks along the head
            block = QUANT_BLOCKS[self.kv_quant]
            if self.qk_head_dim % block or self.v_head_dim % block:
                raise _err("kv_quant", self.kv_quant, f"needs qk_head_dim and v_head_dim divisible by its block "
                           f"{block}, got {self.qk_head_dim} and {self.v_head_dim}")
        if self.qat_format is not None:  # every projection's input is quantized in blocks
            block = QUANT_BLOCKS[self.qat_format]
            inputs = {"d_model": self.d_model, "o_proj input n_heads * v_head_dim": self.o_dim,
                      "ffn_dim": self.ffn_dim}
            bad = {k: v for k, v in inputs.items() if v % block}
            if bad:
                raise _err("qat_format", self.qat_format, f"needs projection input widths divisible by its block "
                           f"{block}, got {bad}")
        if self.remat not in _REMAT:
            raise _err("remat", self.remat, f"must be one of {_REMAT}")
        for name in ("qkv_bias", "qk_norm", "tie_embeddings", "scan_layers", "k_shift", "k_shift_trainable"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, getattr(self, name), "must be a bool")
        if self.k_shift_trainable and not self.k_shift:
            raise _err("k_shift_trainable", self.k_shift_trainable, "needs k_shift=True (there is no shift to train)")
        for name, registry in (("attention", ATTENTION), ("mlp", MLP), ("rope", ROPE)):
            if getattr(self, name) not in registry:
                raise _err(name, getattr(self, name), f"must be one of {sorted(registry)}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise _err("attention_impl", self.attention_impl, f"must be one of {ATTENTION_IMPLS}")
        if self.family not in HF_FAMILIES:
            raise _err("family", self.family, f"must be one of {sorted(HF_FAMILIES)}")
        if self.mode not in MODES:
            raise _err("mode", self.mode, f"must be one of {MODES}")
        if not isinstance(self.next_token_head, bool):
            raise _err("next_token_head", self.next_token_head, "must be a bool")
        if self.mode == "diffusion":
            m = self.mask_token_id
            if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < self.vocab_size:
                raise _err("mask_token_id", m, f"must be an int in [0, vocab_size={self.vocab_size}) with "
                           "mode='diffusion'")
            if self.sliding_window is not None:
                raise _err("sliding_window", self.sliding_window, "must be None with mode='diffusion' "
                           "(attention is bidirectional)")
            d = self.delete_token_id
            if d is not None:
                if not self.next_token_head:
                    raise _err("delete_token_id", d, "needs next_token_head=True (ME-DLM's edit model)")
                if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < self.vocab_size or d == m:
                    raise _err("delete_token_id", d, f"must be an int in [0, vocab_size={self.vocab_size}) other "
                               f"than mask_token_id={m}")
        else:
            if self.mask_token_id is not None:
                raise _err("mask_token_id", self.mask_token_id, "is only used with mode='diffusion'")
            if self.next_token_head:
                raise _err("next_token_head", True, "needs mode='diffusion' (ME-DLM's edit model)")
            if self.delete_token_id is not None:
                raise _err("delete_token_id", self.delete_token_id, "is only used with mode='diffusion'")

    def _validate_layer_dims(self) -> None:
        """Per-layer widths: a tuple of ``n_layers`` values, each valid where the scalar field is."""
        for name, scalar in _LAYER_FIELDS.items():
            values = getattr(self, name)
            if values is None:
                continue
            if not isinstance(values, tuple) or len(values) != self.n_layers:
                raise _err(name, values, f"must be None or a tuple of n_layers={self.n_layers} ints")
            if self.scan_layers:
                raise _err(name, values, "needs scan_layers=False (scanned layers share one shape; per-layer "
                           "widths need unrolled layers)")
            if name == "layer_ffn_dims" and self.mlp != "swiglu":
                raise _err(name, values, f"needs mlp='swiglu' (mlp={self.mlp!r} shares ffn_dim-wide weights "
                           "across layers)")
            for i, v in enumerate(values):
                try:
                    dataclasses.replace(self, **{n: None for n in _LAYER_FIELDS}, **{scalar: v})
                except ValueError as e:
                    raise ValueError(f"ModelConfig.{name}[{i}]={v!r} is invalid: {e}") from None
        if self.per_layer_dims:
            for i in range(self.n_layers):
                try:
                    self.layer_config(i)
                except ValueError as e:
                    raise ValueError(f"ModelConfig per-layer widths of layer {i} are invalid together: {e}") from None

    @property
    def per_layer_dims(self) -> bool:
        """Some width differs per layer (``layer_qk_head_dims`` / ``layer_v_head_dims`` /
        ``layer_ffn_dims`` set)."""
        return any(getattr(self, name) is not None for name in _LAYER_FIELDS)

    @property
    def per_layer_kv(self) -> bool:
        """Key or value widths are per layer: the KV cache holds one array per layer."""
        return self.layer_qk_head_dims is not None or self.layer_v_head_dims is not None

    def layer_config(self, layer: int) -> "ModelConfig":
        """The uniform config layer ``layer`` is built from (``self`` without per-layer widths)."""
        if not self.per_layer_dims:
            return self
        widths = {scalar: getattr(self, name)[layer] for name, scalar in _LAYER_FIELDS.items()
                  if getattr(self, name) is not None}
        return dataclasses.replace(self, **{name: None for name in _LAYER_FIELDS}, **widths)

    # ---------------------------------------------------------------- derived
    @property
    def q_dim(self) -> int:
        """Width of the queries (q_proj output): ``n_heads * qk_head_dim``."""
        return self.n_heads * self.qk_head_dim

    @property
    def k_dim(self) -> int:
        """Width of the keys (k_proj output): ``n_kv_heads * qk_head_dim``."""
        return self.n_kv_heads * self.qk_head_dim

    @property
    def v_dim(self) -> int:
        """Width of the values (v_proj output): ``n_kv_heads * v_head_dim``."""
        return self.n_kv_heads * self.v_head_dim

    @property
    def o_dim(self) -> int:
        """Width of the attention context (o_proj input): ``n_heads * v_head_dim``."""
        return self.n_heads * self.v_head_dim

    @property
    def kv_dim(self) -> int:
        """Width of keys and of values when they agree (``k_dim == v_dim``)."""
        if self.k_dim != self.v_dim:
            raise ValueError(
                f"ModelConfig.kv_dim is ambiguous: qk_head_dim={self.qk_head_dim} != "
                f"v_head_dim={self.v_head_dim}; use k_dim / v_dim"
            )
        return self.k_dim

    @property
    def rope_pairs_selected(self) -> bool:
        """Compressed query/key heads under RoPE: each layer stores the frequencies of the
        pairs it kept (`jaxlm.models.layers.rope.RopeFrequencies`)."""
        return self.rope != "none" and self.qk_head_dim != self.head_dim

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (and validated).

        Derived defaults follow their sources: when ``head_dim`` was ``d_model // n_heads``
        and either changes, it is re-derived; likewise ``n_kv_heads == n_heads``.
        Pass them explicitly to pin them.
        """
        if "head_dim" not in changes and ({"d_model", "n_heads"} & changes.keys()):
            if self.head_dim == self.d_model // self.n_heads:
                changes["head_dim"] = None
        if "head_dim" in changes:
            for name in ("qk_head_dim", "v_head_dim"):
                if name not in changes and getattr(self, name) == self.head_dim:
                    changes[name] = None
        if "n_kv_heads" not in changes and "n_heads" in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        d, l = self.d_model, self.n_layers
        attn = d * (self.q_dim + self.k_dim + self.v_dim) + self.o_dim * d
        if self.qkv_bias:
            attn += self.q_dim + self.k_dim + self.v_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.k_shift:
            attn += self.k_dim
        if self.attention == "sink":  # one sink logit per head
            attn += self.n_heads
        elif self.attention == "affine_scaled":  # the per-head scale and bias projections
            attn += 2 * d * self.n_heads
        mlp = 3 * d * self.ffn_dim
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        head += self.vocab_size * d if self.next_token_head else 0
        if self.mlp == "meta_swiglu":  # MeGan's hypernetwork, shared by every layer
            head += 3 * d * self.meta_rank + l * self.meta_rank + self.meta_rank * self.ffn_dim
        total = self.vocab_size * d + l * per_layer + d + head
        if self.per_layer_dims:  # every layer with its own widths
            outer = total - l * per_layer
            return outer + sum((self.layer_config(i).num_params() - outer) // l for i in range(l))
        return total

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}"
            )
        data = dict(data)
        if isinstance(data.get("rope_scaling"), dict):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))

    def diff(self, other: "ModelConfig") -> dict[str, tuple[Any, Any]]:
        """Fields that differ: ``{name: (self_value, other_value)}``."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    # ---------------------------------------------------------------- presets
    @classmethod
    def tiny(cls, **overrides: Any) -> "ModelConfig":
        """A few-hundred-kB model for tests: GQA, untied, 2 layers."""
        base = dict(
            vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
            max_seq_len=256,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def llama2_7b(cls, **overrides: Any) -> "ModelConfig":
        base = dict(
            vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
            ffn_dim=11008, norm_eps=1e-5, rope_theta=10_000.0, max_seq_len=4096, family="llama",
        )
        return cls(**{**base, **overrides})

    @classmethod
    def llama3_8b(cls, **overrides: Any) -> "ModelConfig":
        base = dict(
            vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
            ffn_dim=14336, norm_eps=1e-5, rope_theta=500_000.0, max_seq_len=8192, family="llama",
        )
        return cls(**{**base, **overrides})

    @classmethod
    def llama3_1_8b(cls, **overrides: Any) -> "ModelConfig":
        scaling = RopeScaling(
            kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_len=8192,
        )
        return cls.llama3_8b(**{"rope_scaling": scaling, "max_seq_len": 131072, **overrides})

    @classmethod
    def qwen2_5_7b(cls, **overrides: Any) -> "ModelConfig":
        base = dict(
            vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
            ffn_dim=18944, norm_eps=1e-6, rope_theta=1_000_000.0, qkv_bias=True,
            max_seq_len=32768, family="qwen2",
        )
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_0_6b(cls, **overrides: Any) -> "ModelConfig":
        base = dict(
            vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
            ffn_dim=3072, norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
            tie_embeddings=True, max_seq_len=40960, family="qwen3",
        )
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_8b(cls, **overrides: Any) -> "ModelConfig":
        base = dict(
            vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
            ffn_dim=12288, norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
            max_seq_len=40960, family="qwen3",
        )
        return cls(**{**base, **overrides})

    @classmethod
    def mistral_7b(cls, **overrides: Any) -> "ModelConfig":
        base = dict(
            vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
            ffn_dim=14336, norm_eps=1e-5, rope_theta=10_000.0, sliding_window=4096,
            max_seq_len=32768, family="mistral",
        )
        return cls(**{**base, **overrides})


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": ModelConfig.tiny,
    "llama2_7b": ModelConfig.llama2_7b,
    "llama3_8b": ModelConfig.llama3_8b,
    "llama3_1_8b": ModelConfig.llama3_1_8b,
    "qwen2_5_7b": ModelConfig.qwen2_5_7b,
    "qwen3_0_6b": ModelConfig.qwen3_0_6b,
    "qwen3_8b": ModelConfig.qwen3_8b,
    "mistral_7b": ModelConfig.mistral_7b,
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """``preset("qwen3_0_6b", n_layers=2)``: a named preset with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name](**overrides)

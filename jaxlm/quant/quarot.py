"""QuaRot-style rotations folded into the weights (Ashkboos et al. 2024, arXiv 2404.00456).

A pre-norm decoder computes ``x_{l+1} = x_l + f_l(RMSNorm_w(x_l))``. Three steps, each a
``model -> model`` function that returns a new model computing the same function (exact in
real arithmetic; float32 rounding only):

1. `fuse_norms` (QuaRot 3, "computational invariance"): ``RMSNorm_w(x) W = RMSNorm_1(x)
   (diag(w) W)``, so each norm weight moves into the rows of the kernels that read the norm's
   output (``attn_norm`` -> q/k/v, ``mlp_norm`` -> gate/up, ``final_norm`` -> LM head) and the
   norm weights become 1. A tied model is untied first (the final norm cannot be folded into
   the shared embedding matrix): the result has ``tie_embeddings=False`` and an explicit
   ``lm_head = diag(w_final) E^T``.
2. `rotate_residual` (QuaRot eq. 1-2): for orthogonal ``Q [D, D]``, a unit-weight RMSNorm
   commutes with ``Q`` (``||x Q|| = ||x||``), so the whole residual stream may live in the
   basis ``x Q``: ``E -> E Q``; residual readers (q/k/v, gate/up, LM head) ``W -> Q^T W``;
   residual writers (o_proj, down_proj) ``W -> W Q`` (a bias ``b -> b Q``). Needs unit
   norm weights (run `fuse_norms` first).
3. `rotate_heads` (QuaRot 4, the fused per-head Hadamard on V/O): ``v_proj``'s output
   columns of every KV head ``-> W_v,h H`` and ``o_proj``'s input rows of every query head
   ``-> H^T W_o,n``. Attention mixes values linearly per head, so the context of each head
   is rotated by ``H`` and undone in ``o_proj`` (exact; also for the ``sink`` and
   ``affine_scaled`` variants, whose outputs are linear in ``v``).

`quarot_transform` = 1 + 2 + 3. `quarot_quantize` then runs W4A4 RTN on every projection
of the rotated model, except ``down_proj``, whose online Hadamard (QuaRot 4, applied to the
``mlp_act`` activations at run time) is emulated by the per-block shared Hadamard
(`jaxlm.quant.w4a4`, method ``"hadamard"``; a block-diagonal, not a full-width, Hadamard).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.transformer import abstract_model
from jaxlm.quant.calibrate import INPUT_TAPS
from jaxlm.quant.formats import QArray
from jaxlm.quant.qat_export import ActQuantWeight
from jaxlm.quant.twinquant import LowRankTransformedWeight
from jaxlm.quant.w4a4 import TransformedWeight, transform_quantize_model
from kernels_pallas.formats import walsh_hadamard

#: attention variants whose only reads of the residual stream are the normed input to
#: q/k/v (and, for affine_scaled, its scale/bias projections of the same normed input)
_ATTENTION_OK = ("softmax", "sink", "affine_scaled")
_READERS_ATTN = ("q_proj", "k_proj", "v_proj")
_AFFINE_READERS = ("scale_proj", "bias_proj")  # affine_scaled: [D, N] kernels of the normed input
_READERS_MLP = ("gate_proj", "up_proj")
_HIGHEST = jax.lax.Precision.HIGHEST


def _check_supported(model, what: str) -> None:
    c = model.config
    if c.mlp != "swiglu":
        raise ValueError(
            f"{what}: ModelConfig.mlp={c.mlp!r} is not supported: only 'swiglu' (meta_swiglu's shared "
            "hypernetwork reads the raw condition embeddings and the MLP input through its own "
            "kernels, which are not folded)"
        )
    if c.attention not in _ATTENTION_OK:
        raise ValueError(f"{what}: ModelConfig.attention={c.attention!r} is not supported: must be one of "
                         f"{_ATTENTION_OK}")
    if c.qat_format is not None:
        raise ValueError(f"{what}: ModelConfig.qat_format={c.qat_format!r} is not supported: fake-quantized "
                         "inputs and weights do not commute with folding or rotation (set it to None)")
    graphdef, state = nnx.split(model)
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state), is_leaf=_structured):
        if _structured(leaf):
            name = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
            raise ValueError(f"{what}: parameter {name} is already quantized/transformed "
                             f"({type(leaf).__name__}); apply QuaRot to the float model")


def _structured(x) -> bool:
    return isinstance(x, (QArray, TransformedWeight, LowRankTransformedWeight, ActQuantWeight))


def _split(model):
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def _merge(model, graphdef, pure, config=None):
    if config is not None and config != model.config:
        graphdef, _ = nnx.split(abstract_model(config))
    new = nnx.merge(graphdef, pure)
    new.tokenizer = getattr(model, "tokenizer", None)
    return new


def _layers(pure, config):
    """The per-layer dicts (one stacked dict under ``scan_layers``: leading axis L)."""
    return [pure["layers"]] if config.scan_layers else [pure["layers"][i] for i in range(config.n_layers)]


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _scale_rows(W, w):
    """``diag(w) W`` for ``W [..., D, R]``, ``w [..., D]``, in W's dtype."""
    return (_f32(W) * _f32(w)[..., :, None]).astype(W.dtype)


def _is_unit(w) -> bool:
    return bool(jnp.all(jnp.asarray(w) == 1))


# ------------------------------------------------------------------ 1. fuse norms
def fuse_norms(model):
    """QuaRot 3: fold every RMSNorm weight into the kernels that read its output and set the
    weight to 1 (qk-norm's per-head weights stay: they act after q/k_proj, not on the residual).
    A tied model is untied (``tie_embeddings=False``, ``lm_head = diag(w_final) E^T``).
    Returns a new model computing the same function."""
    _check_supported(model, "fuse_norms")
    c = model.config
    graphdef, pure = _split(model)
    pure = jax.tree.map(lambda x: x, pure)  # fresh containers; arrays are immutable
    for layer in _layers(pure, c):
        w_attn, w_mlp = layer["attn_norm"]["scale"], layer["mlp_norm"]["scale"]
        for name in _READERS_ATTN:
            layer["attn"][name]["kernel"] = _scale_rows(layer["attn"][name]["kernel"], w_attn)
        for name in _AFFINE_READERS:
            if name in layer["attn"]:
                layer["attn"][name] = _scale_rows(layer["attn"][name], w_attn)
        for name in _READERS_MLP:
            layer["mlp"][name]["kernel"] = _scale_rows(layer["mlp"][name]["kernel"], w_mlp)
        layer["attn_norm"]["scale"] = jnp.ones_like(w_attn)
        layer["mlp_norm"]["scale"] = jnp.ones_like(w_mlp)
    w_final = pure["final_norm"]["scale"]
    config = c
    if c.tie_embeddings:
        config = c.replace(tie_embeddings=False)
        E = pure["embed"]
        pure["lm_head"] = {"kernel": jnp.asarray(_f32(E).T, E.dtype)}
    pure["lm_head"]["kernel"] = _scale_rows(pure["lm_head"]["kernel"], w_final)
    if pure.get("next_head") is not None:  # an edit model's next-token head reads the same output
        pure["next_head"]["kernel"] = _scale_rows(pure["next_head"]["kernel"], w_final)
    pure["final_norm"]["scale"] = jnp.ones_like(w_final)
    return _merge(model, graphdef, pure, config)


# --------------------------------------------------------------- 2. rotate residual
def random_orthogonal(d: int, seed: int = 0) -> np.ndarray:
    """``[d, d]`` orthogonal, float32: the randomized Hadamard ``H_d diag(s) / sqrt(d)``
    (``s`` random signs, QuaRot 4) when ``d`` is a power of two, else ``Q`` of the QR of a
    Gaussian matrix (signs fixed by ``diag(R) > 0``, Haar distributed)."""
    rng = np.random.default_rng(seed)
    if d & (d - 1) == 0:
        s = rng.choice([-1.0, 1.0], size=d)
        return (walsh_hadamard(d).astype(np.float64) * s[None, :]).astype(np.float32)
    q, r = np.linalg.qr(rng.normal(size=(d, d)))
    return (q * np.sign(np.diag(r))[None, :]).astype(np.float32)


def _read(Q, W):
    """``Q^T W`` for a residual reader ``W [..., D, R]``."""
    return jnp.einsum("dc,...dr->...cr", Q, _f32(W), precision=_HIGHEST).astype(W.dtype)


def _write(W, Q):
    """``W Q`` for a residual writer ``W [..., R, D]`` (or a bias ``[..., D]``)."""
    return jnp.einsum("...d,dc->...c", _f32(W), Q, precision=_HIGHEST).astype(W.dtype)


def _check_orthogonal(Q, d: int) -> jax.Array:
    Q = np.asarray(Q, np.float64)
    if Q.shape != (d, d):
        raise ValueError(f"Q has shape {Q.shape}, expected ({d}, {d}) (ModelConfig.d_model={d})")
    err = float(np.abs(Q.T @ Q - np.eye(d)).max())
    if err > 1e-4:
        raise ValueError(f"Q is not orthogonal: max |Q^T Q - I| = {err:.2e}")
    return jnp.asarray(Q, jnp.float32)


def rotate_residual(model, Q=None, *, seed: int = 0):
    """QuaRot eq. 1-2: the residual stream in the basis ``x Q`` (``Q`` orthogonal ``[D, D]``;
    default `random_orthogonal` (D, seed)). ``E -> E Q``, readers ``W -> Q^T W``, writers
    ``W -> W Q``. Exact only with unit RMSNorm weights: raises otherwise (run `fuse_norms`
    first). A tied model stays tied (``h Q (E Q)^T = h E^T``)."""
    _check_supported(model, "rotate_residual")
    c = model.config
    Q = _check_orthogonal(random_orthogonal(c.d_model, seed) if Q is None else Q, c.d_model)
    graphdef, pure = _split(model)
    pure = jax.tree.map(lambda x: x, pure)
    for name, w in [("final_norm.scale", pure["final_norm"]["scale"])] + [
        (f"layers.{n}.scale", layer[n]["scale"]) for layer in _layers(pure, c) for n in ("attn_norm", "mlp_norm")
    ]:
        if not _is_unit(w):
            raise ValueError(f"rotate_residual: {name} is not all ones: an RMSNorm weight does not commute "
                             "with the rotation; call fuse_norms(model) first")
    pure["embed"] = _write(pure["embed"], Q)
    for layer in _layers(pure, c):
        for name in _READERS_ATTN:
            layer["attn"][name]["kernel"] = _read(Q, layer["attn"][name]["kernel"])
        for name in _AFFINE_READERS:
            if name in layer["attn"]:
                layer["attn"][name] = _read(Q, layer["attn"][name])
        for name in _READERS_MLP:
            layer["mlp"][name]["kernel"] = _read(Q, layer["mlp"][name]["kernel"])
        for block, name in (("attn", "o_proj"), ("mlp", "down_proj")):
            mod = layer[block][name]
            mod["kernel"] = _write(mod["kernel"], Q)
            if mod.get("bias") is not None:
                mod["bias"] = _write(mod["bias"], Q)
    if not c.tie_embeddings:
        pure["lm_head"]["kernel"] = _read(Q, pure["lm_head"]["kernel"])
    if pure.get("next_head") is not None:
        pure["next_head"]["kernel"] = _read(Q, pure["next_head"]["kernel"])
    return _merge(model, graphdef, pure)


# ------------------------------------------------------------------- 3. V/O heads
def rotate_heads(model, H=None, *, seed: int = 0):
    """QuaRot 4, fused V/O rotation: every value head ``v_h -> v_h H`` (``v_proj`` output
    columns and bias per KV head) and ``o_proj``'s input rows per query head ``-> H^T W_o``.
    ``H [v_head_dim, v_head_dim]`` orthogonal; default the Hadamard ``H_hd / sqrt(hd)`` when
    ``v_head_dim`` is a power of two, else `random_orthogonal`. Refuses ``kv_quant`` (the
    fake-quantized value cache sees the rotated values)."""
    _check_supported(model, "rotate_heads")
    c = model.config
    if c.layer_v_head_dims is not None:
        raise ValueError(f"rotate_heads: ModelConfig.layer_v_head_dims={c.layer_v_head_dims} (per-layer value "
                         "widths) is not supported")
    if c.kv_quant is not None:
        raise ValueError(f"rotate_heads: ModelConfig.kv_quant={c.kv_quant!r} is not supported: the quantized "
                         "value cache would see rotated values (set it to None)")
    hd = c.v_head_dim
    if H is None:
        H = walsh_hadamard(hd) if hd & (hd - 1) == 0 else random_orthogonal(hd, seed)
    H = _check_orthogonal(H, hd)
    graphdef, pure = _split(model)
    pure = jax.tree.map(lambda x: x, pure)
    for layer in _layers(pure, c):
        v, o = layer["attn"]["v_proj"], layer["attn"]["o_proj"]
        Wv = _f32(v["kernel"])
        Wv = jnp.einsum("...dkh,hg->...dkg", Wv.reshape(*Wv.shape[:-1], c.n_kv_heads, hd), H, precision=_HIGHEST)
        v["kernel"] = Wv.reshape(v["kernel"].shape).astype(v["kernel"].dtype)
        if v.get("bias") is not None:
            b = jnp.einsum("...kh,hg->...kg", _f32(v["bias"]).reshape(*v["bias"].shape[:-1], c.n_kv_heads, hd), H,
                           precision=_HIGHEST)
            v["bias"] = b.reshape(v["bias"].shape).astype(v["bias"].dtype)
        Wo = _f32(o["kernel"])
        Wo = jnp.einsum("hg,...nhr->...ngr", H, Wo.reshape(*Wo.shape[:-2], c.n_heads, hd, c.d_model),
                        precision=_HIGHEST)
        o["kernel"] = Wo.reshape(o["kernel"].shape).astype(o["kernel"].dtype)
    return _merge(model, graphdef, pure)


def quarot_transform(model, Q=None, *, seed: int = 0, heads: bool = True):
    """`fuse_norms`, then `rotate_residual` (``Q`` or the seeded randomized Hadamard), then
    (``heads``) `rotate_heads`: the same function, in QuaRot's rotated basis."""
    out = rotate_residual(fuse_norms(model), Q, seed=seed)
    if heads and model.config.kv_quant is None:
        out = rotate_heads(out, seed=seed)
    return out


def quarot_quantize(model, fmt, *, seed: int = 0, quantize_weights: bool = True,
                    quantize_activations: bool = True):
    """QuaRot W4A4 (or W4A16 without ``quantize_activations``): `quarot_transform`, then RTN
    on q/k/v/o/gate/up and RTN after the per-block shared Hadamard on ``down_proj`` (the
    emulated online Hadamard). Embeddings and the LM head stay in full precision."""
    rotated = quarot_transform(model, seed=seed)
    kw = dict(quantize_weights=quantize_weights, quantize_activations=quantize_activations)
    rtn = tuple(m for m in INPUT_TAPS if m != "mlp.down_proj")
    q = transform_quantize_model(rotated, "rtn", fmt, None, modules=rtn, **kw)
    return transform_quantize_model(q, "hadamard", fmt, None, modules=("mlp.down_proj",), **kw)

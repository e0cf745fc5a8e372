"""A quantization-aware-trained model -> the same model with stored 4-bit weights.

A model trained with ``ModelConfig.qat_format = F`` runs every attention/MLP projection as
``fake_quant_tokens(x, F) @ fake_quant(W, F, axis=-2)`` (`jaxlm.models.layers.linear.Linear`).
`export_qat` stores each such ``W`` as ``quantize(W, F, axis=-2)`` (a `QArray`: packed 4-bit
codes, block scales, one tensor scale per layer and projection) inside an `ActQuantWeight`,
which quantizes the activations at run time with the same call as the QAT forward (same
blocks along the reduction axis, same RTN rounding, same NVFP4 tensor-scale rules: per
weight matrix, per activation token). The new config has ``qat_format=None``; ``kv_quant``
and ``k_shift`` (the Q-FIT key shift) are kept, so the KV cache stays quantized as trained.

The QAT forward (`jaxlm.models.layers.linear.qat_linear`) already runs this stored-weight
matmul (the NVFP4 tensor scale applied to the fp32 accumulator, as the W4A16 kernel does), and
the export quantizes under jit as that forward runs, so the compiled models compute the same
bits (tested: identical logits with unrolled layers; with scanned layers XLA fuses the two
programs' attention differently and leaves float32 ulps). On GPU/TPU the exported model runs
the W4A16 kernel, the QAT forward the jnp reference: equal up to accumulation order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.layers.linear import Linear, linear
from jaxlm.models.params import flat_params, model_from_flat
from jaxlm.quant.formats import QArray, QFormat, fake_quant_tokens, get_format, quantize
from jaxlm.quant.w4a4 import map_projections


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ActQuantWeight:
    """A stored quantized weight ``[in, out]`` whose input is fake-quantized per token in
    ``act_format`` (`fake_quant_tokens`): W4A4 without a transform, what QAT trained."""

    weight: QArray
    act_format: QFormat = dataclasses.field(metadata=dict(static=True))


@linear.register(ActQuantWeight)
def act_quant_linear(x: jax.Array, w: ActQuantWeight) -> jax.Array:
    return linear(fake_quant_tokens(x, w.act_format), w.weight)


def qat_projections(model) -> tuple[str, ...]:
    """The fake-quantized projections of ``model`` as ``"attn.q_proj"``-style names
    (relative to a layer)."""
    names = []
    for path, module in nnx.iter_graph(model.layers):
        if isinstance(module, Linear) and module.fake_quant is not None:
            parts = [str(p) for p in path]
            if parts and parts[0].isdigit():  # unrolled layers: drop the layer index
                parts = parts[1:]
            name = ".".join(parts)
            if name not in names:
                names.append(name)
    return tuple(names)


def export_qat(model):
    """A new model whose fake-quantized projections hold stored ``qat_format`` weights
    (`ActQuantWeight(quantize(W, F, axis=-2), act_format=F)`), config ``qat_format=None``;
    everything else (embeddings, norms, LM head, ``kv_quant``, ``k_shift``) unchanged.
    Stacked (scanned) and unrolled layers alike."""
    c = model.config
    if c.qat_format is None:
        raise ValueError("export_qat: ModelConfig.qat_format is None: the model was not trained with fake-quantized "
                         "projections (use a post-training method, e.g. jaxlm quantize --method rtn)")
    modules = qat_projections(model)
    flat = flat_params(model)
    structured = [n for n, v in flat.items() if not isinstance(v, (jax.Array, np.ndarray))]
    if structured:
        raise ValueError(f"export_qat: parameters {structured[:3]} are already structured (quantized) weights")
    fmt = get_format(c.qat_format)
    plain = model_from_flat(c.replace(qat_format=None), flat)
    # quantized under jit, as the QAT forward always runs in training and generation: XLA
    # computes NVFP4's tensor scale amax / (6 * 448) as a multiplication by the reciprocal
    # there, one float32 ulp away from the op-by-op division, which can move block codes
    q = jax.jit(lambda W: quantize(W, fmt, axis=-2))
    new = map_projections(plain, modules, lambda module, layer, W: ActQuantWeight(q(jnp.asarray(W)), fmt))
    new.tokenizer = getattr(model, "tokenizer", None)
    return new


def export_for_quantize(model, method: str, fmt, *, weights_only: bool = False, inner: str = "rtn"):
    """`jaxlm.quant.apply.quantize_with`'s ``method="qat"`` (and its guard for QAT models):
    `export_qat` after checking that the request matches what the model was trained for."""
    trained = model.config.qat_format
    if method != "qat":
        raise ValueError(f"the model was trained with ModelConfig.qat_format={trained!r}: store its weights with "
                         f"method 'qat' (jaxlm quantize --method qat), not the post-training method {method!r}")
    if trained is None:
        raise ValueError("method 'qat' exports a quantization-aware-trained model, but this model has "
                         "ModelConfig.qat_format=None; use a post-training method (rtn, hadamard, wush, ...)")
    if fmt is not None and get_format(fmt) != get_format(trained):
        name = fmt if isinstance(fmt, str) else fmt.name
        raise ValueError(f"format {name!r} conflicts with the model's ModelConfig.qat_format={trained!r}: "
                         f"the QAT weights are stored in the format they were trained in (format {trained!r}, "
                         f"--format {trained})")
    if weights_only:
        raise ValueError("weights_only (--weights-only) does not apply to method 'qat': the model was trained with "
                         f"activations quantized in {trained}")
    if inner != "rtn":
        raise ValueError(f"inner={inner!r} does not apply to method 'qat' (its weights are rounded as trained: RTN)")
    return export_qat(model)

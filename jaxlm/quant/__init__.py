"""Quantization: block-scaled 4-bit formats (`QArray`), the quantized `linear`, and
``params -> params`` recipes. Kernels live in `kernels_pallas`."""

from jaxlm.quant.backend import backend, resolved_backend, set_backend
from jaxlm.quant.formats import (
    FORMATS,
    QArray,
    QFormat,
    dequantize,
    e1m2,
    fake_quant,
    get_format,
    int4,
    mxfp4,
    nvfp4,
    quantize,
)
from jaxlm.quant.linear import quantized_linear
from jaxlm.quant.recipe import QuantRecipe, quantize_model, quantize_params, quantized_names

__all__ = [
    "FORMATS", "QArray", "QFormat", "dequantize", "e1m2", "fake_quant", "get_format", "int4", "mxfp4",
    "nvfp4", "quantize", "backend", "quantized_linear", "resolved_backend", "set_backend", "QuantRecipe",
    "quantize_model", "quantize_params", "quantized_names",
]

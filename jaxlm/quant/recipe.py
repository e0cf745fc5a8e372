"""`quantize_params(params, recipe)`: a pure ``params -> params`` map that replaces chosen
linear kernels by `QArray`s; the unchanged model then runs them through `linear`."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlm.quant.formats import QArray, get_format, quantize


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """Which weights to quantize, and how.

    include / exclude: regexes over parameter names such as ``layers.3.attn.q_proj.kernel``
    (``layers.attn.q_proj.kernel`` when layers are stacked). The default takes every
    attention and MLP projection and leaves embeddings, norms and the LM head in full
    precision.
    """

    format: str = "mxfp4"
    options: tuple[tuple[str, Any], ...] = ()
    include: str = r"(^|\.)(attn|mlp)\.\w+_proj\.kernel$"
    exclude: str | None = None

    def qformat(self):
        return get_format(self.format, **dict(self.options))


def _name(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def quantize_params(params, recipe: QuantRecipe = QuantRecipe()):
    """Pure dict of parameters -> the same dict with matching kernels as `QArray`."""
    fmt = recipe.qformat()
    inc = re.compile(recipe.include)
    exc = re.compile(recipe.exclude) if recipe.exclude else None

    def one(path, leaf):
        name = _name(path)
        if isinstance(leaf, QArray) or not inc.search(name) or (exc and exc.search(name)):
            return leaf
        # the model reads only projection kernels ([in, out] matmul weights, through `linear`) as
        # QArrays: the embedding is gathered by row, norms and biases are vectors, and other
        # matrices (an affine-scaled attention's scale_proj) are indexed directly
        if name.split(".")[-1] != "kernel" or np.ndim(leaf) < 2:
            raise ValueError(f"QuantRecipe(include={recipe.include!r}) selects {name!r} {tuple(np.shape(leaf))}, "
                             "which the model cannot run quantized: select projection kernels only "
                             f"(the default include is {QuantRecipe.include!r})")
        try:
            return quantize(leaf, fmt, axis=-2)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, QArray))


def quantize_model(model, recipe: QuantRecipe = QuantRecipe()):
    """A new model whose matching kernels are quantized (the input model is unchanged)."""
    qat = getattr(getattr(model, "config", None), "qat_format", None)
    if qat is not None:  # its forward fake-quantizes activations too: a recipe would drop that
        raise ValueError(f"the model was trained with ModelConfig.qat_format={qat!r}: export it with "
                         "jaxlm.quant.export_qat (jaxlm quantize --method qat), which keeps its activation "
                         "quantization; a weight recipe would run it W4A16")
    graphdef, state = nnx.split(model)
    qmodel = nnx.merge(graphdef, quantize_params(nnx.to_pure_dict(state), recipe))
    qmodel.tokenizer = getattr(model, "tokenizer", None)
    return qmodel


def quantized_names(params) -> list[str]:
    out = []
    jax.tree_util.tree_map_with_path(
        lambda p, x: out.append(_name(p)) if isinstance(x, QArray) else None, params,
        is_leaf=lambda x: isinstance(x, QArray),
    )
    return out

"""`quantize_params(params, recipe)`: a pure ``params -> params`` map that replaces chosen
linear kernels by `QArray`s; the unchanged model then runs them through `linear`."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
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
        return quantize(leaf, fmt, axis=-2)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, QArray))


def quantize_model(model, recipe: QuantRecipe = QuantRecipe()):
    """A new model whose matching kernels are quantized (the input model is unchanged)."""
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

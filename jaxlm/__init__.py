"""jaxlm: a JAX/Flax NNX research framework for large language models.

Core API: `ModelConfig` (+ presets), `build_model`, `load_hf` / `save_hf`, `generate`,
`diffusion_generate` (masked diffusion LMs),
`save_checkpoint` / `load_checkpoint` / `load_model` (orbax), `save_omni` / `load_omni` (a
language model with media encoders), `expand_blocks` (deepen a trained model with identity
blocks), `sharding.make_mesh`.
"""

import importlib

# before anything starts JAX's CPU client (`jaxlm.host_allocator`: XLA:CPU's per-call buffers)
from jaxlm.host_allocator import configure_from_environment as _configure_host_allocator

_configure_host_allocator()

from jaxlm.data.tokenizers import ByteTokenizer, HFTokenizer
from jaxlm.inference.cache import KVCache
from jaxlm.inference.diffusion import DiffusionResult, diffusion_generate
from jaxlm.inference.sampler import GenerateResult, generate
from jaxlm.models.config import ModelConfig, RopeScaling, preset
from jaxlm.models.hf import CheckpointError, load_hf, save_hf
from jaxlm.models.transformer import ModelOutput, Transformer, abstract_model, build_model

__version__ = "0.1.0"

# Imported on first use (orbax is slow to import and not needed to run a model).
_LAZY = {
    "checkpoint": ("jaxlm.checkpoint", None),
    "sharding": ("jaxlm.sharding", None),
    "save_checkpoint": ("jaxlm.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("jaxlm.checkpoint", "load_checkpoint"),
    "load_model": ("jaxlm.checkpoint", "load_model"),
    "save_omni": ("jaxlm.models.omni", "save_omni"),
    "load_omni": ("jaxlm.models.omni", "load_omni"),
    "expand_blocks": ("jaxlm.models.expansion", "expand_blocks"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'jaxlm' has no attribute {name!r}")


__all__ = [
    "ByteTokenizer", "HFTokenizer", "KVCache", "GenerateResult", "generate", "DiffusionResult",
    "diffusion_generate", "ModelConfig",
    "RopeScaling", "preset", "CheckpointError", "load_hf", "save_hf", "ModelOutput",
    "Transformer", "abstract_model", "build_model", *_LAZY,
]

"""Inference: the KV cache, logits processors and the sampler."""

from jaxlm.inference.cache import KVCache
from jaxlm.inference.logits_processors import Temperature, TopK, TopP, compose
from jaxlm.inference.sampler import GenerateResult, SamplingState, generate, generate_tokens

__all__ = [
    "KVCache", "Temperature", "TopK", "TopP", "compose", "GenerateResult", "SamplingState",
    "generate", "generate_tokens",
]

"""Samplers for masked diffusion LMs: LLaDA's block-wise low-confidence remasking, Fast-dLLM's
parallel decoding and KV caches, dLLM-Cache, SPEED's Slow-Fast decoding, ME-DLM's edit rounds."""

from jaxlm.inference.diffusion.commit import num_transfer_tokens
from jaxlm.inference.diffusion.forward import DLLMCache
from jaxlm.inference.diffusion.sampler import DiffusionResult, SlowFast, diffusion_generate

__all__ = ["num_transfer_tokens", "DLLMCache", "DiffusionResult", "SlowFast", "diffusion_generate"]

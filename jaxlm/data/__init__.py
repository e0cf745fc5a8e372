"""Data: tokenizers (and, later, synthetic tasks, loaders and packing)."""

from jaxlm.data.tokenizers import ByteTokenizer, HFTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer"]

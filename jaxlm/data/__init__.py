"""Data: tokenizers and chat templates, synthetic tasks with verifiers, local files, and the
grain pipeline from examples to training batches."""

from jaxlm.data.tokenizers import ByteTokenizer, HFTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer"]

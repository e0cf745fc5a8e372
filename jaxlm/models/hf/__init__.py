"""HuggingFace interop: per-family tables and `load_hf` / `save_hf`."""

from jaxlm.models.hf.families import ARCHITECTURES, FAMILIES, UnsupportedConfigError
from jaxlm.models.hf.io import CheckpointError, load_hf, save_hf

__all__ = ["ARCHITECTURES", "FAMILIES", "UnsupportedConfigError", "CheckpointError", "load_hf", "save_hf"]

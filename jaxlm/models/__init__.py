"""Model definitions: `ModelConfig`, `Transformer`, layers and HF interop."""

from jaxlm.models.config import PRESETS, ModelConfig, RopeScaling, preset
from jaxlm.models.transformer import ModelOutput, Transformer, abstract_model, build_model

__all__ = [
    "PRESETS", "ModelConfig", "RopeScaling", "preset", "ModelOutput", "Transformer",
    "abstract_model", "build_model",
]

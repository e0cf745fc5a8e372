"""Interpretability primitives: interventions at tap sites (steering, directional
ablation, head masking), direction extraction and component attributions."""

from jaxlm.interp.attribution import head_contributions, head_importance, neuron_contributions
from jaxlm.interp.directions import (
    capture,
    last_token_index,
    mean_difference_directions,
    pca_directions,
)
from jaxlm.interp.interventions import Intervention, ablate, mask_heads, perturb, steer

__all__ = [
    "Intervention", "ablate", "mask_heads", "perturb", "steer",
    "capture", "last_token_index", "mean_difference_directions", "pca_directions",
    "head_contributions", "head_importance", "neuron_contributions",
]

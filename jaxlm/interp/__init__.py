"""Interpretability primitives: interventions at tap sites (steering, directional
ablation, head masking), direction extraction and component attributions."""

from jaxlm.interp.interventions import Intervention, ablate, mask_heads, perturb, steer

__all__ = ["Intervention", "ablate", "mask_heads", "perturb", "steer"]

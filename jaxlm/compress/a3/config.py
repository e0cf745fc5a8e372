"""A^3 (Wong et al., arXiv 2505.12942): what to compress and how much (`A3Config`), the target
widths of a budget, and the model and statistics each component's closed form needs."""

from __future__ import annotations

import dataclasses
import math
import numbers

from jaxlm.compress.calibrate import QK_REFIT_WEIGHTS, A3Statistics, check_components
from jaxlm.models.config import QUANT_BLOCKS

QK_SCORES = ("score_energy", "norm_product")
OV_GROUPS = ("average", "average_refit")
MLP_SELECTS = ("energy", "greedy")
ALLOCATIONS = ("uniform", "global")
#: compressed width -> (component, per-layer config field)
_WIDTHS = {"qk_head_dim": ("qk", "layer_qk_head_dims"), "v_head_dim": ("ov", "layer_v_head_dims"),
           "ffn_dim": ("mlp", "layer_ffn_dims")}


@dataclasses.dataclass(frozen=True)
class A3Config:
    """What to compress and how much.

    components: subset of ``("qk", "ov", "mlp")``.
    budget: kept fraction of each compressed component's parameters, in (0, 1].
    qk_head_dim / v_head_dim / ffn_dim: explicit target widths (override ``budget`` for that
      component).
    allocation: ``"uniform"`` (every layer the same width) or ``"global"`` (the same total
      width per component, split over layers by greedy marginal gains of the closed-form
      error curves; the model gets per-layer widths and unrolled layers).
    qk_rope_refit: under RoPE, refit the kept query columns (and biases) of every query head by
      least squares on the full model's pre-softmax scores over calibration token pairs, after
      the pair selection (`qk_rope_refit`; CUR's middle factor for QK). Needs a second
      calibration pass: `compress_model` runs it; `a3_compress` takes its result as
      ``qk_refit``. Ignored without RoPE (the closed form is already the optimum there).
    qk_refit_ridge: ridge of the refit, relative to the mean diagonal of its normal matrix,
      pulling towards the selected (unrefit) columns (so directions the calibration inputs never
      reach keep their original weights, and full rank stays exact), >= 0.
    qk_refit_als: extra alternating rounds (refit the keys for the refit queries, then the
      queries again), >= 0; each is two more calibration passes and never increases the
      (ridge-regularised) calibration objective.
    qk_refit_weight: ``"uniform"`` (every causal token pair equally: the score error) or
      ``"attention"`` (each pair weighted by the full model's attention probability).
    qk_refit_rank: refit only along this many leading directions of the layer input's second
      moment (None: all ``d_model`` (+1 with biases) inputs). The normal matrices have
      ``(m * r)^2`` entries per KV group and layer (``r`` the kept width), so large models
      need it.
    """

    components: tuple[str, ...] = ("qk", "ov", "mlp")
    budget: float | None = 0.5
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    ffn_dim: int | None = None
    qk_score: str = "score_energy"
    ov_group: str = "average"
    mlp_select: str = "energy"
    mlp_ridge: float = 1e-6
    eig_floor: float = 1e-10  # relative floor of the Gram eigenvalues in the pseudo-inverses
    allocation: str = "uniform"
    qk_rope_refit: bool = True
    qk_refit_ridge: float = 1e-4
    qk_refit_als: int = 0
    qk_refit_weight: str = "uniform"
    qk_refit_rank: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "components", check_components(self.components))
        if self.budget is not None and not (_real(self.budget) and 0 < self.budget <= 1):
            raise ValueError(f"A3Config.budget={self.budget!r} is invalid: must be a number in (0, 1] or None")
        for name in ("qk_head_dim", "v_head_dim", "ffn_dim"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"A3Config.{name}={v!r} is invalid: must be a positive int or None")
        for name, allowed in (("qk_score", QK_SCORES), ("ov_group", OV_GROUPS), ("mlp_select", MLP_SELECTS),
                              ("allocation", ALLOCATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"A3Config.{name}={getattr(self, name)!r} is invalid: must be one of {allowed}")
        for name in ("mlp_ridge", "qk_refit_ridge"):
            v = getattr(self, name)
            if not (_real(v) and 0 <= v < math.inf):
                raise ValueError(f"A3Config.{name}={v!r} is invalid: must be a finite number >= 0")
        if not (_real(self.eig_floor) and 0 <= self.eig_floor < 1):
            raise ValueError(f"A3Config.eig_floor={self.eig_floor!r} is invalid: must be a number in [0, 1) (the "
                             "kept Gram eigenvalues' floor relative to the largest)")
        for name in ("budget", "mlp_ridge", "qk_refit_ridge", "eig_floor"):  # numpy scalars stored as floats
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if not isinstance(self.qk_rope_refit, bool):
            raise ValueError(f"A3Config.qk_rope_refit={self.qk_rope_refit!r} is invalid: must be a bool")
        if isinstance(self.qk_refit_als, bool) or not isinstance(self.qk_refit_als, int) or self.qk_refit_als < 0:
            raise ValueError(f"A3Config.qk_refit_als={self.qk_refit_als!r} is invalid: must be an int >= 0")
        if self.qk_refit_rank is not None and (isinstance(self.qk_refit_rank, bool)
                                               or not isinstance(self.qk_refit_rank, int) or self.qk_refit_rank <= 0):
            raise ValueError(f"A3Config.qk_refit_rank={self.qk_refit_rank!r} is invalid: must be a positive int or None")
        # a setting for a part that does not run was ignored without a word
        for name, component in (("qk_head_dim", "qk"), ("v_head_dim", "ov"), ("ffn_dim", "mlp")):
            if getattr(self, name) is not None and component not in self.components:
                raise ValueError(f"A3Config.{name}={getattr(self, name)} has no effect: component {component!r} is "
                                 f"not in components={self.components}")
        if self.qk_refit_rank is not None and not self.qk_rope_refit:
            raise ValueError(f"A3Config.qk_refit_rank={self.qk_refit_rank} has no effect with qk_rope_refit=False")
        if self.qk_refit_weight not in QK_REFIT_WEIGHTS:
            raise ValueError(f"A3Config.qk_refit_weight={self.qk_refit_weight!r} is invalid: must be one of "
                             f"{QK_REFIT_WEIGHTS}")


def _real(v) -> bool:
    """A real number (numpy scalars included, bool not)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def a3_steps(config) -> dict[str, tuple[int, str]]:
    """``{field: (step, why)}``: the multiple each compressed width must be so the model stays
    valid: RoPE keeps whole pairs (even ``qk_head_dim``), a low-bit KV cache quantizes head
    widths in blocks (``kv_quant``), and QAT quantizes each projection's input in blocks
    (``qat_format``: ``ffn_dim`` and ``n_heads * v_head_dim``)."""
    steps = {"qk_head_dim": (1, []), "v_head_dim": (1, []), "ffn_dim": (1, [])}

    def need(name, step, why):
        old, whys = steps[name]
        steps[name] = (math.lcm(old, int(step)), whys + [why])

    if config.rope != "none":
        need("qk_head_dim", 2, "even (RoPE pairs)")
    if config.kv_quant is not None:
        block = QUANT_BLOCKS[config.kv_quant]
        need("qk_head_dim", block, f"a multiple of kv_quant={config.kv_quant!r}'s block {block}")
        need("v_head_dim", block, f"a multiple of kv_quant={config.kv_quant!r}'s block {block}")
    if config.qat_format is not None:
        block = QUANT_BLOCKS[config.qat_format]
        need("ffn_dim", block, f"a multiple of qat_format={config.qat_format!r}'s block {block}")
        per_head = block // math.gcd(block, config.n_heads)
        need("v_head_dim", per_head, f"such that n_heads x v_head_dim is a multiple of qat_format="
             f"{config.qat_format!r}'s block {block}")
    return {name: (step, " and ".join(whys)) for name, (step, whys) in steps.items()}


def a3_widths(config, a3: A3Config) -> dict[str, int]:
    """Target ``{qk_head_dim, v_head_dim, ffn_dim}`` (unchanged for components not compressed),
    each a multiple of its `a3_steps` step (a budget rounds to the nearest one)."""
    steps = a3_steps(config)

    def pick(name, current, component):
        step, why = steps[name]
        explicit = getattr(a3, name)
        if component not in a3.components:
            return current
        if explicit is not None:
            width = explicit
        elif a3.budget is None:
            raise ValueError(f"A3Config: component {component!r} needs budget or {name}")
        else:
            width = max(step, step * int(round(a3.budget * current / step)))
        if width > current or width % step:
            raise ValueError(f"A3Config.{name}={width} is invalid: must be <= the current {current}"
                             + (f" and {why}" if why else ""))
        return width

    return {
        "qk_head_dim": pick("qk_head_dim", config.qk_head_dim, "qk"),
        "v_head_dim": pick("v_head_dim", config.v_head_dim, "ov"),
        "ffn_dim": pick("ffn_dim", config.ffn_dim, "mlp"),
    }


def check_compressible(config, components) -> None:
    """Clear errors for the variants a component's closed form does not cover."""
    if config.per_layer_dims:  # its statistics come back per layer: caught here, before calibrating
        raise ValueError("a3_compress: the model already has per-layer widths (ModelConfig.layer_*_dims); "
                         "compress the uncompressed model instead")
    if "qk" in components:
        if config.qk_norm:
            raise ValueError(
                "A3-QK: ModelConfig.qk_norm=True (Qwen3) normalises q and k over the whole head, so "
                "dropping pairs changes the kept ones; compress with components=('ov', 'mlp')"
            )
        if config.rope not in ("default", "none"):
            raise ValueError(f"A3-QK: ModelConfig.rope={config.rope!r} is not supported: must be 'default' or 'none'")
        if config.k_shift:
            raise ValueError("A3-QK: ModelConfig.k_shift=True (a Q-FIT key shift) is not supported: compress "
                             "before Q-FIT, or with components=('ov', 'mlp')")
    if "ov" in components and config.attention not in ("softmax", "sink"):
        raise ValueError(
            f"A3-OV: ModelConfig.attention={config.attention!r} is not supported: must be 'softmax' or 'sink'"
        )
    if "mlp" in components and config.mlp != "swiglu":
        raise ValueError(f"A3-MLP: ModelConfig.mlp={config.mlp!r} is not supported: must be 'swiglu'")


def _check_inputs(config, stats: A3Statistics, a3: A3Config) -> None:
    check_compressible(config, a3.components)
    need = {"qk": "attn_in" if config.rope == "none" else
            ("pair_score_energy" if a3.qk_score == "score_energy" else "q_pair_energy"),
            "ov": "attn_z", "mlp": "mlp_act"}
    for comp in a3.components:
        if getattr(stats, need[comp]) is None:
            raise ValueError(f"A3Statistics.{need[comp]} is missing: collect the statistics with {comp!r} "
                             "in components")


def needs_qk_refit(config, a3: A3Config) -> bool:
    """Whether `a3_compress` needs `qk_rope_refit`'s result (``qk_rope_refit`` on, QK compressed, RoPE)."""
    return a3.qk_rope_refit and "qk" in a3.components and config.rope != "none"

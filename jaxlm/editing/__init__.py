"""Weight-space model editing: pure ``params -> params`` methods.

* curvature: `kfac_factors` (K-FAC ``A``/``B`` per linear layer; empirical Fisher,
  sampled Fisher or Gauss-Newton), `merge_factors`;
* CrispEdit: `projector_from_factors` (matrix-free Kronecker eigenbasis projector),
  `project_updates` (optax), `gradient_edit` / `sequential_edit`;
* baselines: plain fine-tuning (``sequential_edit(method="finetune")``), MEMIT and
  AlphaEdit (`locate_edit`, closed forms `memit_update` / `alphaedit_update`);
* metrics: `EditEvaluator` (EasyEdit / CounterFact); the comparison: `run_method`;
* task vectors: `task_vector`, `interpolate`, `extrapolate`, schedules, random control.
"""

from jaxlm.editing.benchmark import METHODS, run_method
from jaxlm.editing.crispedit import EditResult, GradientEditConfig, gradient_edit, sequential_edit
from jaxlm.editing.kfac import ESTIMATORS, KFACFactors, kfac_factors, merge_factors
from jaxlm.editing.locate import (
    LocateEditConfig,
    alphaedit_update,
    compute_targets,
    locate_edit,
    memit_update,
    nullspace_projector,
)
from jaxlm.editing.metrics import EditEvaluator
from jaxlm.editing.projection import KroneckerProjector, project_updates, projector_from_factors
from jaxlm.editing.task_vectors import (
    SCHEDULES,
    apply_task_vectors,
    extrapolate,
    interpolate,
    random_direction,
    random_direction_control,
    schedule_weights,
    task_vector,
)

__all__ = [
    "METHODS", "run_method", "EditResult", "GradientEditConfig", "gradient_edit", "sequential_edit",
    "ESTIMATORS", "KFACFactors", "kfac_factors", "merge_factors", "LocateEditConfig", "alphaedit_update",
    "compute_targets", "locate_edit", "memit_update", "nullspace_projector", "EditEvaluator",
    "KroneckerProjector", "project_updates", "projector_from_factors",
    "SCHEDULES", "apply_task_vectors", "extrapolate", "interpolate", "random_direction",
    "random_direction_control", "schedule_weights", "task_vector",
]

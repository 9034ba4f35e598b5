"""The sweep: one W&B sweep YAML run by a local Optuna executor into MLflow parent/child runs.

Which FP8 recipe, and which layers stay in BF16, for the user's own model: spec (load and refuse bad
YAML), command (the argv ``wandb agent`` would build), runner (one program subprocess, its metric,
pruning), executor (the loop) over sampling (Optuna study, samplers, pruner), mlflow_runs (parent
and child runs), launch (one program run or a reused result), controls (cached BF16 control,
``auto:K`` ranking) and finish (finalists, the summary written), summary (table, Pareto plot,
recommendation), cli (``fp8track sweep``). The program reads its trial
with :func:`trial_settings`.
"""

from fp8track.sweep.spec import SweepSpec, load_sweep
from fp8track.trial import TrialSettings, trial_settings

__all__ = ["SweepSpec", "load_sweep", "TrialSettings", "trial_settings"]

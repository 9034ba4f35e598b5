"""The sweep: one W&B sweep YAML run by a local Optuna executor into MLflow parent/child runs.

Which FP8 recipe, and which layers stay in BF16: spec (load and refuse bad YAML), executor (Optuna
study, control, ``auto:K`` probe, MLflow and W&B offline runs), summary (table, Pareto plot,
recommendation), cli (``fp8track sweep``). Users' own programs read a trial with
:func:`fp8track.trial.trial_settings`.
"""

from fp8track.sweep.spec import SweepSpec, load_sweep
from fp8track.trial import TrialSettings, trial_settings

__all__ = ["SweepSpec", "load_sweep", "TrialSettings", "trial_settings"]

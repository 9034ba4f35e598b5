"""The sweep's references: the BF16 control of each seed and the ``auto:K`` rankings, and the
environment that hands them to a program run.

* **Control**: the same program with ``recipe=bf16, bf16_layers=none`` for each seed it is needed
  at (the trials' seed, and ``control_seeds`` seeds from it for the finalists); cached by the hash
  of the program and command, its other parameters and the seed (:class:`~fp8track.trial.JsonCache`
  in ``<out>/cache``), so a second sweep of the same program trains no control. A run gets it as
  ``FP8TRACK_SWEEP_CONTROL`` (``mlflow:<id>``, the monitor's baseline).
* **auto:K**: the ranking comes from the monitor's statistics of the same recipe with every layer
  in FP8 (that run is itself the ``bf16_layers=none`` trial, cached like any run),
  :func:`fp8track.analysis.ranking.rank_layers`. With ``auto_from="whatif"`` no such run is
  trained: the BF16 control of each seed is recorded with the what-if rows of the sweep's recipes
  (``FP8TRACK_SWEEP_WHATIF``, the program's monitor ``whatif``) and the ranking is
  ``rank_layers`` of the trial recipe's what-if rows alone (``variant=``), for hardware that cannot
  run the recipe (NVFP4 before Blackwell). A run gets it as ``FP8TRACK_SWEEP_RANKING``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError
from fp8track.sweep.launch import Launcher
from fp8track.sweep.mlflow_runs import seed_of
from fp8track.sweep.options import RunOutcome
from fp8track.sweep.spec import Param, SweepSpec
from fp8track.trial import CONTROL_ENV, RANKING_ENV, WHATIF_ENV, cache_key, ranking_table, whatif_variant


def control_whatif(spec: SweepSpec, auto_from: str) -> tuple[str, ...]:
    """The what-if variants the BF16 controls record: under ``auto_from="whatif"``, when some
    ``bf16_layers`` value is ``auto:K``, the variant of every quantising recipe the sweep may try
    (one control per seed serves them all); else none.

    Raises:
        ConfigError: a recipe of the sweep has no what-if rows (before anything is trained).
    """
    from fp8track.execution.fallback import FallbackSpec
    from fp8track.execution.recipes import Recipe

    if auto_from != "whatif":
        return ()
    layers, recipes = spec.param("bf16_layers"), spec.param("recipe")
    if layers is None or recipes is None:
        return ()
    if not any(FallbackSpec.parse(str(v)).needs_ranking for v in _param_values(layers)):
        return ()
    out: list[str] = []
    for v in _param_values(recipes):
        r = Recipe.parse(str(v))
        if r.quantizes and (w := whatif_variant(r)) not in out:
            out.append(w)
    return tuple(out)


def _param_values(p: Param) -> tuple[Any, ...]:
    return (p.value,) if p.kind == "constant" else p.values


class Controls:
    """The BF16 controls (one per seed, cached) and ``auto:K`` rankings of one sweep (module
    docstring); :meth:`run` launches a program run with both in its environment.

    Args:
        launcher: runs the program.
        status: shows one line of what the executor is doing.
        whatif: the what-if variants the controls record (:func:`control_whatif`).
    """

    def __init__(
        self, launcher: Launcher, status: Callable[[str], None], whatif: tuple[str, ...] = ()
    ) -> None:
        self.launcher, self.status, self.whatif = launcher, status, whatif
        self.spec, self.options, self.runs = launcher.spec, launcher.options, launcher.runs
        self.controls: dict[str, RunOutcome] = {}

    def seed_of(self, params: Mapping[str, Any]) -> int | None:
        return seed_of(params, self.options.seed_param)

    def with_seed(self, params: Mapping[str, Any], seed: int) -> dict[str, Any]:
        return {**params, self.options.seed_param: seed}

    def control(self, params: Mapping[str, Any]) -> RunOutcome:
        """The BF16 control of ``params``' seed and non-FP8 parameters (cached)."""
        cparams = {**params, "recipe": "bf16", "bf16_layers": "none"}
        key = cache_key(cparams)
        if key not in self.controls:
            seed = self.seed_of(cparams)
            self.status(f"BF16 control{'' if seed is None else f' seed {seed}'}")
            name = f"control bf16{'' if seed is None else f' seed={seed}'}"
            out = self.launcher.execute(cparams, "control", name, whatif=self.whatif)
            if out.state != "COMPLETE":
                raise RuntimeError(
                    f"the BF16 control failed ({out.error or out.state}); see {self.launcher.logs}"
                )
            self.controls[key] = out
            tag = f"fp8track.control.seed{seed if seed is not None else ''}"
            self.runs.client.set_tag(self.runs.parent_run_id, tag, out.run_id)
        return self.controls[key]

    def run(self, params: Mapping[str, Any], role: str, name: str, trial: Any = None) -> RunOutcome:
        """Run the program with ``params`` (or reuse its cached result) with the control of its seed
        and, for ``auto:K``, the ranking in its environment."""
        return self.launcher.execute(params, role, name, trial, extra_env=lambda: self._env(params, role))

    def _env(self, params: Mapping[str, Any], role: str) -> dict[str, str]:
        from fp8track.execution.fallback import FallbackSpec

        env: dict[str, str] = {}
        if role != "control":
            env[CONTROL_ENV] = f"mlflow:{self.control(params).run_id}"
        if role != "control" and FallbackSpec.parse(str(params["bf16_layers"])).needs_ranking:
            env[RANKING_ENV] = str(self.ranking(params))
        return env

    def ranking(self, params: Mapping[str, Any]) -> Path:
        """The ``auto:K`` ranking under ``params``' recipe: the monitor's statistics of the run with
        every layer in FP8 (or the control's what-if rows), ranked; written as JSON for the program."""
        if self.options.auto_from == "whatif":
            variant = whatif_variant(str(params["recipe"]))
            source = self.control(params).run_id
            key = {"p": self.launcher.program_hash, "control": source, "whatif": variant}
        else:
            variant, pparams = None, {**params, "bf16_layers": "none"}
            key = {"p": self.launcher.program_hash, "params": pparams}
        path = self.options.out / "rankings" / f"{cache_key(key)}.json"
        if path.is_file():
            return path
        if variant is not None:
            self.status(f"auto:K: {variant} what-if rows of the BF16 control")
        else:
            self.status(f"auto:K: all-FP8 run under {params['recipe']}")
            out = self.run(pparams, "probe", f"probe {params['recipe']} none")
            if out.state != "COMPLETE":
                raise RuntimeError(f"the all-FP8 run for auto:K failed ({out.error or out.state})")
            source = out.run_id
        table = self._ranking_table(source, variant)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps([r["layer"] for r in table]))
        os.replace(tmp, path)
        name = "auto_ranking_" + "".join(c if c.isalnum() else "_" for c in str(params["recipe"])) + ".json"
        self.runs.client.log_table(self.runs.parent_run_id, {k: [r.get(k) for r in table] for k in table[0]},
                                   name)
        return path

    def _ranking_table(self, source: str, variant: str | None) -> list[dict[str, Any]]:
        """The ranking of the run ``source``'s tensor rows (of ``variant``'s what-if rows when given)."""
        from fp8track.analysis.baseline import load_run
        from fp8track.analysis.ranking import rank_layers

        rows = load_run(f"mlflow:{source}", self.options.mlflow_uri).tensor_rows
        table = ranking_table(rank_layers(rows, variant=variant))
        if not table:
            raise ConfigError(
                f"auto:K from what-if rows needs the BF16 control's {variant!r} rows in its MLflow run: "
                f"pass whatif=list(trial_settings().whatif) ({WHATIF_ENV}) to the program's FP8Monitor"
                if variant is not None
                else "auto:K needs the monitor's per-layer statistics in the program's MLflow run: add "
                "FP8Monitor to the program's Trainer with the logger of trial_settings().mlflow_logger()"
            )
        return table


__all__ = ["Controls", "control_whatif"]

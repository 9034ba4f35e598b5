"""What one sweep trial is, for any training program: its settings and its cached references.

* :func:`trial_settings` reads a trial's ``recipe``, ``bf16_layers`` and control reference from the
  command line (``${args}`` of a W&B sweep: ``--recipe=current --bf16_layers=auto:2``) or, on ranks
  that have no ``wandb.config`` (DDP ranks > 0), from the YAML the W&B agent writes at
  ``WANDB_SWEEP_PARAM_PATH``; the command line wins.
* :class:`JsonCache` keeps results that every trial of a sweep shares and no trial should recompute
  (the BF16 control's held-out losses, the ``auto:K`` probe's ranking), keyed by everything they
  depend on, safe for several worker processes on one machine (a lock per key).
* :func:`ranking_table` turns :func:`fp8track.analysis.ranking.rank_layers` into table rows, so a
  person can see why ``auto:K`` kept a layer in BF16.

This module sits below ``examples`` and ``sweep`` so that both the sweep program and users' own
programs can use it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.analysis.ranking import LayerRisk
from fp8track.analysis.risk_signals import SIGNALS
from fp8track.errors import ConfigError, invalid_choice
from fp8track.execution.fallback import FallbackSpec
from fp8track.execution.recipes import Recipe
from fp8track.numerics.scaling import BLOCK_SCALINGS

PARAM_PATH_ENV = "WANDB_SWEEP_PARAM_PATH"
"""Environment variable the W&B agent sets to the YAML file holding the trial's parameters."""
RUN_ID_ENV = "MLFLOW_RUN_ID"
"""The trial's MLflow child run (MLflow's own variable: ``mlflow.start_run()`` attaches to it)."""
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
"""The sweep's MLflow store (MLflow's own variable)."""
CONTROL_ENV = "FP8TRACK_SWEEP_CONTROL"
"""The control run of the trial's seed, ``mlflow:<run_id>`` (the monitor's ``baseline``)."""
RANKING_ENV = "FP8TRACK_SWEEP_RANKING"
"""A JSON file: layer names riskiest first, for ``auto:K`` (written by ``fp8track sweep``)."""
WHATIF_ENV = "FP8TRACK_SWEEP_WHATIF"
"""What-if variants (comma-separated, e.g. ``nvfp4``) the program's monitor records; the sweep sets it
for the BF16 control under ``--auto-from whatif`` (:attr:`TrialSettings.whatif`)."""
AUTO_FROM = ("probe", "whatif")
"""Where the sweep's ``auto:K`` ranking comes from: an all-FP8 ``probe`` run of the trial's recipe,
or the ``whatif`` rows of that recipe in the BF16 control (no probe trained)."""
WHATIF_RECIPES = (*BLOCK_SCALINGS, "nvfp4")
"""Recipe families whose what-if rows a BF16 control records apart from its ``shadow`` rows."""
LAYERS_ARTIFACT = "fp8track_layers.json"
"""What :meth:`TrialSettings.apply` writes into the trial's run: every GEMM layer, its shape, FP8 or BF16."""
FLOP_SHARE_METRIC = "fp8_flop_share"
"""Share of the step's GEMM FLOPs that runs in FP8 (0..1), logged by :meth:`TrialSettings.apply`."""


@dataclass(frozen=True)
class TrialSettings:
    """A trial's FP8 settings, validated at construction.

    Attributes:
        recipe: the recipe (:meth:`Recipe.parse` of the ``recipe`` parameter).
        bf16_layers: the fallback spec as parsed.
        control: the control reference (a run directory, ``mlflow:<run_id>``, a W&B offline run),
            or ``None`` when the program computes or caches its own control.
        params: every parameter the trial received (name -> value), for logging.
    """

    recipe: Recipe
    bf16_layers: FallbackSpec
    control: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    tracking_uri: str | None = None
    ranking: tuple[str, ...] | None = None
    whatif: tuple[str, ...] = ()

    @property
    def spec(self) -> str:
        """The fallback spec as written (``"none"``, ``"first_last"`` -> ``"first:1,last:1,head"``)."""
        return str(self.bf16_layers)

    @property
    def in_sweep(self) -> bool:
        """True when ``fp8track sweep`` started this process for a trial (it owns an MLflow child run)."""
        return self.run_id is not None

    def mlflow_logger(self, **kwargs: Any) -> Any:
        """A Lightning ``MLFlowLogger`` writing into the trial's child run, or ``None`` outside a sweep.

        Lightning's ``MLFlowLogger`` ignores ``MLFLOW_RUN_ID`` (it only takes ``run_id=``), so this
        passes the run id and tracking URI the sweep set; ``FP8Monitor(trackers="auto")`` then logs
        into the same run through the logger."""
        if self.run_id is None:
            return None
        from lightning.pytorch.loggers import MLFlowLogger

        return MLFlowLogger(run_id=self.run_id, tracking_uri=self.tracking_uri, **kwargs)

    def apply(self, model: Any, backend: str = "auto", example_inputs: Any = None,
              tokens_per_step: int | None = None) -> Any:
        """:func:`fp8track.apply_fp8` with this trial's recipe, fallback spec and ``auto:K`` ranking;
        in a sweep, also records the layer table (:func:`layer_costs`) in the trial's run: the
        ``fp8_flop_share`` metric, the BF16 layers' names (tag ``fp8track.bf16_layer_names``) and
        the ``fp8track_layers.json`` artifact. Returns the :class:`~fp8track.execution.apply.ApplyReport`."""
        from fp8track.execution.apply import apply_fp8

        costs = layer_costs(model)  # shapes before conversion (every backend keeps [out, in])
        ranking = align_ranking(self.ranking, [c.name for c in costs]) if self.ranking else None
        report = apply_fp8(model, self.recipe, bf16_layers=self.bf16_layers, backend=backend,
                           ranking=ranking, example_inputs=example_inputs)
        if self.run_id is not None:
            self.record_layers(report, costs, tokens_per_step)
        return report

    def record_layers(
        self, report: Any, costs: Sequence[LayerCost], tokens_per_step: int | None = None
    ) -> None:
        """Write the layer table of ``report`` into the trial's run (no-op outside a sweep): metrics
        ``fp8_flop_share`` and ``n_bf16_layers``, tag ``fp8track.bf16_layer_names``, artifact
        ``fp8track_layers.json``; with ``tokens_per_step`` also ``gemm_tflop_per_step`` (forward and
        backward, ``6 * tokens * in * out`` summed). A tracker failure warns and training goes on."""
        if self.run_id is not None:
            _record_layers(self, report, costs, tokens_per_step)


def add_trial_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--recipe``, ``--bf16_layers`` (alias ``--bf16-layers``) and ``--control`` to ``parser``.

    Defaults are ``None`` so :func:`trial_settings` can tell "not given" from a value.
    """
    parser.add_argument(
        "--recipe", default=None, help="FP8 recipe string, e.g. delayed:hybrid:h16:max (default delayed)"
    )
    parser.add_argument(
        "--bf16_layers",
        "--bf16-layers",
        dest="bf16_layers",
        default=None,
        help="layers kept in BF16: none, first:N, last:N, first_last, re:REGEX, auto:K (default none)",
    )
    parser.add_argument(
        "--control", default=None, help="control run: run directory, mlflow:<run_id> or W&B offline run"
    )
    return parser


def read_param_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parameters of a W&B agent's YAML (``{name: {"value": v}}``, ``wandb_version`` skipped).

    Raises:
        ConfigError: the file is missing, not safe YAML, or not a mapping.
    """
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read the sweep parameter file {p} ({PARAM_PATH_ENV}): {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"sweep parameter file {p} is not safe YAML: {err}") from err
    if not isinstance(data, Mapping):
        raise ConfigError(f"sweep parameter file {p} must hold a mapping, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k == "wandb_version" or str(k).startswith("_"):
            continue
        out[str(k)] = v.get("value") if isinstance(v, Mapping) and "value" in v else v
    return out


def trial_settings(
    argv: Sequence[str] | None = None,
    *,
    param_path: str | os.PathLike[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> TrialSettings:
    """Read a trial's settings; the command line wins over the W&B parameter file, which wins over
    ``defaults`` (``recipe="delayed"``, ``bf16_layers="none"`` unless given).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``); unknown options are ignored, so
            the program's own options can sit beside them.
        param_path: the W&B parameter YAML (default: ``$WANDB_SWEEP_PARAM_PATH`` when set).
        defaults: fallback values for ``recipe``, ``bf16_layers``, ``control``.

    Raises:
        ConfigError: a recipe or fallback spec that does not parse (before any training).

    Example:
        >>> s = trial_settings(["--recipe=current", "--bf16_layers=first_last", "--lr=1e-3"], param_path="")
        >>> s.recipe.name, s.spec
        ('current', 'first:1,last:1')
    """
    cli, _unknown = add_trial_arguments(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    path = os.environ.get(PARAM_PATH_ENV) if param_path is None else (param_path or None)
    from_file = read_param_file(path) if path else {}
    values: dict[str, Any] = {
        "recipe": "delayed",
        "bf16_layers": "none",
        "control": None,
        **dict(defaults or {}),
    }
    if os.environ.get(CONTROL_ENV):
        values["control"] = os.environ[CONTROL_ENV]
    values.update({k: v for k, v in from_file.items() if v is not None})
    values.update({k: v for k, v in vars(cli).items() if v is not None})
    ranking = None
    if os.environ.get(RANKING_ENV):
        try:
            ranking = tuple(str(n) for n in json.loads(Path(os.environ[RANKING_ENV]).read_text()))
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"cannot read the auto:K ranking {os.environ[RANKING_ENV]} ({RANKING_ENV}): {err}"
            ) from err
    whatif = tuple(v for v in os.environ.get(WHATIF_ENV, "").split(",") if v)
    for v in whatif:
        if v not in WHATIF_RECIPES:
            raise invalid_choice(f"what-if variant in {WHATIF_ENV}", v, WHATIF_RECIPES)
    return TrialSettings(
        recipe=Recipe.parse(values["recipe"]),
        bf16_layers=FallbackSpec.parse(values["bf16_layers"]),
        control=values["control"] or None,
        params=values,
        run_id=os.environ.get(RUN_ID_ENV) or None,
        tracking_uri=os.environ.get(TRACKING_URI_ENV) or None,
        ranking=ranking,
        whatif=whatif,
    )


def whatif_variant(recipe: str | Recipe) -> str:
    """The what-if variant whose rows show ``recipe`` on a run of another recipe (``auto:K`` from a
    control recorded with it): its family, one of :data:`WHATIF_RECIPES`. The what-if uses the
    family's TE defaults (NVFP4: RHT, stochastic rounding and 2-D weight tiles on).

    Raises:
        ConfigError: ``recipe`` has no what-if rows of its own (delayed and current scaling are
            the control's ``shadow`` rows or need the run's own scale history).
    """
    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(recipe)
    if r.scaling not in WHATIF_RECIPES:
        raise invalid_choice(
            f"recipe for auto:K from what-if rows ({r.to_string()})", r.name, WHATIF_RECIPES,
            "Rank it from a probe run instead (--auto-from probe)",
        )
    return r.scaling


def align_ranking(ranking: Sequence[str], names: Sequence[str]) -> list[str]:
    """``ranking`` in the names of the model being converted. The monitor names layers from the
    module it watches (a LightningModule: ``model.model.layers.0.mlp``), the program may convert
    the inner model (``model.layers.0.mlp``): a ranked name maps to the longest layer name it ends
    with (after a dot); names matching no layer are dropped. One expert's row
    (``<experts>.<param>.expert_<e>``) stands for its projection ``<experts>.<param>``.

    Example:
        >>> align_ranking(["model.lm_head", "model.model.layers.0.q"], ["model.layers.0.q", "lm_head"])
        ['lm_head', 'model.layers.0.q']
    """
    from fp8track.execution.experts import projection_of_row

    out: list[str] = []
    for r in map(projection_of_row, ranking):  # one expert's row designates its projection
        hits = [n for n in names if r == n or r.endswith("." + n)]
        if hits:
            best = max(hits, key=len)
            if best not in out:
                out.append(best)
    return out


# --- what a trial costs: GEMM FLOPs by layer ----------------------------------------------------------


@dataclass(frozen=True)
class LayerCost:
    """One GEMM of a step: qualified name, ``in_features``, ``out_features`` (the ``[out, in]``
    weight), and how many times each token passes through it.

    ``macs_per_token = slots * in * out``: a dense layer sees every token once (``slots`` 1), so its
    forward GEMM costs ``2 * tokens * in * out`` FLOPs and forward + both backward GEMMs
    ``6 * tokens * in * out``. A fused expert projection (``<experts>.<param>``, ``group`` its experts
    module) runs on the routed (token, expert) slots: ``slots = top_k`` per token whichever experts
    get them (Llama 4's dense experts: every expert sees every token, ``slots = E``).
    """

    name: str
    in_features: int
    out_features: int
    slots: int = 1
    group: str | None = None

    @property
    def macs_per_token(self) -> int:
        return self.slots * self.in_features * self.out_features


def layer_costs(model: Any) -> list[LayerCost]:
    """Every GEMM of ``model`` with its shape: its GEMM layers
    (:func:`fp8track.execution.layers.gemm_layers`), each fused expert projection with its routed
    slots per token, and the routers that are no linear layer (Mixtral's ``gate``)."""
    from fp8track.execution.experts import find_moe
    from fp8track.execution.layers import gemm_layers, gemm_weight

    moe = find_moe(model)
    groups = {b.experts.fqn: b.experts for b in moe.blocks}
    out = []
    names = set()
    for name, module in gemm_layers(model):
        names.add(name)
        group = groups.get(name)
        if group is not None and group.params:
            slots = group.num_experts if group.kind == "dense" else (group.top_k or 1)
            for p in group.params:
                w = p.weight_oi(module)
                out.append(LayerCost(f"{name}.{p.name}", int(w.shape[2]), int(w.shape[1]), slots, name))
            continue
        w = gemm_weight(module)
        if w is not None and w.dim() == 2:
            out.append(LayerCost(name, int(w.shape[1]), int(w.shape[0])))
    for block in moe.blocks:
        if block.router_gemm is not None and block.router_gemm not in names:
            w = model.get_submodule(block.router_gemm).weight
            out.append(LayerCost(block.router_gemm, int(w.shape[1]), int(w.shape[0])))
    return out


def fp8_flop_share(costs: Sequence[LayerCost], fp8_layers: Sequence[str]) -> float:
    """Share of the step's GEMM FLOPs that runs in FP8: ``sum(macs_per_token over FP8 GEMMs) /
    sum(macs_per_token)``.

    The ``6 * tokens`` factor of each GEMM's FLOPs cancels (an expert projection's routed slots are
    in its ``macs_per_token``); an expert projection runs FP8 when it or its experts module is among
    ``fp8_layers``. NaN when the model has no GEMM layer.

    Example:
        >>> costs = [LayerCost("a", 64, 64), LayerCost("head", 64, 256)]
        >>> round(fp8_flop_share(costs, ["a"]), 3)   # 4096 / (4096 + 16384)
        0.2
    """
    total = sum(c.macs_per_token for c in costs)
    fp8 = set(fp8_layers)
    on = sum(c.macs_per_token for c in costs if runs_fp8(c, fp8))
    return on / total if total else math.nan


def runs_fp8(cost: LayerCost, fp8_layers: set[str]) -> bool:
    """Whether the GEMM ``cost`` runs in FP8: it, or the experts module of an expert projection,
    is among ``fp8_layers`` (``experts`` converted whole, or one projection of it)."""
    return cost.name in fp8_layers or (cost.group is not None and cost.group in fp8_layers)


def _record_layers(
    settings: TrialSettings, report: Any, costs: Sequence[LayerCost], tokens_per_step: int | None
) -> None:
    """Write the layer table into the trial's run; a tracker failure never stops training."""
    import warnings

    try:
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient

        fp8 = set(report.fp8_layers)
        rows = [{"layer": c.name, "in": c.in_features, "out": c.out_features, "fp8": runs_fp8(c, fp8),
                 "macs_per_token": c.macs_per_token} for c in costs]
        share = fp8_flop_share(costs, report.fp8_layers)
        bf16 = [n for n, _ in report.bf16_layers] if report.recipe.quantizes else []
        client = MlflowClient(settings.tracking_uri)
        now = int(time.time() * 1000)
        metrics = [Metric(FLOP_SHARE_METRIC, share if math.isfinite(share) else 0.0, now, 0),
                   Metric("n_bf16_layers", float(len(bf16)), now, 0)]
        if tokens_per_step:
            total = 6.0 * tokens_per_step * sum(c.macs_per_token for c in costs)
            metrics.append(Metric("gemm_tflop_per_step", total / 1e12, now, 0))
        client.log_batch(
            settings.run_id,
            metrics=metrics,
            tags=[RunTag("fp8track.bf16_layer_names", ",".join(bf16)[:8000] or "none")],
            synchronous=True,
        )
        client.log_dict(
            settings.run_id, {"layers": rows, "tokens_per_step": tokens_per_step}, LAYERS_ARTIFACT
        )
    except Exception as err:  # noqa: BLE001 - the run must go on without its layer table
        warnings.warn(
            f"fp8track: could not record the layer table in MLflow run {settings.run_id}: {err}", stacklevel=3
        )


# --- shared, cached results ----------------------------------------------------------------------


def cache_key(parts: Mapping[str, Any]) -> str:
    """A short stable hash of ``parts`` (JSON with sorted keys): 16 hex digits."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class JsonCache:
    """JSON results in ``root/<kind>-<key>.json``, computed once per key.

    :meth:`get_or_compute` holds an exclusive ``flock`` on ``<kind>-<key>.lock`` while it computes,
    so two worker processes on one machine wait for each other instead of computing twice; the
    result is written to a temporary file and renamed, so a killed writer leaves no torn entry.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, kind: str, parts: Mapping[str, Any]) -> Path:
        return self.root / f"{kind}-{cache_key(parts)}.json"

    def get(self, kind: str, parts: Mapping[str, Any]) -> dict[str, Any] | None:
        p = self.path(kind, parts)
        return json.loads(p.read_text()) if p.is_file() else None

    def put(self, kind: str, parts: Mapping[str, Any], result: Mapping[str, Any]) -> None:
        """Store ``result`` for ``parts`` (written to a temporary file and renamed: never torn)."""
        p = self.path(kind, parts)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": dict(parts), **dict(result)}, indent=1, default=str))
        os.replace(tmp, p)

    def get_or_compute(
        self, kind: str, parts: Mapping[str, Any], compute: Callable[[], Mapping[str, Any]]
    ) -> tuple[dict[str, Any], bool]:
        """``(result, cached)``: the stored result for ``parts``, or ``compute()`` stored now."""
        p = self.path(kind, parts)
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(p.with_suffix(".lock")):
            if p.is_file():
                return json.loads(p.read_text()), True
            result = dict(compute())
            self.put(kind, parts, result)
            return {"key": dict(parts), **result}, False


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing): one process at a time on
    this machine."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- the auto:K ranking as a table ------------------------------------------------------------------


def ranking_table(ranking: Sequence[LayerRisk]) -> list[dict[str, Any]]:
    """One row per layer, riskiest first: ``rank``, ``layer``, ``score``, the ``tensor`` giving it,
    the five z-scores (``z_<signal>``) and that tensor's summarised ``sqnr_db``, ``underflow_pct``,
    ``overflow_pct``, ``abs_drift_log2`` (NaN written as ``None``)."""

    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None

    rows = []
    for i, r in enumerate(ranking):
        st = r.stats.get(r.tensor, {})
        row: dict[str, Any] = {"rank": i + 1, "layer": r.layer, "score": num(r.score), "tensor": r.tensor}
        row.update({f"z_{s}": num(r.z.get(s)) for s in SIGNALS})
        row.update(
            {k: num(st.get(k)) for k in ("sqnr_db", "underflow_pct", "overflow_pct", "abs_drift_log2")}
        )
        rows.append(row)
    return rows


__all__ = [
    "PARAM_PATH_ENV", "RUN_ID_ENV", "TRACKING_URI_ENV", "CONTROL_ENV", "RANKING_ENV", "LAYERS_ARTIFACT",
    "FLOP_SHARE_METRIC", "LayerCost", "align_ranking", "layer_costs", "fp8_flop_share", "runs_fp8",
    "TrialSettings", "add_trial_arguments", "read_param_file", "trial_settings", "cache_key", "JsonCache",
    "file_lock", "ranking_table",
]

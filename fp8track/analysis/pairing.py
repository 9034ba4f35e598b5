"""Pairing before judging: are the FP8 run and its control two runs of the same model, the first in
FP8 and the second in BF16, over the same steps?

A diagnosis of two runs that do not belong together is a confident wrong answer (swapped runs
read as healthy, the same run twice as healthy, another model as a divergence from the start), so
:func:`check_pairing` refuses such a pair with one line (a :class:`Mismatch`), checked in this
order:

1. ``same_run``: the same run id, the same run reference, or identical loss values at every
   common step;
2. ``swapped`` / ``not_fp8`` / ``control_not_bf16``: what each run ran in (:func:`run_precision`:
   its recipe, else its FP8 layers, else rows recorded in shadow mode only); unknown is no
   evidence, so a run whose metadata is lost is never refused for it;
3. ``layers``: the canonical layer names of the two runs' tensor statistics differ
   (:func:`fp8track.monitoring.naming.canonical_layer_name`, then a holder prefix one run alone
   has, such as a LightningModule's ``model.`` against a plain loop, is aligned: :func:`align_runs`);
4. ``shapes``: a layer's weight has another element count (``numel``) in the control;
5. ``steps``: fewer than :data:`MIN_COMMON_STEPS` common loss steps, or fewer than half of the
   shorter run's loss steps (different step units or ranges).

A run without tensor statistics (a loss-only control) skips checks 3 and 4.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fp8track.analysis.baseline import RunData
from fp8track.errors import ConfigError
from fp8track.monitoring.naming import canonical_layer_name

MISMATCH_KINDS = ("same_run", "swapped", "not_fp8", "control_not_bf16", "layers", "shapes", "steps")
"""Why two runs cannot be compared, in the order they are checked."""

MIN_COMMON_STEPS = 3
"""Fewest common loss steps a diagnosis can judge (a step-to-step noise needs three values)."""

MIN_STEP_SHARE = 0.5
"""Least share of the shorter run's loss steps the other run must also have logged."""


@dataclass(frozen=True)
class Mismatch:
    """Why an FP8 run and a control cannot be diagnosed together.

    Attributes:
        kind: one of :data:`MISMATCH_KINDS`.
        message: one line naming both runs and what to pass instead.
    """

    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in MISMATCH_KINDS:
            raise ConfigError(
                f"unknown mismatch kind {self.kind!r}; valid values are: {', '.join(MISMATCH_KINDS)}"
            )
        if "\n" in self.message or not self.message:
            raise ConfigError("a Mismatch message is one non-empty line")


# --- what a run is -------------------------------------------------------------------------------


_NO_VALUE = ("", "None", "null")
"""How a missing value reads back from a tracker that stores every parameter as text (MLflow
writes ``str(None)``)."""


def run_recipe(run: RunData) -> str | None:
    """The run's FP8 recipe as text (``"delayed:hybrid:h16:max"``, ``"bf16"``), ``None`` when its
    metadata does not say (a run never converted by :func:`fp8track.apply_fp8`)."""
    recipe = run.meta.get("recipe")
    if isinstance(recipe, Mapping) and recipe.get("name"):
        from fp8track.execution.recipes import Recipe

        if recipe["name"] == "bf16":  # the control: its format and history options mean nothing
            return "bf16"

        try:
            return str(Recipe.from_dict(recipe))
        except (ConfigError, TypeError, ValueError):
            return str(recipe["name"])
    if isinstance(recipe, str) and recipe not in _NO_VALUE:
        return recipe
    precision = (
        (run.meta.get("config") or {}).get("precision")
        if isinstance(run.meta.get("config"), Mapping)
        else None
    )
    text = precision.get("recipe") if isinstance(precision, Mapping) else None
    return str(text) if text and str(text) not in _NO_VALUE else None


def run_name(run: RunData) -> str:
    """The run's name (``meta["name"]`` unless it is the default ``"fp8track"``), else the last part
    of its reference (run directory, ``mlflow:<id>``, W&B run folder)."""
    name = run.meta.get("name")
    if isinstance(name, str) and name and name != "fp8track":
        return name
    source = str(run.source).rstrip("/\\")
    return os.path.basename(source) or source


def run_label(run: RunData) -> str:
    """``"<name> (<recipe>)"``, how messages and the report name a run."""
    recipe = run_recipe(run)
    return f"{run_name(run)} ({recipe})" if recipe else run_name(run)


def run_precision(run: RunData) -> str | None:
    """``"fp8"``, ``"bf16"`` or ``None`` (no evidence): the recipe in the metadata, else FP8 layers
    in the metadata, else tensor statistics recorded in shadow mode only (BF16 layers measured as
    FP8 would quantise them). Rows rebuilt from tracker scalars carry no mode, so they are no
    evidence of FP8."""
    recipe = run_recipe(run)
    if recipe:
        return "bf16" if recipe.split(":", 1)[0] == "bf16" else "fp8"
    if run.meta.get("fp8_layers"):
        return "fp8"
    variants = {getattr(r, "variant", "actual") for r in run.tensor_rows}
    return "bf16" if "shadow" in variants and "actual" not in variants else None


# --- layer names -----------------------------------------------------------------------------------


def _layers(run: RunData) -> set[str]:
    return {canonical_layer_name(r.layer) for r in run.tensor_rows}


def _strip_head(names: set[str], other: set[str]) -> dict[str, str] | None:
    """``names`` -> the same names without a first segment they all share, when that gives exactly
    ``other`` (a holder one run alone has); ``None`` otherwise."""
    heads = {n.split(".", 1)[0] for n in names}
    if len(heads) != 1 or any("." not in n for n in names):
        return None
    mapping = {n: n.split(".", 1)[1] for n in names}
    return mapping if set(mapping.values()) == other else None


def layer_alignment(fp8: RunData, control: RunData) -> tuple[dict[str, str], dict[str, str]]:
    """Recorded layer name -> common name, for each run: canonical names, then a holder prefix that
    only one run has (all its names under one first segment, removing which gives the other run's
    names exactly) dropped. Runs with different layers keep their canonical names."""
    a = {r.layer: canonical_layer_name(r.layer) for r in fp8.tensor_rows}
    b = {r.layer: canonical_layer_name(r.layer) for r in control.tensor_rows}
    sa, sb = set(a.values()), set(b.values())
    if sa and sb and sa != sb:
        if (m := _strip_head(sa, sb)) is not None:
            a = {k: m[v] for k, v in a.items()}
        elif (m := _strip_head(sb, sa)) is not None:
            b = {k: m[v] for k, v in b.items()}
    return a, b


def _renamed(run: RunData, mapping: Mapping[str, str]) -> RunData:
    """``run`` with its rows' layers and its metadata's layer lists under their common names."""
    names = set(mapping.values())

    def common(layer: str) -> str:
        if layer in mapping:
            return mapping[layer]
        c = canonical_layer_name(layer)
        if c in names or "." not in c:
            return c
        tail = c.split(".", 1)[1]  # apply_fp8 named the layer from a holder the records do not carry
        return tail if tail in names else c

    rows = [r if mapping.get(r.layer, r.layer) == r.layer else dataclasses.replace(r, layer=mapping[r.layer])
            for r in run.tensor_rows]
    meta = dict(run.meta)
    for key in ("fp8_layers", "bf16_layers"):
        if isinstance(meta.get(key), (list, tuple)):
            meta[key] = [common(str(n)) for n in meta[key]]
    return dataclasses.replace(run, tensor_rows=rows, meta=meta)


def align_runs(fp8: RunData, control: RunData) -> tuple[RunData, RunData]:
    """Both runs with their layers under common names (:func:`layer_alignment`), so that the
    diagnosis, its ranking and the control's scores speak of the same layers."""
    a, b = layer_alignment(fp8, control)
    return _renamed(fp8, a), _renamed(control, b)


# --- the checks ------------------------------------------------------------------------------------


def _preview(names: Iterable[str], limit: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _same_run(
    fp8: RunData, control: RunData, fl: Mapping[int, float] | None, cl: Mapping[int, float] | None
) -> str | None:
    ids = (fp8.meta.get("run_id"), control.meta.get("run_id"))
    if ids[0] and ids[0] == ids[1]:
        return f"run id {ids[0]}"
    if os.path.realpath(str(fp8.source)) == os.path.realpath(str(control.source)):
        return f"reference {fp8.source}"
    if fl is not None and cl is not None:
        common = sorted(set(fl) & set(cl))
        if len(common) >= MIN_COMMON_STEPS and all(
            fl[s] == cl[s] or (math.isnan(fl[s]) and math.isnan(cl[s])) for s in common
        ):
            return f"identical loss at all {len(common)} common steps"
    return None


def _weight_numel(run: RunData, mapping: Mapping[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in run.tensor_rows:
        n = r.stats.get("numel") if r.tensor == "weight" else None
        if isinstance(n, (int, float)) and math.isfinite(n) and n > 0:
            out.setdefault(mapping.get(r.layer, r.layer), float(n))
    return out


def _loss(run: RunData) -> Mapping[int, float] | None:
    try:
        return run.metrics[run.loss_key()]
    except ConfigError:  # no loss at all: the diagnosis itself says so
        return None


def check_pairing(fp8: RunData, control: RunData) -> Mismatch | None:
    """``None`` when ``fp8`` and ``control`` can be diagnosed together, else the first
    :class:`Mismatch` in the module docstring's order."""
    fl, cl = _loss(fp8), _loss(control)
    f_label, c_label = run_label(fp8), run_label(control)
    same = _same_run(fp8, control, fl, cl)
    if same is not None:
        return Mismatch("same_run", f"the FP8 run and the control are the same run ({same}): {f_label}; "
                                    "pass the BF16 control run as --control")
    fp, cp = run_precision(fp8), run_precision(control)
    if fp == "bf16" and cp == "fp8":
        return Mismatch(
            "swapped",
            f"the runs are swapped: the FP8 run {f_label} ran in BF16 and the control "
            f"{c_label} in FP8; pass the FP8 run first and the BF16 control second (--control)",
        )
    if fp == "bf16":
        return Mismatch("not_fp8", f"the FP8 run {f_label} ran in BF16: nothing to diagnose; pass an FP8 run")
    if cp == "fp8":
        return Mismatch(
            "control_not_bf16", f"the control {c_label} ran in FP8; the diagnosis needs a BF16 control"
        )
    a, b = layer_alignment(fp8, control)
    sa, sb = set(a.values()), set(b.values())
    if sa and sb and sa != sb:
        only_f, only_c = sa - sb, sb - sa
        what = "no layer in common" if not sa & sb else (
            f"{len(only_f)} layer(s) only in the FP8 run ({_preview(only_f) or 'none'}), "
            f"{len(only_c)} only in the control ({_preview(only_c) or 'none'})")
        return Mismatch(
            "layers",
            f"the FP8 run {f_label} and the control {c_label} monitored different layers "
            f"({what}): not the same model",
        )
    wf, wc = _weight_numel(fp8, a), _weight_numel(control, b)
    differ = sorted(n for n in set(wf) & set(wc) if wf[n] != wc[n])
    if differ:
        n = differ[0]
        return Mismatch(
            "shapes",
            f"the FP8 run {f_label} and the control {c_label} have layers of other sizes "
            f"({len(differ)} layer(s); {n}: weight of {wf[n]:.0f} vs {wc[n]:.0f} elements): "
            "not the same model",
        )
    if fl is not None and cl is not None:
        common = len(set(fl) & set(cl))
        shorter = min(len(fl), len(cl))
        if common < MIN_COMMON_STEPS or common < MIN_STEP_SHARE * shorter:
            return Mismatch(
                "steps",
                f"the FP8 run {f_label} and the control {c_label} share {common} logged loss "
                f"steps of {len(fl)} and {len(cl)}: too few to compare (at least "
                f"{MIN_COMMON_STEPS} and half of the shorter run's)",
            )
    return None


def require_pairing(fp8: RunData, control: RunData) -> None:
    """:func:`check_pairing`, raising its one-line message as a :class:`~fp8track.errors.ConfigError`
    (what ``fp8track diagnose`` prints before exiting 2)."""
    mismatch = check_pairing(fp8, control)
    if mismatch is not None:
        raise ConfigError(mismatch.message)


__all__ = [
    "Mismatch",
    "MISMATCH_KINDS",
    "MIN_COMMON_STEPS",
    "check_pairing",
    "require_pairing",
    "align_runs",
    "layer_alignment",
    "run_precision",
    "run_recipe",
    "run_name",
    "run_label",
]

"""What the MLflow tracker writes as a run's params and tags (the compare view's axes, short and
only those that apply) and :data:`META_ARTIFACT` (the whole run metadata); the reader parses them
back (:func:`unflatten`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fp8track.execution.recipes import RECIPE_OPTIONS
from fp8track.monitoring.records import RunMeta

MAX_PARAMS_TAGS_PER_BATCH = 100


MAX_PARAM_VALUE_LEN = 6000


MAX_TAG_VALUE_LEN = 8000


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """Nested mappings -> ``{"prefix.a.b": "value"}`` with string values (for params/tags)."""
    out: dict[str, str] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            out.update(flatten(f"{prefix}.{k}", v))
    elif isinstance(value, (list, tuple)):
        out[prefix] = ",".join(map(str, value))
    else:
        out[prefix] = str(value)
    return out


def unflatten(flat: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """Inverse of :func:`flatten` for the params under ``prefix``: ``{"p.a.b": "1"}`` ->
    ``{"a": {"b": 1}}`` (values parsed as JSON when they are).

    Example:
        >>> unflatten({"fp8.recipe.name": "delayed", "fp8.recipe.margin": "0", "other": "x"}, "fp8.recipe")
        {'name': 'delayed', 'margin': 0}
    """
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if not k.startswith(prefix + "."):
            continue
        node = out
        *parents, leaf = k[len(prefix) + 1 :].split(".")
        for p in parents:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                break
            node = nxt
        else:
            try:
                node[leaf] = json.loads(v)
            except ValueError:
                node[leaf] = v
    return out


def applicable_recipe_fields(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's fields that apply to it (``RECIPE_OPTIONS``, the recipe grammar's own table):
    only ``name`` for ``bf16``; the amax history only for ``delayed``; ``margin`` for per-tensor
    scaling; ``variant`` for ``current``; the NVFP4 switches for ``nvfp4``. The rest would be
    compare-view axes a run never used (a BF16 control has no amax history)."""
    name = recipe.get("name")
    if name == "bf16":
        return {"name": name}
    options = {o for opts in RECIPE_OPTIONS.values() for o in opts}
    used = set(RECIPE_OPTIONS.get(str(name), options))
    return {k: v for k, v in recipe.items() if k not in options or k in used}


META_ARTIFACT = "fp8track_meta.json"
"""The run's whole :class:`RunMeta` (config, apply report, data fingerprint, full layer lists)."""


def run_params(meta: RunMeta) -> dict[str, str]:
    """The monitor's MLflow params: the compare view's axes, so short and only those that apply.

    * ``fp8.recipe.*``: :func:`applicable_recipe_fields` (a BF16 control or a current-scaling run
      has no amax history);
    * ``fp8.backend``, ``fp8.n_bf16_layers``, ``fp8.n_fp8_layers``: when the model went through
      :func:`fp8track.apply_fp8` (counts, not lists: a comma list of layer names is cut to a few
      characters on a compare-view axis; the lists are tags, the whole set the artifact);
    * ``fp8track.precision.*``: what the run enabled around precision (strategy, compile, ...),
      values that are set (no ``None``) except the recipe, which ``fp8.recipe.*`` already holds.

    The monitor's own settings, the apply report and the data fingerprint are in
    :data:`META_ARTIFACT`, not params.
    """
    recipe = dict(meta.recipe or {})
    params = flatten("fp8.recipe", applicable_recipe_fields(recipe)) if recipe else {}
    config = dict(meta.config or {})
    apply = config.get("apply")
    if isinstance(apply, Mapping) and apply.get("backend"):
        params["fp8.backend"] = str(apply["backend"])
    if recipe:
        params["fp8.n_bf16_layers"] = str(len(meta.bf16_layers))
        params["fp8.n_fp8_layers"] = str(len(meta.fp8_layers))
    precision = config.get("precision")
    if isinstance(precision, Mapping):
        params.update(flatten("fp8track.precision", {
            k: v for k, v in precision.items() if v is not None and k != "recipe"}))
    return params


def name_list(names: Sequence[str], limit: int = MAX_TAG_VALUE_LEN) -> str:
    """``names`` joined by commas, cut at a whole name to fit ``limit`` characters with the count
    of those left out (the full list is in :data:`META_ARTIFACT`); ``"none"`` when empty.

    Example:
        >>> name_list(["layer.0", "layer.1", "layer.2"], limit=20)
        'layer.0 (+2 more)'
    """
    text = ",".join(names)
    if len(text) <= limit:
        return text or "none"
    end = -1  # length of the names kept so far, with their commas
    for i, name in enumerate(names):
        end += len(name) + 1
        if end + len(f" (+{len(names) - i - 1} more)") > limit:
            return (",".join(names[:i]) + f" (+{len(names) - i} more)").lstrip()
    return text  # unreachable: the whole text is longer than the limit


def run_tags(meta: RunMeta) -> dict[str, str]:
    """The monitor's MLflow tags: ``fp8.recipe`` (the recipe's name), ``fp8.bf16_layers`` and
    ``fp8.fp8_layers`` (the layer lists, :func:`name_list`), ``fp8track.run_id``,
    ``fp8track.version.*``."""
    recipe = dict(meta.recipe or {})
    tags = {
        "fp8.recipe": str(recipe.get("name", json.dumps(recipe, sort_keys=True) if recipe else "none")),
        "fp8.bf16_layers": name_list(list(meta.bf16_layers)),
        "fp8.fp8_layers": name_list(list(meta.fp8_layers)),
        "fp8track.run_id": str(meta.run_id),
    }
    tags.update(flatten("fp8track.version", dict(meta.versions)))
    return tags

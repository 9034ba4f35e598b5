"""Tensor dumps: the tensors of implicated layers on the sampled step after an event, saved so the
problem can be reproduced offline, and the reader that recomputes their statistics exactly.

What TE >= 2.15's ``DumpTensors`` debug feature does on TE (``torch.save`` of the high-precision and
quantised tensors per layer and iteration); this one works on every backend and on CPU.

One file per (step, layer): ``<run_dir>/dumps/step<step:08d>/<layer>.pt``, a plain dict that
``torch.load(path, weights_only=True)`` reads (tensors, strings, numbers, lists, dicts only)::

    {"format": 1, "step": int, "layer": str,
     "plan": {"fp8": bool, "formats": {tensor: "e4m3" | "e5m2"}, "scaling": str, "margin": int,
              "power_2_scales": bool | None, "variant": "actual" | "shadow"},
     "observations": [{"tensor": "activation" | "weight" | "gradient",
                       "x": high-precision tensor (the dtype the GEMM saw, on the CPU),
                       "scale": float32 scalar tensor the backend used (delayed scaling) or None,
                       "q": the FP8 tensor x * scale saturated to the format (per-tensor scaling),
                            or None (block recipes: their per-block scales are re-derived)}, ...]}

Observations are in the order the hooks saw them (micro-batches in order), so merging their
partials reproduces the logged row (:func:`recompute_stats`). Dumps are bounded: at most
``max_dumps`` per run and ``max_bytes`` per dump (layers past the budget are left out and the
``dump`` event says so). Only the writer rank dumps, its own (local) tensors.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8track.errors import ConfigError, check_int
from fp8track.monitoring.capture import LayerCapture
from fp8track.monitoring.plans import LayerPlan, tensor_partial
from fp8track.monitoring.records import EventRecord
from fp8track.numerics.scaling import quantize
from fp8track.numerics.stats import finalize

DUMP_FORMAT = 1
DUMP_DIR = "dumps"


@dataclass(frozen=True)
class DumpPolicy:
    """Bounds on tensor dumps.

    Attributes:
        max_dumps: dumps (events) per run; 0 switches dumps off.
        max_bytes: bytes of tensors per dump (all its layers together).
    """

    max_dumps: int = 2
    max_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        check_int("max_dumps", self.max_dumps, 0)
        check_int("max_dump_bytes", self.max_bytes, 1)


class DumpBudget:
    """The bytes one dump may still hold, shared by the layers it covers."""

    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes
        self.refused: set[str] = set()

    def take(self, layer: str, nbytes: int) -> bool:
        if layer in self.refused or nbytes > self.left:
            self.refused.add(layer)
            return False
        self.left -= nbytes
        return True


@dataclass
class LayerDump:
    """One layer's dumped observations of one step (what a dump file holds)."""

    step: int
    layer: str
    plan: dict[str, Any]
    observations: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DUMP_FORMAT,
            "step": self.step,
            "layer": self.layer,
            "plan": self.plan,
            "observations": self.observations,
        }


def plan_dict(plan: Any) -> dict[str, Any]:
    """The parts of a :class:`fp8track.monitoring.plans.LayerPlan` a dump needs (plain data)."""
    return {
        "fp8": bool(plan.fp8),
        "formats": dict(plan.formats),
        "scaling": plan.scaling,
        "margin": int(plan.margin),
        "power_2_scales": plan.power_2_scales,
        "variant": plan.variant,
    }


def observation(
    tensor: str, x: torch.Tensor, scale: torch.Tensor | None, fmt: str, per_tensor: bool
) -> dict[str, Any]:
    """One dumped observation: ``x`` (copied to the CPU), the scale the backend used, the FP8 tensor."""
    x = x.detach()
    q = None
    if per_tensor and scale is not None:
        q = quantize(x, fmt, scale).cpu()
    return {
        "tensor": tensor,
        "x": x.to("cpu", copy=True),
        "scale": None if scale is None else scale.detach().to("cpu", torch.float32).reshape(()),
        "q": q,
    }


def _file_name(layer: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", layer) + ".pt"


def write_dump(run_dir: Path, dump: LayerDump) -> tuple[Path, int]:
    """Save one layer's dump; returns its path and size in bytes.

    The file is written under a temporary name and renamed when complete, so a failed write
    leaves no partial ``.pt`` behind.

    Raises:
        OSError: the file could not be written (a full disk, a file-size limit, ...). ``torch.save``
            reports a short write as ``RuntimeError`` ("unexpected pos"), raised here as ``OSError``.
    """
    folder = run_dir / DUMP_DIR / f"step{dump.step:08d}"
    path = folder / _file_name(dump.layer)
    partial = path.with_name(path.name + ".partial")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(dump.to_dict(), partial)
        os.replace(partial, path)
    except (OSError, RuntimeError) as exc:
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: the step's other layers may have been written
        raise OSError(f"cannot write {path}: {type(exc).__name__}: {exc}") from exc
    return path, path.stat().st_size


def write_dumps(run_dir: Path, dumps: Iterable[LayerDump]) -> tuple[list[Path], int, str | None]:
    """Save the layers of one dump (:func:`write_dump`), stopping at the first that fails (on a
    full disk or past a file-size limit the others would fail too).

    Returns:
        the files written, their total size in bytes, and the error (``None`` when all were written).
    """
    files: list[Path] = []
    total = 0
    for dump in dumps:
        try:
            path, size = write_dump(run_dir, dump)
        except OSError as exc:
            return files, total, str(exc)
        files.append(path)
        total += size
    return files, total, None


class DumpControl:
    """When the monitor dumps: an event asks (:meth:`request`), the next sampled step arms the
    layers' recorders (:meth:`arm`), its flush writes the files and the ``dump`` event
    (:meth:`write`). At most ``policy.max_dumps`` per run, ``policy.max_bytes`` each."""

    def __init__(self, policy: DumpPolicy) -> None:
        self.policy = policy
        self.left = policy.max_dumps
        self.wanted: set[str] | None | bool = False  # False: none; None: all layers
        self._armed: tuple[DumpBudget, dict[str, LayerDump]] | None = None

    @property
    def armed(self) -> bool:
        """Whether this step's observations are being recorded (a dump to write at its flush)."""
        return self._armed is not None

    def request(self, layers: Iterable[str] | None) -> None:
        """Dump ``layers`` (None: every layer) on the next sampled step, if dumps are left."""
        if self.left > 0:
            self.wanted = None if layers is None else set(layers)

    def arm(self, step: int, captures: Mapping[str, Any]) -> None:
        """On a sampled step: if a dump was requested, record the requested layers' observations."""
        if self.wanted is False:
            return
        wanted, self.wanted = self.wanted, False
        self.left -= 1
        budget = DumpBudget(self.policy.max_bytes)
        layers: dict[str, LayerDump] = {}
        for fqn, cap in captures.items():
            # (expert rows and routers keep no dumps: their tensors are grouped over experts)
            if isinstance(cap, LayerCapture) and cap.active and (wanted is None or fqn in wanted):  # type: ignore[operator]
                cap.recorder = _recorder(fqn, cap, budget, layers, step)
        self._armed = (budget, layers)

    def write(self, step: int, run_dir: Path | None) -> EventRecord:
        """Write the armed dump under ``run_dir`` (a full disk warns, training goes on)."""
        assert self._armed is not None
        budget, layers = self._armed
        self._armed = None
        if run_dir is None:
            return EventRecord("dump", step, {"files": [], "bytes": 0, "left_out": sorted(budget.refused)})
        written, total, error = write_dumps(run_dir, layers.values())
        data: dict[str, Any] = {"files": [str(p.relative_to(run_dir)) for p in written], "bytes": total,
                                "left_out": sorted(budget.refused)}
        if error is not None:  # a full disk or a file-size limit: one warning, no more dumps
            self.left = 0
            data["error"] = error
            warnings.warn(f"fp8track: tensor dump of step {step} not written, no more dumps in this run "
                          f"(training goes on): {error}", stacklevel=2)
        return EventRecord("dump", step, data)


def _recorder(
    fqn: str, cap: LayerCapture, budget: DumpBudget, layers: dict[str, LayerDump], step: int
) -> Callable[[str, torch.Tensor, torch.Tensor | None], None]:
    """The capture's hook into a dump: each observation is kept while the budget allows."""

    def record(tensor: str, x: torch.Tensor, scale: torch.Tensor | None) -> None:
        plan = cap.plan
        per_tensor = plan.scaling == "per_tensor"
        nbytes = x.numel() * (x.element_size() + (1 if per_tensor and scale is not None else 0))
        if not budget.take(fqn, nbytes):
            layers.pop(fqn, None)  # a layer is dumped whole or not at all
            return
        dump = layers.setdefault(fqn, LayerDump(step, fqn, plan_dict(plan)))
        dump.observations.append(observation(tensor, x, scale, plan.formats[tensor], per_tensor))

    return record


def load_dump(path: str | Path) -> LayerDump:
    """Read a dump file (``torch.load(weights_only=True)``: no code runs while loading).

    Raises:
        ConfigError: a missing file or one that is not an fp8track dump of a known format.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no dump file at {p}")
    data = torch.load(p, weights_only=True, map_location="cpu")
    if not isinstance(data, Mapping) or data.get("format") != DUMP_FORMAT:
        raise ConfigError(f"{p} is not an fp8track tensor dump (format {DUMP_FORMAT})")
    return LayerDump(int(data["step"]), str(data["layer"]), dict(data["plan"]), list(data["observations"]))


def list_dumps(run_dir: str | Path) -> list[Path]:
    """Every dump file of a run directory, by step then layer."""
    return sorted((Path(run_dir) / DUMP_DIR).glob("step*/*.pt"))


def _constant(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A scale function that returns the dumped scale (a LayerPlan's ``scale_fns`` entry)."""
    return lambda: value


def recompute_stats(dump: LayerDump) -> dict[str, dict[str, float]]:
    """The statistics of each dumped tensor kind, recomputed from the high-precision tensors with
    the scale rule (and stored scales) of the layer's plan: equal to the ``actual``/``shadow`` row
    the monitor logged for that layer and step (same kernel, same merge order)."""
    info = dump.plan
    by_tensor: dict[str, list[torch.Tensor]] = {}
    for obs in dump.observations:
        scale = obs.get("scale")
        plan = LayerPlan(
            dump.layer,
            bool(info["fp8"]),
            dict(info["formats"]),
            scaling=str(info["scaling"]),
            scale_fns={obs["tensor"]: _constant(scale)} if scale is not None else {},
            margin=int(info["margin"]),
            power_2_scales=info["power_2_scales"],
        )
        prev = by_tensor.setdefault(obs["tensor"], [])
        into = prev[-1] if prev else None
        prev.append(tensor_partial(obs["x"], plan, obs["tensor"], into=into))
    return {
        t: finalize(parts[-1], info["formats"][t], int(info["margin"])) for t, parts in by_tensor.items()
    }


__all__ = [
    "DumpPolicy",
    "DumpBudget",
    "DumpControl",
    "LayerDump",
    "load_dump",
    "list_dumps",
    "recompute_stats",
    "write_dump",
    "write_dumps",
    "DUMP_DIR",
]

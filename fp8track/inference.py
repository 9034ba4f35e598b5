"""The inference chain (troubleshooting path, step 5): loss is fine but downstream scores drop.

After training, the same batches are evaluated three ways (:func:`check_inference`):

* ``fp8_trained_scales``: FP8 inference with the scaling state training left (delayed scaling's
  scales and amax histories, used but not updated in eval mode, as Transformer Engine does);
* ``fp8_fresh_scales``: FP8 inference with scales computed from each tensor itself (current
  scaling, same formats and margin);
* ``bf16``: the same weights without quantisation.

For every linear layer it reports the output error of each FP8 variant against BF16 (MSE,
cosine, SQNR) and, per variant, the downstream metric. A scale that training got wrong or that
was loaded wrong shows up twice: the trained-scale variant is worse than the fresh-scale one at
that layer first, and the layer's trained scale sits far from its tensor's current scale compared
with the other layers (robust z, :func:`fp8track.analysis.risk_signals.robust_z`; no fixed threshold).

Checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`) hold plain tensors and data only and
are read with ``torch.load(weights_only=True)``. :func:`compare_states` checks that a model holds
exactly what a checkpoint says, weights and scaling state (amax histories, scales) included, and
names every difference (a stale weight, a wrong scale).

Only the emulated backend's layers can be switched between the variants; other FP8 layers raise
:class:`fp8track.errors.ConfigError`.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8track.analysis.risk_signals import SIGNAL_FLOORS, robust_z
from fp8track.errors import ConfigError
from fp8track.execution.backends import is_fp8_linear
from fp8track.execution.emulated_linear import EmulatedFP8Linear
from fp8track.execution.recipes import Recipe
from fp8track.numerics.scaling import amax, current_scale

VARIANTS = ("fp8_trained_scales", "fp8_fresh_scales", "bf16")
CHECKPOINT_FORMAT = "fp8track-checkpoint-v1"
SCALE_Z = 3.5  # robust-z cut for a trained scale far from its tensor's current scale (modified-z convention)


# --- checkpoints -----------------------------------------------------------------------------------


def save_checkpoint(model: nn.Module, path: str | os.PathLike[str], **build: Any) -> Path:
    """Save ``model.state_dict()`` (weights and each FP8 layer's scaling state) with ``build``, the
    plain-data arguments that rebuild the model
    (e.g. :func:`fp8track.examples.gpt_lightning.build_example`'s)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": CHECKPOINT_FORMAT, "build": dict(build), "state_dict": model.state_dict()}, out)
    return out


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` of a :func:`save_checkpoint` file.

    Raises:
        ConfigError: a missing or unreadable file, or one that is not an fp8track checkpoint.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"checkpoint {str(p)!r} does not exist")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle/zip errors have many types; torch's own refusal is a paragraph
        why = ("it holds pickled Python objects (UnpicklingError; a torch.save of a model?): not an "
               "fp8track checkpoint, which fp8track.inference.save_checkpoint writes"
               if "Weights only load failed" in str(err)
               else f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}")
        raise ConfigError(f"checkpoint {str(p)!r} cannot be read with torch.load(weights_only=True): "
                          f"{why}") from err
    if not isinstance(ckpt, Mapping) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(
            f"{str(p)!r} is not an fp8track checkpoint (written by fp8track.inference.save_checkpoint)"
        )
    return dict(ckpt)


def load_checkpoint(model: nn.Module, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` file into ``model`` (strict); returns the checkpoint."""
    ckpt = read_checkpoint(path)
    model.load_state_dict(ckpt["state_dict"])
    return ckpt


@dataclass(frozen=True)
class Mismatch:
    """One difference between a checkpoint and a model.

    Attributes:
        kind: ``"weight"`` (parameter), ``"buffer"``, ``"scale"``, ``"amax_history"``, ``"missing"``
            (in the checkpoint, not in the model) or ``"unexpected"`` (the reverse).
        name: the state-dict key (for scaling state ``<layer>/<tensor kind>``).
        max_abs_diff: largest absolute elementwise difference (NaN for missing/shape changes).
        detail: words.
    """

    kind: str
    name: str
    max_abs_diff: float
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.nan
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max()) if a.numel() else 0.0


def compare_states(expected: Mapping[str, Any] | nn.Module, model: nn.Module) -> list[Mismatch]:
    """Every way ``model`` differs from ``expected`` (a state dict or a model): tensors compared
    exactly (``torch.equal``), FP8 scaling state (``_extra_state``: scale and amax history per
    tensor kind) entry by entry. An empty list means the model holds exactly the checkpoint."""
    want = expected.state_dict() if isinstance(expected, nn.Module) else dict(expected)
    have = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    out: list[Mismatch] = []
    for key in sorted(set(want) | set(have)):
        if key not in have:
            out.append(Mismatch("missing", key, math.nan, "in the checkpoint but not in the model"))
            continue
        if key not in want:
            out.append(Mismatch("unexpected", key, math.nan, "in the model but not in the checkpoint"))
            continue
        a, b = want[key], have[key]
        if key.endswith("_extra_state"):
            layer = key[: -len("._extra_state")]
            for tensor in sorted(set(a or {}) | set(b or {})):
                sa, sb = (a or {}).get(tensor, {}), (b or {}).get(tensor, {})
                for field_name, kind in (("scale", "scale"), ("amax_history", "amax_history")):
                    ta, tb = sa.get(field_name), sb.get(field_name)
                    if ta is None or tb is None:
                        if ta is not tb:
                            out.append(
                                Mismatch(
                                    kind, f"{layer}/{tensor}", math.nan, f"{field_name} missing on one side"
                                )
                            )
                        continue
                    if not torch.equal(torch.as_tensor(ta).cpu(), torch.as_tensor(tb).cpu()):
                        d = _diff(torch.as_tensor(ta), torch.as_tensor(tb))
                        what = (f"scale {float(torch.as_tensor(tb).reshape(-1)[0]):.6g} instead of "
                                f"{float(torch.as_tensor(ta).reshape(-1)[0]):.6g}") if kind == "scale" else \
                            f"amax history differs (max |diff| {d:.3g})"
                        out.append(Mismatch(kind, f"{layer}/{tensor}", d, what))
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or not torch.equal(a.cpu(), b.detach().cpu()):
                d = _diff(a, b)
                kind = "weight" if key in params else "buffer"
                out.append(
                    Mismatch(
                        kind,
                        key,
                        d,
                        f"differs from the checkpoint (max |diff| {d:.3g})"
                        if math.isfinite(d)
                        else f"shape {tuple(b.shape)} instead of {tuple(a.shape)}",
                    )
                )
    return out


# --- the three variants ------------------------------------------------------------------------------


def _emulated_layers(model: nn.Module) -> list[tuple[str, EmulatedFP8Linear]]:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, EmulatedFP8Linear):
            out.append((name, m))
        elif is_fp8_linear(m):
            raise ConfigError(
                f"layer {name!r} ({type(m).__name__}) is not an emulated FP8 layer; "
                "the inference-chain check switches scales on backend='emulated' models only"
            )
    return out


def variant_model(model: nn.Module, variant: str) -> nn.Module:
    """A deep copy of ``model`` running ``variant`` (:data:`VARIANTS`), in eval mode.

    ``fp8_fresh_scales`` turns every delayed-scaling layer into current scaling with the same
    formats and margin; ``bf16`` turns every FP8 layer into the ``bf16`` recipe (plain ``F.linear``).
    """
    if variant not in VARIANTS:
        raise ConfigError(f"unknown inference variant {variant!r}; valid values are: {', '.join(VARIANTS)}")
    new = copy.deepcopy(model)
    for name, layer in _emulated_layers(new):
        recipe = layer.fp8_recipe
        if not recipe.quantizes or variant == "fp8_trained_scales":
            continue
        if variant == "bf16":
            target = Recipe("bf16")
        elif recipe.scaling == "delayed":
            target = Recipe("current", fp8_format=recipe.fp8_format, margin=recipe.margin, gemm=recipe.gemm)
        else:
            continue  # current and block recipes compute fresh scales already
        new.set_submodule(name, EmulatedFP8Linear.from_linear(layer, target))
    return new.eval()


@dataclass(frozen=True)
class LayerOutputError:
    """Output of one linear layer under an FP8 variant against its BF16 output, over all batches.

    ``mse`` in squared output units, ``cos`` cosine similarity, ``sqnr_db`` =
    ``10 log10(sum(ref^2) / sum((out - ref)^2))``.
    """

    layer: str
    variant: str
    mse: float
    cos: float
    sqnr_db: float


@dataclass(frozen=True)
class ScaleCheck:
    """A delayed-scaling layer's trained scale against its tensor's current scale on the batches.

    ``drift_log2 = log2(trained / current)``; ``z`` its robust z of ``|drift_log2|`` across layers.
    """

    layer: str
    tensor: str
    trained: float
    current: float
    drift_log2: float
    z: float


@dataclass(frozen=True)
class Problem:
    """A named defect in the inference chain: ``kind`` ``"wrong_scale"``, ``"stale_weight"``,
    ``"scaling_state"`` or ``"missing_state"``; ``layer`` and ``tensor`` where known; ``detail`` words."""

    kind: str
    layer: str
    tensor: str | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class InferenceCheck:
    """What :func:`check_inference` found.

    Attributes:
        metrics: variant -> mean downstream metric over the batches (``None`` without a metric).
        metric_name: the metric's name.
        layers: per layer and FP8 variant, output error against BF16 (execution order).
        scales: trained vs current scale of each delayed-scaling tensor (activation, weight).
        checkpoint: differences between the checkpoint and the model (empty: restored exactly).
        problems: named defects (wrong scale, stale weight...), worst first.
    """

    metrics: Mapping[str, float | None]
    metric_name: str
    layers: Sequence[LayerOutputError]
    scales: Sequence[ScaleCheck] = ()
    checkpoint: Sequence[Mismatch] = ()
    problems: Sequence[Problem] = ()
    checkpoint_checked: bool = False

    def to_dict(self) -> dict[str, Any]:
        def plain(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {k: plain(v) for k, v in x.items()}
            if isinstance(x, list):
                return [plain(v) for v in x]
            return x

        return plain(
            {
                "metric_name": self.metric_name,
                "metrics": dict(self.metrics),
                "layers": [asdict(r) for r in self.layers],
                "scales": [asdict(s) for s in self.scales],
                "checkpoint_checked": self.checkpoint_checked,
                "checkpoint_restored_exactly": self.checkpoint_checked and not self.checkpoint,
                "checkpoint": [m.to_dict() for m in self.checkpoint],
                "problems": [p.to_dict() for p in self.problems],
            }
        )


def default_forward(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(batch[0])`` for a tuple/list batch, else ``model(batch)``."""
    return model(batch[0] if isinstance(batch, (tuple, list)) else batch)


def cross_entropy_metric(output: torch.Tensor, batch: Any) -> float:
    """Mean cross-entropy (nats) of logits ``[..., vocab]`` against ``batch[1]`` (lower is better)."""
    return float(F.cross_entropy(output.float().reshape(-1, output.shape[-1]), batch[1].reshape(-1)))


class _OutputTap:
    """Forward hooks that keep every linear layer's output of the current batch (float32, CPU)."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.inputs_amax: dict[str, float] = {}
        self.order: list[str] = []
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules()
                         if isinstance(m, nn.Linear)]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if name not in self.order:
                self.order.append(name)
            self.outputs[name] = out.detach().float().cpu()
            a = float(amax(args[0].detach()))
            self.inputs_amax[name] = max(self.inputs_amax.get(name, 0.0), a)
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _scale_checks(model: nn.Module, input_amax: Mapping[str, float]) -> list[ScaleCheck]:
    raw: list[tuple[str, str, float, float]] = []
    for name, layer in _emulated_layers(model):
        scalers = layer.delayed_scalers
        if not scalers:
            continue
        fmts = layer.fp8_recipe.formats
        margin = layer.fp8_recipe.margin
        for tensor, a in (
            ("activation", input_amax.get(name)),
            ("weight", float(amax(layer.weight.detach()))),
        ):
            if a is None or tensor not in scalers or a <= 0:
                continue
            cur = float(current_scale(torch.tensor(a, dtype=torch.float32), fmts.for_tensor(tensor), margin))
            raw.append((name, tensor, float(scalers[tensor].scale), cur))
    drifts = [math.log2(t / c) if t > 0 and c > 0 else math.inf for _, _, t, c in raw]
    out = []
    for tensor in ("activation", "weight"):
        idx = [i for i, r in enumerate(raw) if r[1] == tensor]
        zs = robust_z([abs(drifts[i]) for i in idx], SIGNAL_FLOORS["abs_drift_log2"]) if idx else []
        for i, z in zip(idx, zs, strict=True):
            name, t, trained, cur = raw[i]
            out.append(ScaleCheck(name, t, trained, cur, drifts[i], z))
    return out


@torch.no_grad()
def check_inference(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], torch.Tensor] = default_forward,
    metric: Callable[[torch.Tensor, Any], float] | None = cross_entropy_metric,
    metric_name: str = "loss",
    autocast: bool = True,
    checkpoint: Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> InferenceCheck:
    """Run the three variants on the same ``batches`` and compare (module docstring).

    Args:
        model: the trained model (emulated FP8 layers); not modified.
        batches: evaluation batches (materialised once; every variant sees the same ones).
        forward: ``(model, batch) -> output``.
        metric: ``(output, batch) -> float`` averaged over batches (default: cross-entropy of
            logits against ``batch[1]``); ``None`` skips it.
        metric_name: its name in the results.
        autocast: run under CPU/CUDA BF16 autocast, as training did.
        checkpoint: a :func:`save_checkpoint` path or a state dict the model should hold exactly;
            differences become :class:`Mismatch` es and named problems.
    """
    data = list(batches)
    if not data:
        raise ConfigError("check_inference needs at least one batch")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    outputs: dict[str, list[dict[str, torch.Tensor]]] = {}
    metrics: dict[str, float | None] = {}
    order: list[str] = []
    input_amax: dict[str, float] = {}
    for variant in VARIANTS:
        m = variant_model(model, variant)
        tap = _OutputTap(m)
        per_batch, values = [], []
        try:
            for batch in data:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = forward(m, batch)
                if metric is not None:
                    values.append(float(metric(out, batch)))
                per_batch.append(dict(tap.outputs))
        finally:
            tap.close()
        if variant == "fp8_trained_scales":
            order, input_amax = list(tap.order), dict(tap.inputs_amax)
        outputs[variant] = per_batch
        metrics[variant] = sum(values) / len(values) if values else None
    layers = []
    for variant in VARIANTS[:2]:
        for name in order:
            se = ref2 = dot = n2 = 0.0
            count = 0
            for got, ref in zip(outputs[variant], outputs["bf16"], strict=True):
                a, r = got[name].double(), ref[name].double()
                se += float(((a - r) ** 2).sum())
                ref2 += float((r * r).sum())
                dot += float((a * r).sum())
                n2 += float((a * a).sum())
                count += r.numel()
            cos = dot / math.sqrt(n2 * ref2) if n2 > 0 and ref2 > 0 else math.nan
            sqnr = 10 * math.log10(ref2 / se) if se > 0 and ref2 > 0 else math.inf
            layers.append(LayerOutputError(name, variant, se / max(count, 1), cos, sqnr))
    scales = _scale_checks(model, input_amax)
    mismatches: list[Mismatch] = []
    if checkpoint is not None:
        state = checkpoint if isinstance(checkpoint, Mapping) else read_checkpoint(checkpoint)["state_dict"]
        mismatches = compare_states(state, model)
    problems = _problems(layers, scales, mismatches, order)
    return InferenceCheck(metrics, metric_name, layers, scales, mismatches, problems, checkpoint is not None)


def _problems(
    layers: Sequence[LayerOutputError],
    scales: Sequence[ScaleCheck],
    mismatches: Sequence[Mismatch],
    order: Sequence[str],
) -> list[Problem]:
    out: list[Problem] = []
    for m in mismatches:
        if m.kind == "weight":
            out.append(Problem("stale_weight", m.name.rsplit(".", 1)[0], None,
                               f"parameter {m.name} {m.detail}: the model does not hold the trained weight"))
        elif m.kind in ("scale", "amax_history"):
            layer, tensor = m.name.rsplit("/", 1)
            out.append(Problem("scaling_state", layer, tensor, f"{m.kind} of {m.name}: {m.detail}"))
        else:
            out.append(Problem("missing_state", m.name, None, f"{m.name}: {m.detail}"))
    # A trained scale far from its tensor's own scale, compared with the other layers.
    trained = {r.layer: r for r in layers if r.variant == "fp8_trained_scales"}
    fresh = {r.layer: r for r in layers if r.variant == "fp8_fresh_scales"}
    for s in sorted(scales, key=lambda s: -s.z):
        if s.z > SCALE_Z and abs(s.drift_log2) >= 1.0:
            t, f = trained.get(s.layer), fresh.get(s.layer)
            cost = (
                (
                    f"; its output SQNR vs BF16 is {t.sqnr_db:.1f} dB with the trained scale "
                    f"and {f.sqnr_db:.1f} dB with a fresh one"
                )
                if t and f
                else ""
            )
            out.append(
                Problem(
                    "wrong_scale",
                    s.layer,
                    s.tensor,
                    f"trained {s.tensor} scale {s.trained:.4g} is 2^{s.drift_log2:+.1f} times "
                    f"the tensor's current scale {s.current:.4g} "
                    f"(robust z {s.z:.1f} against the other layers){cost}",
                )
            )
    return out


__all__ = [
    "VARIANTS",
    "save_checkpoint",
    "read_checkpoint",
    "load_checkpoint",
    "compare_states",
    "variant_model",
    "check_inference",
    "InferenceCheck",
    "LayerOutputError",
    "ScaleCheck",
    "Mismatch",
    "Problem",
    "cross_entropy_metric",
    "default_forward",
]

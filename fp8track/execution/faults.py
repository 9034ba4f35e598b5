"""Planted faults: one kit for the demo, the example sweep program, the benchmarks and the tests.

Each kind of fault is a small frozen spec (:class:`FaultKind`) in :data:`FAULTS`, defined once and
looked up by name, as nvdlfw_inspect's feature registry does (but a read-only mapping of immutable
specs, not a process-wide mutable registry). A :class:`Fault` says which kind, on which tensor, at
which optimizer steps and how strong; :func:`plant` attaches it to named layers of a model and
returns the :class:`Planted` handle. Adding a kind is one :class:`FaultKind` entry (and its hook).

==================  ============================================================================
``amax``            delayed scaling: before each step of the windows the layer's amax history of
                    ``tensor`` gets an entry ``2**log2`` times its largest entry (taken before the
                    fault first acted, so a lasting fault does not compound), as a corrupted
                    history or one outlier step leaves it: the scale is ``2**log2`` too small and
                    the tensor underflows for the window plus one history length
``amax_outlier``    delayed scaling: every training forward of the layer records an amax of
                    ``value`` in its ``tensor`` history before quantising, as if one token carried a
                    huge value; the scale follows the outlier and the ordinary values underflow
``scale_state``     delayed scaling: before each step of the windows the layer's scale of
                    ``tensor`` is multiplied by ``2**-log2`` (a bad restore, a scale written twice);
                    the next update recomputes it from the intact history. ``log2 < 0`` saturates
``scale``           emulated FP8: the layer's quantiser applies its scale times ``2**-log2`` to
                    ``tensor`` (a software fault in the quantisation, such as a scale applied
                    twice) and reports the faulty scale; ``log2 = 40`` flushes the tensor to zero
``outlier``         per-tensor scaling, activation: one extra batch row holding a single ``value``
                    joins the layer's input and its output row is dropped again; the GEMM's rows are
                    independent, so the high-precision model computes the same thing
``element``         one element (``element``) of the layer's input is set to ``value``
``sink``            input channels ``channels`` of the layer are overwritten by ``value`` while their
                    weight columns are held at zero (zeroed now, their gradient zeroed): the
                    high-precision model is unchanged, per-tensor FP8 scaling of the input is not
``weight_flush``    before each step of the windows the weight columns of input channels
                    ``channels`` are set to zero (the layer loses those inputs)
``nan_output``      the layer's output becomes NaN (a non-finite loss)
``nan_gradient``    the gradient flowing back into the layer's output becomes NaN (the loss stays
                    finite, the weights turn NaN at the optimizer step)
==================  ============================================================================

A fault acts at steps inside its ``windows``; the step is what :meth:`Planted.before_step` was
last told, or what ``clock()`` returns (e.g. a LightningModule's ``global_step``). Faults acting in
a forward or a quantisation act on training passes only (module in training mode; grad mode on for
a forward) unless ``in_eval``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError, check_float, check_int, invalid_choice
from fp8track.execution.layers import gemm_layers, gemm_weight, preview_names
from fp8track.numerics.formats import TENSOR_KINDS
from fp8track.numerics.scaling import quantize

OUTLIER_VALUE = 1e6
"""The planted value of the outlier kinds unless a fault says otherwise."""
Window = tuple[int, int | None]
"""``(start, stop)`` optimizer steps, ``stop`` exclusive; ``None``: to the end of training."""


@dataclass(frozen=True)
class Fault:
    """One planted fault: validated at construction.

    Attributes:
        kind: a name in :data:`FAULTS`.
        tensor: the tensor kind it damages (each kind says which it can).
        windows: where it acts, ``((start, stop), ...)``; default: from step 0 on.
        log2: strength of the scale and amax kinds, in binades.
        value: the planted value of ``amax_outlier``, ``outlier``, ``element`` and ``sink``.
        channels: input channels of ``sink`` and ``weight_flush``.
        element: index into the layer's input of ``element``.
        in_eval: also act on evaluation passes (module in eval mode or grad mode off).
    """

    kind: str
    tensor: str = "activation"
    windows: tuple[Window, ...] = ((0, None),)
    log2: float = 20.0
    value: float = OUTLIER_VALUE
    channels: tuple[int, ...] = (0,)
    element: tuple[int, ...] = (0, 0)
    in_eval: bool = False

    def __post_init__(self) -> None:
        spec = fault_kind(self.kind)
        if self.tensor not in spec.tensors:
            raise invalid_choice(f"tensor for the {self.kind} fault", self.tensor, spec.tensors)
        object.__setattr__(self, "windows", _windows(self.windows))
        check_float("log2", self.log2, -math.inf)
        check_float("value", self.value, -math.inf)
        for name in ("channels", "element"):
            idx = tuple(getattr(self, name))
            for i in idx:
                check_int(f"{name} entry", i, 0)
            object.__setattr__(self, name, idx)
        problem = spec.check(self) if spec.check is not None else None
        if problem:
            raise ConfigError(f"{self.kind} fault: {problem}")

    def active(self, step: int) -> bool:
        """Whether the fault acts at optimizer step ``step``."""
        return any(a <= step and (b is None or step < b) for a, b in self.windows)


def _windows(windows: Sequence[Sequence[int | None]]) -> tuple[Window, ...]:
    out: list[Window] = []
    for w in windows:
        pair = tuple(w)
        if len(pair) != 2:
            raise ConfigError(f"fault windows are (start, stop) pairs, got {list(pair)!r}")
        start, stop = pair
        check_int("window start", start, 0)
        if stop is not None:
            check_int("window stop", stop, int(start) + 1)  # type: ignore[arg-type]
        out.append((int(start), None if stop is None else int(stop)))  # type: ignore[arg-type]
    if not out:
        raise ConfigError("a fault needs at least one window of steps; none given")
    return tuple(out)


class Planted:
    """A fault attached to layers of a model (built by :func:`plant`).

    Attributes:
        fault: what is planted.
        layers: the layers it acts on (qualified names).
        step: the optimizer step :meth:`before_step` was last told (without a ``clock``).
        touched: how many times it changed something (state writes, hooked passes that acted):
            0 on layers without the state it needs (a BF16 layer left alone).
        memory: per-layer values a kind keeps between steps (``amax``: the reference amax).
    """

    def __init__(
        self,
        model: nn.Module,
        fault: Fault,
        layers: Sequence[str],
        clock: Callable[[], int] | None = None,
        strict: bool = True,
    ) -> None:
        self.fault, self.kind = fault, FAULTS[fault.kind]
        self.layers = list(layers)
        self.step = 0
        self.touched = 0
        self.memory: dict[str, Any] = {}
        self._clock = clock
        self._undo: list[Callable[[], None]] = []
        named = dict(model.named_modules())
        for name in self.layers:
            if name not in named:
                known = preview_names([n for n, _ in gemm_layers(model)])
                raise ConfigError(f"no layer {name!r} to plant a fault in; GEMM layers: {known}")
        self._modules = {name: named[name] for name in self.layers}
        for name, layer in self._modules.items():
            missing = _lacks(self.kind.needs, layer, fault.tensor)
            if missing and (strict or self.kind.needs == "weight"):
                raise ConfigError(f"the {fault.kind} fault needs {missing} on layer {name!r}")
            if self.kind.install is not None and not missing:
                self.kind.install(self, name, layer)

    def now(self) -> int:
        """The current optimizer step: ``clock()``, else the step :meth:`before_step` set."""
        return self._clock() if self._clock is not None else self.step

    def acts(self, layer: nn.Module, forward: bool = True) -> bool:
        """Whether the fault acts on this pass of ``layer`` (its window, and a training pass
        unless ``in_eval``; a backward pass runs with grad mode off, so ``forward=False`` skips
        that test)."""
        if not self.fault.active(self.now()):
            return False
        return self.fault.in_eval or (layer.training and (not forward or torch.is_grad_enabled()))

    def before_step(self, step: int) -> None:
        """Call before the forward of optimizer step ``step``: state faults act now."""
        self.step = step
        if self.kind.before_step is None or not self.fault.active(step):
            return
        for name, layer in self._modules.items():
            self.kind.before_step(self, name, layer)

    def on_detach(self, undo: Any) -> None:
        """Remember a hook handle (``.remove()``) or an undo callable for :meth:`detach`."""
        self._undo.append(undo.remove if hasattr(undo, "remove") else undo)

    def detach(self) -> None:
        """Remove the hooks and undo the patches (state already written stays)."""
        for undo in self._undo:
            undo()
        self._undo = []


Hook = Callable[[Planted, str, nn.Module], None]


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault (an entry of :data:`FAULTS`).

    Attributes:
        name: its key.
        summary: what it does, one line.
        tensors: the tensor kinds it can damage.
        install: sets up its hooks on one layer when planted.
        before_step: changes one layer's state before a step's forward (in the fault's windows).
        needs: what a layer must have for it to act: ``"delayed"`` (a delayed scaler of the
            tensor), ``"fp8"`` (emulated FP8 quantisers), ``"weight"``; None: nothing.
        check: the kind's own validation of a :class:`Fault`: a problem, or None.
    """

    name: str
    summary: str
    tensors: tuple[str, ...]
    install: Hook | None = None
    before_step: Hook | None = None
    needs: str | None = None
    check: Callable[[Fault], str | None] | None = None


def _scaler(layer: nn.Module, tensor: str) -> Any:
    """The layer's delayed scaler of ``tensor``, or None (not a delayed-scaling FP8 layer)."""
    return (getattr(layer, "delayed_scalers", None) or {}).get(tensor)


def _quantizes(layer: nn.Module) -> bool:
    recipe = getattr(layer, "fp8_recipe", None)
    return getattr(layer, "_quantizers", None) is not None and recipe is not None and bool(recipe.quantizes)


def _lacks(needs: str | None, layer: nn.Module, tensor: str) -> str | None:
    """What ``layer`` lacks of what a kind ``needs`` (a phrase), or None."""
    if needs == "delayed" and _scaler(layer, tensor) is None:
        return f"delayed scaling of its {tensor} (a delayed-scaling FP8 layer)"
    if needs == "fp8" and not _quantizes(layer):
        return "emulated FP8 quantisers (an FP8 layer of the emulated backend)"
    if needs == "weight" and gemm_weight(layer) is None:
        return "a weight"
    return None


def has_outlier_row(x: torch.Tensor, value: float = OUTLIER_VALUE) -> bool:
    """Whether ``x``'s last batch row is the ``outlier`` fault's (``value`` then zeros)."""
    last = x[-1].reshape(-1)
    return bool(last[0] == value) and bool((last[1:] == 0).all())


# --- the kinds' hooks --------------------------------------------------------------------------------


def _amax_history(p: Planted, name: str, layer: nn.Module) -> None:
    scaler = _scaler(layer, p.fault.tensor)
    if scaler is None:  # not an FP8 delayed-scaling layer (the BF16 control): nothing to corrupt
        return
    # The reference amax is the history's largest entry before the fault first acted, so a lasting
    # fault injects the same value every step instead of compounding it.
    ref = p.memory.setdefault(name, float(scaler.amax_history.max()))
    if ref > 0 and math.isfinite(ref):
        with torch.no_grad():  # one outlier entry: the scale is too small (underflow)
            scaler.amax_history[0] = ref * 2.0**p.fault.log2
        p.touched += 1


def _scale_state(p: Planted, name: str, layer: nn.Module) -> None:
    scaler = _scaler(layer, p.fault.tensor)
    if scaler is None:
        return
    with torch.no_grad():
        scaler.scale = scaler.scale * 2.0**-p.fault.log2
    p.touched += 1


def _amax_outlier(p: Planted, name: str, layer: nn.Module) -> None:
    scaler = _scaler(layer, p.fault.tensor)

    def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
        if p.acts(m):
            scaler.observe(torch.tensor(p.fault.value, device=args[0].device))
            p.touched += 1

    p.on_detach(layer.register_forward_pre_hook(hook))


def _quantizer_scale(p: Planted, name: str, layer: nn.Module) -> None:
    q: Any = layer._quantizers  # the emulated backend's quantisers (their quantize is patched)
    orig, factor, tensor = q.quantize, 2.0**-p.fault.log2, p.fault.tensor

    def faulty(kind: str, x: torch.Tensor, update: bool, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        qx, s = orig(kind, x, update, *rest)
        if kind != tensor or not p.acts(layer, forward=kind != "gradient"):
            return qx, s
        p.touched += 1
        s = s * factor
        return quantize(x, q.fmt[kind], s), s

    q.quantize = faulty
    p.on_detach(lambda: setattr(q, "quantize", orig))


def _outlier_row(p: Planted, name: str, layer: nn.Module) -> None:
    value = p.fault.value

    def pre(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not p.acts(m):
            return None
        x = args[0]
        extra = torch.zeros_like(x[:1])
        extra.view(-1)[0] = value
        return (torch.cat([x, extra], dim=0), *args[1:])

    def post(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        x = args[0]
        if out.shape[0] == x.shape[0] and p.acts(m) and x.shape[0] > 1 and has_outlier_row(x, value):
            p.touched += 1
            return out[:-1]
        return None

    p.on_detach(layer.register_forward_pre_hook(pre))
    p.on_detach(layer.register_forward_hook(post))


def _element(p: Planted, name: str, layer: nn.Module) -> None:
    def pre(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not p.acts(m):
            return None
        x = args[0].clone()
        x[p.fault.element] = p.fault.value
        p.touched += 1
        return (x, *args[1:])

    p.on_detach(layer.register_forward_pre_hook(pre))


def _sink(p: Planted, name: str, layer: nn.Module) -> None:
    cols = list(p.fault.channels)
    with torch.no_grad():
        gemm_weight(layer)[:, cols] = 0.0  # type: ignore[index]

    def keep_zero(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        gemm_weight(layer, grad)[:, cols] = 0.0  # type: ignore[index]
        return grad

    def overwrite(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not p.acts(m):
            return None
        x = args[0].clone()
        x[..., cols] = p.fault.value
        p.touched += 1
        return (x, *args[1:])

    weight: Any = layer.weight
    p.on_detach(weight.register_hook(keep_zero))
    p.on_detach(layer.register_forward_pre_hook(overwrite))


def _weight_flush(p: Planted, name: str, layer: nn.Module) -> None:
    with torch.no_grad():
        gemm_weight(layer)[:, list(p.fault.channels)] = 0  # type: ignore[index]
    p.touched += 1


def _nan_output(p: Planted, name: str, layer: nn.Module) -> None:
    def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        if not p.acts(m):
            return None
        p.touched += 1
        return out * math.nan

    p.on_detach(layer.register_forward_hook(hook))


def _nan_gradient(p: Planted, name: str, layer: nn.Module) -> None:
    def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        if not p.acts(m):
            return None
        p.touched += 1
        out = out + (out * 0).detach()  # the same value, through a node the NaN enters at
        out.register_hook(lambda g: g * math.nan)
        return out

    p.on_detach(layer.register_forward_hook(hook))


def _raises_scale(f: Fault) -> str | None:
    if f.log2 <= 0:
        return ("log2 must be > 0 (a lowered history is overwritten by the step's own amax); "
                "saturate with scale_state and log2 < 0")
    return None


_FORWARD = ("activation", "weight")
FAULTS = MappingProxyType({k.name: k for k in (
    FaultKind("amax", "amax history entry 2**log2 too large: the scale too small, the tensor underflows",
              TENSOR_KINDS, before_step=_amax_history, needs="delayed", check=_raises_scale),
    FaultKind("amax_outlier", "an amax of `value` observed every training forward (delayed scaling)",
              _FORWARD, install=_amax_outlier, needs="delayed"),
    FaultKind("scale_state", "the delayed scale times 2**-log2 before each step", TENSOR_KINDS,
              before_step=_scale_state, needs="delayed"),
    FaultKind("scale", "the quantiser's scale times 2**-log2", TENSOR_KINDS, install=_quantizer_scale,
              needs="fp8"),
    FaultKind("outlier", "an extra batch row holding `value` in the layer's input", ("activation",),
              install=_outlier_row),
    FaultKind("element", "one element of the layer's input set to `value`", ("activation",),
              install=_element),
    FaultKind("sink", "input channels set to `value`, their weight columns held at zero", ("activation",),
              install=_sink, needs="weight"),
    FaultKind("weight_flush", "weight columns of input channels zeroed before each step", ("weight",),
              before_step=_weight_flush, needs="weight"),
    FaultKind("nan_output", "the layer's output NaN", ("activation",), install=_nan_output),
    FaultKind("nan_gradient", "the gradient into the layer's output NaN", ("gradient",),
              install=_nan_gradient),
)})
"""Every fault kind by name (read only)."""


def fault_kind(name: str) -> FaultKind:
    """The kind called ``name``.

    Raises:
        ConfigError: an unknown name (the known ones listed).
    """
    if name not in FAULTS:
        raise invalid_choice("fault kind", name, tuple(FAULTS))
    return FAULTS[name]


def plant(
    model: nn.Module,
    fault: Fault,
    layers: Sequence[str],
    *,
    clock: Callable[[], int] | None = None,
    strict: bool = True,
) -> Planted:
    """Plant ``fault`` in ``layers`` of ``model`` (after :func:`fp8track.apply_fp8`: the hooks go on
    the converted layers).

    Args:
        clock: returns the current optimizer step (e.g. ``lambda: module.global_step``); without
            it, call :meth:`Planted.before_step` before each step's forward.
        strict: a layer lacking what the kind needs (delayed scaling, FP8 quantisers) is a
            :class:`ConfigError`; ``False`` leaves it alone (a BF16 control run).

    Raises:
        ConfigError: an unknown layer, or (``strict``) one the fault cannot act on.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> p = plant(model, Fault("element", value=300.0, element=(0, 1)), ["0"])
        >>> x = torch.zeros(2, 4); _ = model(x); p.touched
        1
    """
    return Planted(model, fault, layers, clock, strict)


__all__ = [
    "FAULTS",
    "Fault",
    "FaultKind",
    "OUTLIER_VALUE",
    "Planted",
    "fault_kind",
    "has_outlier_row",
    "plant",
]

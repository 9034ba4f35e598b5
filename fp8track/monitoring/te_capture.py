"""Capture through Transformer Engine's debug API: TE tells fp8track what it quantises.

Module hooks cannot see every GEMM operand of a TE model: ``LayerNormLinear`` quantises ``ln_out``
(not its input), ``LayerNormMLP`` runs fc1 and fc2 inside one module, ``GroupedLinear`` holds
``weight0..N``, and ``TransformerLayer`` returns ``(out, bias)`` tuples. TE's debug API
(``transformer_engine/debug``, routed by nvdlfw_inspect) instead wraps every quantizer of a debugged
layer in a ``DebugQuantizer`` that calls ``inspect_tensor(layer_name, tensor_name, tensor,
rowwise_quantized_tensor, quantizer, ...)`` with the high-precision tensor TE quantises
(``debug/pytorch/debug_quantization.py::DebugQuantizer._call_inspect_tensor_api``). The feature
:data:`FEATURE_NAME` registered here turns those calls into the same device-side partials as the
module hooks (:mod:`fp8track.numerics.stats`), merged into the layer's
:class:`~fp8track.monitoring.capture.LayerCapture`.

GEMM names follow TE's debug names: ``<name>`` for ``Linear``/``LayerNormLinear``,
``<name>.fc1``/``<name>.fc2`` for ``LayerNormMLP``, ``<name>.gemm_<i>`` for ``GroupedLinear``;
tensors ``activation`` (fprop and wgrad input), ``weight`` (fprop and dgrad), ``gradient`` (dY:
dgrad and wgrad). fp8track names a TE module after its qualified name (it sets ``module.name``
when TE left the default ``Layer_<n>``), so rows read ``<fqn>[.fc1|.fc2|.gemm_<i>]``.

Use::

    from fp8track.monitoring import te_capture
    te_capture.initialize()          # before the first TE module is built (TEDebugState rule)
    model = build_te_model()
    monitor = fp8track.Monitor(model, ...)   # TE layers are captured through the debug API

The monitor then calls ``debug_api.step()`` once per optimizer step (every rank; it also flushes
TE's own stat features such as ``LogFp8TensorStats``): do not call it yourself as well.

Scales (per observation, from the quantizer TE used): delayed scaling reads ``quantizer.scale``
(``Float8Quantizer``: the ``fp8_meta`` scale in use); current scaling re-derives TE's
``compute_scale_from_amax`` with the quantizer's ``force_pow_2_scales`` and ``amax_epsilon``;
MXFP8 and 128-block scaling re-derive the block scales with fp8track's TE-faithful rules
(``block_scaling_dim`` and ``force_pow_2_scales`` read from the quantizer). No quantizer (the
layer ran in high precision) gives shadow statistics. With FP8 primary weights TE passes no
high-precision weight (``tensor=None``): fp8track records no weight row rather than a
dequantisation of what TE holds.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError, invalid_choice
from fp8track.execution.backends import te as te_backend
from fp8track.monitoring.capture import LayerCapture
from fp8track.monitoring.plans import LayerPlan, plan_for, pow2_current_scale
from fp8track.numerics.formats import TENSOR_KINDS
from fp8track.numerics.stats import block_partial_stats, partial_stats

FEATURE_NAME = "Fp8TrackCapture"
"""The nvdlfw_inspect feature key (YAML) of fp8track's capture feature."""
FRAMEWORKS = ("transformer_engine", "base")
"""Namespaces the feature registers in: TE's, or nvdlfw_inspect's generic ``base`` namespace
(driven with ``debug_api.inspect_tensor(...)`` by any framework; used by the CPU tests)."""
FEATURE_DIRS = {fw: Path(__file__).with_name("te_features") / fw for fw in FRAMEWORKS}

# --- numerics: one observation as TE quantised it --------------------------------------------------

_QUANTIZER_KINDS = {
    "Float8Quantizer": "delayed",
    "Float8CurrentScalingQuantizer": "current",
    "MXFP8Quantizer": "mxfp8",
    "Float8BlockQuantizer": "block",
}


def quantizer_kind(quantizer: Any) -> str | None:
    """fp8track scaling name of a TE quantizer (``transformer_engine/pytorch/tensor/*``), by class
    name along the MRO (no TE import); None for no quantizer or an unknown one (NVFP4)."""
    if quantizer is None:
        return None
    for c in type(quantizer).__mro__:
        if c.__name__ in _QUANTIZER_KINDS:
            return _QUANTIZER_KINDS[c.__name__]
    return None


def quantizer_format(quantizer: Any, default: str) -> str:
    """``"e4m3"``/``"e5m2"`` from the quantizer's ``dtype`` (``tex.DType.kFloat8E4M3``/``kFloat8E5M2``)."""
    dtype = getattr(quantizer, "dtype", None)
    name = str(getattr(dtype, "name", dtype))
    if "E5M2" in name:
        return "e5m2"
    if "E4M3" in name:
        return "e4m3"
    return default


def te_partial(x: torch.Tensor, quantizer: Any, tensor: str, plan: LayerPlan) -> torch.Tensor:
    """Partial statistics of ``x`` quantised as ``quantizer`` does (see the module docstring)."""
    kind = quantizer_kind(quantizer)
    fmt = quantizer_format(quantizer, plan.formats[tensor])
    if kind == "delayed":
        return partial_stats(x, fmt, quantizer.scale.detach().reshape(()))
    if kind == "current":
        pow2 = bool(getattr(quantizer, "force_pow_2_scales", False))
        eps = float(getattr(quantizer, "amax_epsilon", 0.0))
        # Float8CurrentScalingQuantizer has no margin; TE's compute_scale_from_amax (recipe_common.cuh).
        scale = pow2_current_scale(x, fmt, 0, eps) if (pow2 or eps > 0) else None
        return partial_stats(x, fmt, scale, 0)
    if kind == "mxfp8":
        return block_partial_stats(x, "mxfp8", fmt)
    if kind == "block":
        recipe = "block128x128" if int(getattr(quantizer, "block_scaling_dim", 1)) == 2 else "block128"
        x2 = x.reshape(-1, x.shape[-1]) if recipe == "block128x128" and x.dim() != 2 else x
        return block_partial_stats(x2, recipe, fmt, bool(getattr(quantizer, "force_pow_2_scales", True)))
    return partial_stats(x, plan.formats[tensor], None, 0)  # high precision: what FP8 would do


# --- routing: TE debug names -> LayerCapture -----------------------------------------------------

_DEFAULT_NAME = "Layer_"  # TE's default debug name prefix (module/base.py::_validate_name)


class CaptureHub:
    """Process-wide table from TE debug layer names to the captures of bound monitors.

    nvdlfw_inspect instantiates features once per process, so the feature asks this hub. Names
    are read from the modules when a name is first missed (``infer_and_assign_layer_names`` may run
    after the monitor was built).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bound: list[tuple[nn.Module, str, dict[str, LayerCapture]]] = []
        self._routes: dict[str, LayerCapture] = {}
        self._misses: set[str] = set()  # debug names of layers no monitor watches (until next step)
        self._schedules: list[tuple[int, tuple[int, ...]]] = []

    def bind(self, module: nn.Module, fqn: str, captures: Mapping[str, LayerCapture]) -> None:
        """Route ``module``'s GEMMs (``{suffix: capture}``) to their captures."""
        name = getattr(module, "name", None)
        if not name or (
            isinstance(name, str) and name.startswith(_DEFAULT_NAME) and name[len(_DEFAULT_NAME) :].isdigit()
        ):
            module.name = fqn  # type: ignore[assignment]  # TE's debug name is a plain str attribute
        with self._lock:
            self._bound.append((module, fqn, dict(captures)))
            self._routes.clear()
            self._misses.clear()

    def add_schedule(self, every_n_steps: int, steps: Sequence[int] = ()) -> None:
        """A monitor samples step ``s`` when ``s % every_n_steps == 0`` or ``s in steps``."""
        with self._lock:
            self._schedules.append((every_n_steps, tuple(steps)))

    def unbind(
        self, captures: Iterable[LayerCapture], schedule: tuple[int, tuple[int, ...]] | None = None
    ) -> None:
        gone = {id(c) for c in captures}
        with self._lock:
            self._bound = [b for b in self._bound if not any(id(c) in gone for c in b[2].values())]
            if schedule is not None and schedule in self._schedules:
                self._schedules.remove(schedule)
            self._routes.clear()

    def route(self, layer_name: str) -> LayerCapture | None:
        cap = self._routes.get(layer_name)
        if cap is None and layer_name not in self._misses:
            with self._lock:
                self._routes = {
                    f"{getattr(m, 'name', None) or fqn}{suffix}": c
                    for m, fqn, caps in self._bound
                    for suffix, c in caps.items()
                }
                cap = self._routes.get(layer_name)
                if cap is None:
                    self._misses.add(layer_name)
        return cap

    def new_step(self) -> None:
        """Forget unknown names once per step (modules may have been renamed meanwhile)."""
        self._misses.clear()

    def enabled(self, iteration: int) -> tuple[bool, int | None]:
        """``(run now, next iteration to run)`` for TE's ``inspect_tensor_enabled`` caching."""
        if not self._schedules:
            return False, None
        run = any(iteration % n == 0 or iteration in extra for n, extra in self._schedules)
        nxt = min(
            min([(iteration // n + 1) * n, *(s for s in extra if s > iteration)])
            for n, extra in self._schedules
        )
        return run, nxt

    def inspect(self, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, quantizer: Any) -> None:
        """One ``inspect_tensor`` call: add its partial to the capture of ``layer_name``."""
        if tensor is None or tensor_name not in TENSOR_KINDS:
            return  # FP8 primary weights (no high-precision tensor) or GEMM outputs
        cap = self.route(layer_name)
        if cap is None or not cap.wants(tensor_name):
            return
        with torch.no_grad():
            x = tensor.detach()
            plan = cap.plan
            actual = te_partial(x, quantizer, tensor_name, plan) if plan.fp8 else None
            cap.observe(tensor_name, x, actual)


HUB = CaptureHub()


def make_feature_class(mapper_base: type) -> type:
    """fp8track's nvdlfw_inspect feature on top of ``mapper_base`` (TE's ``TEConfigAPIMapper`` or
    nvdlfw's ``GenericConfigAPIMapper``), named :data:`FEATURE_NAME`; the feature directories
    register it (``te_features/<namespace>/``)."""
    from nvdlfw_inspect.registry import api_method

    class Fp8TrackCapture(mapper_base):
        """fp8track's statistics of every quantised GEMM operand (activation, weight, gradient).

        Config: ``Fp8TrackCapture: {enabled: True, tensors: [activation, weight, gradient]}``; the
        steps come from the fp8track monitor's schedule.
        """

        @api_method
        def inspect_tensor_enabled(
            self, config: dict, layer_name: str, tensor_name: str, iteration: int, **_: Any
        ):
            # Signature of TE's LogFp8TensorStats.inspect_tensor_enabled (debug/features/api.py).
            return HUB.enabled(iteration)

        @api_method
        def inspect_tensor(
            self,
            config: dict,
            layer_name: str,
            tensor_name: str,
            iteration: int,
            tp_group: Any = None,
            tensor: torch.Tensor | None = None,
            rowwise_quantized_tensor: Any = None,
            columnwise_quantized_tensor: Any = None,
            quantizer: Any = None,
            tp_size: int = 1,
        ) -> None:
            # Signature of TE's LogFp8TensorStats.inspect_tensor (debug/features/log_fp8_tensor_stats.py).
            HUB.inspect(layer_name, tensor_name, tensor, quantizer)

    Fp8TrackCapture.__name__ = Fp8TrackCapture.__qualname__ = FEATURE_NAME
    return Fp8TrackCapture


# --- initialisation --------------------------------------------------------------------------------


def debug_config(
    tensors: Sequence[str] = TENSOR_KINDS,
    layers: str = ".*",
    framework: str = "transformer_engine",
    extra_features: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """An nvdlfw_inspect config (a dict; ``initialize`` accepts it as ``config_file``) enabling
    :data:`FEATURE_NAME` on layers matching ``layers``, plus ``extra_features`` in the same section
    (e.g. ``{"LogFp8TensorStats": {...}}``: nvdlfw allows one enabled section per layer)."""
    if framework not in FRAMEWORKS:
        raise invalid_choice("debug API framework", framework, FRAMEWORKS)
    features: dict[str, Any] = {FEATURE_NAME: {"enabled": True, "tensors": list(tensors)}}
    features.update(dict(extra_features or {}))
    section: dict[str, Any] = {"enabled": True, "layers": {"layer_name_regex_pattern": layers}}
    if framework == "base":
        section.update(features)
    else:
        section["transformer_engine"] = features
    return {"fp8track_capture": section}


def te_feature_dir() -> str:
    """TE's own feature directory (``<transformer_engine>/debug/features``)."""
    te_backend.import_te()
    import transformer_engine

    return str(Path(transformer_engine.__file__).parent / "debug" / "features")


def initialize(
    config: Mapping[str, Any] | str | None = None,
    *,
    framework: str = "transformer_engine",
    feature_dirs: Sequence[str] = (),
    **kwargs: Any,
) -> None:
    """``nvdlfw_inspect.api.initialize`` with fp8track's feature (and TE's features) loaded.

    Call it before the first TE module is built: TE decides in each module's constructor whether
    debugging is on, and raises if modules were built after nvdlfw_inspect was imported but before
    it was initialised (``debug/pytorch/debug_state.py::TEDebugState.initialize``).

    Args:
        config: an nvdlfw config (dict or YAML path); default :func:`debug_config`.
        framework: ``"transformer_engine"`` or ``"base"`` (nvdlfw's generic API, no TE needed).
        feature_dirs: more feature directories.
        kwargs: passed on (``statistics_logger``, ``log_dir``, ``init_training_step``, ...).

    Raises:
        ConfigError: TE modules were already built, or nvdlfw_inspect is already initialised.
    """
    if framework not in FRAMEWORKS:
        raise invalid_choice("debug API framework", framework, FRAMEWORKS)
    import nvdlfw_inspect.api as debug_api

    if debug_api.DEBUG_MANAGER is not None:
        raise ConfigError("nvdlfw_inspect is already initialised; call nvdlfw_inspect.api.end_debug() first")
    state = _te_debug_state()
    if framework == "transformer_engine" and state is not None and state.debug_enabled is False:
        raise ConfigError(
            "Transformer Engine modules were built before the debug API was initialised; call "
            "fp8track.monitoring.te_capture.initialize() before building the model"
        )
    dirs = [te_feature_dir()] if framework == "transformer_engine" else []
    dirs += [str(FEATURE_DIRS[framework]), *feature_dirs]
    debug_api.initialize(
        dict(config) if isinstance(config, Mapping) else (config or debug_config(framework=framework)),
        feature_dirs=dirs,
        **kwargs,
    )


def _te_debug_state() -> Any:
    mod = sys.modules.get("transformer_engine.debug.pytorch.debug_state")
    return getattr(mod, "TEDebugState", None)


def capture_live() -> bool:
    """True when nvdlfw_inspect is initialised with fp8track's feature: in TE's namespace (and TE's
    modules run their debug path, ``TEDebugState.debug_enabled``) or in the generic ``base`` one."""
    api = sys.modules.get("nvdlfw_inspect.api")
    if api is None or getattr(api, "DEBUG_MANAGER", None) is None:
        return False
    from nvdlfw_inspect.registry import Registry

    def has(ns: str) -> bool:
        data = Registry.data.get(ns)
        return data is not None and FEATURE_NAME in data.features

    if has("transformer_engine"):
        state = _te_debug_state()
        return bool(state is not None and state.debug_enabled)
    return has("base")


# --- monitor side ---------------------------------------------------------------------------------


def gemm_captures(
    fqn: str, module: nn.Module, tensors: Sequence[str], whatif: Sequence[str], shadow_format: str
) -> dict[str, LayerCapture]:
    """Hook-free captures for each GEMM of a TE module, keyed by row name ``fqn + suffix``, plans
    resolved lazily (TE builds ``fp8_meta`` in the first forward)."""
    out: dict[str, LayerCapture] = {}
    for suffix in te_backend.te_gemm_suffixes(module):
        name = fqn + suffix
        out[name] = LayerCapture(
            module, functools.partial(plan_for, name, module, shadow_format), tensors, whatif, hooks=False
        )
    return out


class TECapture:
    """The TE debug-API side of one monitor: binds its TE captures to :data:`HUB` and steps nvdlfw."""

    def __init__(
        self,
        bound: Sequence[tuple[str, nn.Module, Mapping[str, LayerCapture]]],
        every_n_steps: int,
        steps: Sequence[int] = (),
    ):
        self.schedule = (every_n_steps, tuple(steps))
        self.captures = [c for _, _, caps in bound for c in caps.values()]
        for fqn, module, caps in bound:
            HUB.bind(module, fqn, {name[len(fqn) :]: c for name, c in caps.items()})
        HUB.add_schedule(*self.schedule)

    def start(self, step: int) -> None:
        """Align nvdlfw's iteration counter with the monitor's step (attach, resume)."""
        import nvdlfw_inspect.api as debug_api

        debug_api.initialize_training_step(step)

    def end_step(self) -> None:
        """``debug_api.step()``: once per optimizer step on every rank (it may gather)."""
        import nvdlfw_inspect.api as debug_api

        debug_api.step()
        HUB.new_step()

    def close(self) -> None:
        HUB.unbind(self.captures, self.schedule)

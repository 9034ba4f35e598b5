"""Which captures a model gets: the layers to monitor (:func:`select_layers`), a hook-based
:class:`~fp8track.monitoring.capture.LayerCapture` per selected GEMM layer, TE debug-API captures
for TE layers when that API is live, and the MoE blocks' per-expert rows and routers
(:mod:`fp8track.monitoring.expert_capture`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.backends import backend_of
from fp8track.execution.experts import MOE_KEYWORDS
from fp8track.execution.fallback_resolve import moe_keyword_layers
from fp8track.execution.layers import GEMM_LAYER_KINDS, gemm_layers, hidden_gemms, match_layers, preview_names
from fp8track.monitoring import te_capture
from fp8track.monitoring.capture import LayerCapture
from fp8track.monitoring.capture_config import CaptureConfig
from fp8track.monitoring.expert_capture import ExpertRowCapture
from fp8track.monitoring.module_flops import ModuleFlopsCapture
from fp8track.monitoring.moe_selection import moe_captures
from fp8track.monitoring.naming import canonical_layer_names
from fp8track.monitoring.plans import LayerPlan, plan_for
from fp8track.monitoring.router_capture import RouterCapture
from fp8track.monitoring.sharding import ShardSpec
from fp8track.monitoring.stats_batch import StatsBatch

Capture = LayerCapture | ExpertRowCapture | RouterCapture | ModuleFlopsCapture

LayerFilter = Callable[[nn.Module, str], bool]


def select_layers(
    model: nn.Module,
    layers: str | Sequence[str] | LayerFilter | None = None,
) -> list[tuple[str, nn.Module]]:
    """The GEMM layers to monitor (:func:`~fp8track.execution.layers.is_gemm_layer`), in registration
    order, under their canonical names (:func:`fp8track.monitoring.naming.canonical_layer_names`:
    wrappers and a LightningModule's holder attribute dropped), the names every record carries.

    Args:
        layers: ``None`` (every GEMM layer), one selector term or a list of them (see
            :func:`~fp8track.execution.layers.match_layers`: ``re:PATTERN`` searched in the
            qualified name, or the qualified name of a layer or of a module holding layers; the
            canonical or the full name; the mixture-of-experts keywords ``experts``, ``router``,
            ``shared_experts``; ``<experts>.<param>`` picks its experts module), or a
            ``(module, fqn) -> bool`` filter (full names).

    Raises:
        ConfigError: when the model has no GEMM layer, or a term matches none (the message lists
            candidates).
    """
    candidates = gemm_layers(model)
    hidden = hidden_gemms(model)
    if hidden:
        warnings.warn(
            f"fp8track: {len(hidden)} attention modules ({preview_names(list(hidden), 4)}) "
            "are not monitored: "
            + next(iter(hidden.values())),
            stacklevel=3,
        )
    if not candidates:
        raise ConfigError(
            f"{type(model).__name__} has no linear layer to monitor ({'; '.join(GEMM_LAYER_KINDS)})"
        )
    raw = [fqn for fqn, _ in candidates]
    names = canonical_layer_names(model, raw)
    canonical = dict(zip(raw, names, strict=True))
    if layers is None:
        picked = set(names)
    elif callable(layers):
        picked = {canonical[fqn] for fqn, m in candidates if layers(m, fqn)}
        if not picked:
            raise ConfigError(f"the layer filter matched none of the linear layers: {preview_names(names)}")
    else:
        picked = set()
        for term in [layers] if isinstance(layers, str) else list(layers):
            if not isinstance(term, str):
                raise ConfigError(f"layer selectors must be strings or a callable, got {term!r}")
            if term in MOE_KEYWORDS:  # experts / router / shared_experts
                picked.update(canonical[n] for n in moe_keyword_layers(model, term, raw))
                continue
            try:
                picked.update(match_layers(model, term, names))
            except ConfigError as err:  # a full name (with its holder or wrappers) names the same layers
                try:
                    picked.update(canonical.get(n, n) for n in match_layers(model, term, raw))
                except ConfigError:
                    raise err from None
    # <experts>.<param> picks its experts module (whose capture records every projection)
    picked |= {n.rpartition(".")[0] for n in picked}
    return [(canonical[fqn], m) for fqn, m in candidates if canonical[fqn] in picked]


def build_captures(
    model: nn.Module,
    cfg: CaptureConfig,
    layers: str | Sequence[str] | LayerFilter | None,
    plans: Mapping[str, LayerPlan],
    sharding: ShardSpec | None,
) -> tuple[dict[str, Capture], te_capture.TECapture | None]:
    """The captures of ``model``'s selected layers (keyed by fqn; expert rows and routers by their
    own keys) and the TE debug-API driver when some layer is captured through it (else None).
    Warns when TE layers quantise tensors no hook sees and the debug API is not initialised."""
    chosen = select_layers(model, layers)
    captures: dict[str, Capture] = {}
    # Mixture-of-experts blocks: per-expert rows and router statistics (monitoring.expert_capture).
    moe = moe_captures(model, chosen, cfg.tensors, cfg.shadow_format)
    chosen = [(fqn, m) for fqn, m in chosen if fqn not in moe.skip]
    te_bound: list[tuple[str, nn.Module, dict[str, Any]]] = []
    te_unseen: list[str] = []
    backends = {fqn: backend_of(m) for fqn, m in chosen}
    batch = StatsBatch()  # one grouped statistics pass per hook phase for all hook-based layers
    te_live = any(b is not None and b.debug_api for b in backends.values()) and te_capture.capture_live()
    for fqn, module in chosen:
        backend = backends[fqn]
        if backend is not None and backend.debug_api and te_live:
            caps = te_capture.gemm_captures(fqn, module, cfg.tensors, cfg.whatif, cfg.shadow_format)
            captures.update(caps)
            te_bound.append((fqn, module, caps))
            continue
        if backend is not None and not backend.hooks_see_gemms(module):
            te_unseen.append(fqn)  # ln_out, fc2's input, weight0..N: only TE's debug API sees them
            continue
        # Plans resolve at the first observation: backends build their state (TE's fp8_meta) lazily.
        plan = plans.get(fqn) or (lambda f=fqn, m=module: plan_for(f, m, cfg.shadow_format))
        layer_capture = LayerCapture(
            module, plan, cfg.tensors, cfg.whatif, sharding, collective_timeout_s=cfg.collective_timeout_s
        )
        layer_capture.batch = batch
        captures[fqn] = layer_capture
    captures.update(moe.captures)
    for fqn in moe.token_layers:  # MoE: module-list experts' rows carry their tokens
        if isinstance(cap := captures.get(fqn), LayerCapture):
            cap.count_tokens = True
    if te_unseen:
        warnings.warn(
            f"fp8track: {len(te_unseen)} TE layers ({', '.join(te_unseen[:4])}...) quantise tensors "
            "no module hook sees; call fp8track.monitoring.te_capture.initialize() before building "
            "the model to monitor them",
            stacklevel=3,
        )
    te = te_capture.TECapture(te_bound, cfg.every_n_steps, cfg.steps) if te_bound else None
    return captures, te

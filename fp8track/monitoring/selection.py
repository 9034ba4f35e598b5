"""Which captures a model gets: a hook-based :class:`~fp8track.monitoring.capture.LayerCapture` per
selected GEMM layer, TE debug-API captures for TE layers when that API is live, and the MoE
blocks' per-expert rows and routers (:mod:`fp8track.monitoring.expert_capture`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from fp8track.execution.backends import backend_of
from fp8track.monitoring import te_capture
from fp8track.monitoring.capture import LayerCapture, LayerFilter, LayerPlan, plan_for, select_layers
from fp8track.monitoring.capture_config import CaptureConfig
from fp8track.monitoring.expert_capture import ExpertRowCapture, moe_captures
from fp8track.monitoring.router_capture import RouterCapture
from fp8track.monitoring.sharding import ShardSpec
from fp8track.monitoring.stats_batch import StatsBatch

Capture = LayerCapture | ExpertRowCapture | RouterCapture


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

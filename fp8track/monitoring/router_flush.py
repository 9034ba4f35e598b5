"""The MoE routers' part of a flush: their device sums and maxima ride in the flush's one SUM and
one MAX collective (after the layers' values, :class:`fp8track.monitoring.reduce.DeviceTake`'s
extras), and their metrics come from the tail of the host copy
(:mod:`fp8track.monitoring.router_capture` defines the statistics)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp8track.monitoring.reduce import DeviceTake
from fp8track.monitoring.router_capture import RouterCapture, finalize_router, router_metrics

RouterTake = list[tuple[RouterCapture, torch.Tensor, torch.Tensor]]
"""``(router capture, sums, max)`` per MoE block's router, in capture order."""


def take_routers(captures: Mapping[str, Any], device: torch.device, into: DeviceTake) -> RouterTake:
    """Empty every router capture's accumulators and add them to ``into``'s extras (reduced with
    the partials)."""
    routers = [cap for cap in captures.values() if isinstance(cap, RouterCapture)]
    taken = [(cap, cap.take_sums(device), cap.take_max(device)) for cap in routers]
    if taken:
        into.extra_sums.append(torch.cat([t[1] for t in taken]))
        into.extra_max.append(torch.cat([t[2] for t in taken]))
    return taken


def routers_from_host(routers: RouterTake, host: Sequence[float]) -> dict[str, float]:
    """The routers' metrics from their part of the host copy (sums, then maxima)."""
    if not routers:
        return {}
    n_sums = sum(r[1].numel() for r in routers)
    sums, maxes = host[:n_sums], host[n_sums:]
    per_block, i = {}, 0
    for j, (cap, s, _) in enumerate(routers):
        per_block[cap.name] = finalize_router(sums[i : i + s.numel()], maxes[j], cap.num_experts, cap.top_k)
        i += s.numel()
    return router_metrics(per_block)

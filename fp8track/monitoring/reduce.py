"""Cross-rank reduction of one flush: the captures' device partials, the buffered losses and grad
norms, reduced over ranks by one SUM and one MAX all-reduce, then copied to the host once.

The hot-path rules this module keeps (docs/ARCHITECTURE.md, "The hot path and its rules"):
nothing here waits for the device before the one host copy; every rank runs the same collectives
in the same order (it has the same layers); only the writer rank makes the host copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.monitoring.schedule import Burst
from fp8track.monitoring.sharding import grad_sq_share, is_dtensor
from fp8track.numerics.stats import NUM_SUM, PARTIAL_SIZE

Key = tuple[str, str, str]
"""``(layer fqn, tensor kind, variant)``: one statistics row of a flush."""


def dist_world() -> int:
    """The world size, 1 without an initialised process group."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dist_rank() -> int:
    """This process's global rank, 0 without an initialised process group."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class PendingStep:
    """An optimizer step whose loss (and, on a sampled step, grad norm) waits on the device for
    the next flush; ``None``: not given. ``scale``: the loss scaler's scale after the step (a
    device clone, :func:`fp8track.monitoring.grad_scaler.current_scale`), None without one."""

    step: int
    loss: torch.Tensor | None
    grad_norm: torch.Tensor | None
    scale: torch.Tensor | None = None


def detached(v: torch.Tensor | float | None) -> torch.Tensor | None:
    """A loss or grad norm as a detached float32 0-d tensor on its own device (no host copy)."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ConfigError(
                f"a loss or grad norm must be one number (a 0-d or one-element tensor, or a float), got "
                f"a tensor of shape {tuple(v.shape)}; pass the value the step minimised, e.g. loss.mean()"
            )
        return v.detach().reshape(()).to(torch.float32)
    return torch.tensor(float(v), dtype=torch.float32)


def pending_state(pending: Sequence[PendingStep]) -> list[tuple[Any, ...]]:
    """Plain data of the buffered steps, for a checkpoint (one host copy per value: a save waits)."""
    return [(p.step, _to_float(p.loss), _to_float(p.grad_norm), _to_float(p.scale)) for p in pending]


def pending_from_state(state: Sequence[Sequence[Any]]) -> list[PendingStep]:
    """The inverse of :func:`pending_state` (checkpoints written before scales were kept included)."""
    return [
        PendingStep(int(s[0]), _tensor_or_none(s[1]), _tensor_or_none(s[2]), _tensor_or_none(_at(s, 3)))
        for s in state
    ]


def _at(seq: Sequence[Any], i: int) -> Any:
    return seq[i] if len(seq) > i else None


def _to_float(v: torch.Tensor | None) -> float | None:
    return None if v is None else float(v)


def _tensor_or_none(v: float | None) -> torch.Tensor | None:
    return None if v is None else torch.tensor(v, dtype=torch.float32)


@dataclass
class DeviceTake:
    """What the captures accumulated since the last flush, still on the device.

    Attributes:
        keys: one per partial, in the order of ``parts``.
        parts: ``[PARTIAL_SIZE]`` float64 partials.
        range_keys: the block rows, in the order of ``ranges``.
        ranges: their ``max_blockwise_dynamic_range`` (0-d, merged by max).
        extra_sums: further values summed over ranks (the MoE routers' statistics).
        extra_max: further values maximised over ranks.
    """

    keys: list[Key] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    range_keys: list[Key] = field(default_factory=list)
    ranges: list[torch.Tensor] = field(default_factory=list)
    extra_sums: list[torch.Tensor] = field(default_factory=list)
    extra_max: list[torch.Tensor] = field(default_factory=list)

    @property
    def n_extra(self) -> int:
        return sum(t.numel() for t in self.extra_sums) + sum(t.numel() for t in self.extra_max)


def take_partials(captures: Mapping[str, Any], device: torch.device) -> DeviceTake:
    """Empty every capture's accumulators: its partials, then (a second pass, as the rows are
    laid out) its block rows' dynamic ranges."""
    out = DeviceTake()
    for fqn, cap in captures.items():
        out.keys.extend((fqn, t, v) for t, v in cap.keys())
        out.parts.extend(cap.take(device))
    for fqn, cap in captures.items():
        out.range_keys.extend((fqn, t, v) for t, v in cap.range_keys())
        out.ranges.extend(cap.take_ranges(device))
    return out


@dataclass(frozen=True)
class HostCopy:
    """A flush's numbers on the writer, reduced over ranks: the partials' fields (``[n, 13]``
    flattened), the pending steps' losses (mean over ranks) and grad norms (root mean square),
    the block rows' dynamic ranges, the extra sums and maxima, then the pending steps' loss scales
    (the writer's own: NaN without a scaler)."""

    partials: Sequence[float]
    losses: Sequence[float]
    gnorms: Sequence[float]
    ranges: Sequence[float]
    extra: Sequence[float]
    scales: Sequence[float] = ()


def host_slices(host: Sequence[float], n_keys: int, n_pending: int, n_extra: int) -> HostCopy:
    """The one host copy cut as :func:`reduce_to_host` lays it out."""
    n, m = n_keys * PARTIAL_SIZE, n_pending
    end = len(host) - n_extra - m
    return HostCopy(
        host[:n], host[n : n + m], host[n + m : n + 2 * m], host[n + 2 * m : end], host[end : end + n_extra],
        host[end + n_extra :],
    )


def stack_or_nan(values: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The values stacked on ``device``, NaN for a missing one (a fill, not a host copy)."""
    if not values:
        return torch.zeros(0, dtype=torch.float32, device=device)
    nan = torch.full((), math.nan, dtype=torch.float32, device=device)
    return torch.stack([nan if v is None else v.to(device) for v in values])


def reduce_to_host(
    take: DeviceTake,
    pending: Sequence[PendingStep],
    device: torch.device,
    *,
    world: int,
    is_writer: bool,
    timeout_s: float,
) -> HostCopy | None:
    """The flush's numbers on the host, reduced over ``world`` ranks (1: this rank's own).

    One SUM collective carries the partials' summed fields, the extra sums, the losses and the
    squared grad norms; one MAX collective the partials' max fields, the block rows' dynamic
    ranges and the extra maxima (skipped when empty: every rank has the same layers, so every
    rank skips it alike); then one host copy. ``None`` on other ranks than the writer (they take
    part in the collectives only). Grad norms come back as their root mean square over ranks:
    the global norm for sharded gradients (see :func:`total_grad_norm`).
    """
    extra_sums = torch.cat(take.extra_sums).to(torch.float64) if take.extra_sums else None
    extra_max = torch.cat(take.extra_max).to(torch.float64) if take.extra_max else None
    losses = stack_or_nan([p.loss for p in pending], device).to(torch.float64)
    gnorms = stack_or_nan([p.grad_norm for p in pending], device).to(torch.float64)
    stacked = (
        torch.stack(take.parts)
        if take.parts
        else torch.zeros((0, PARTIAL_SIZE), dtype=torch.float64, device=device)
    )
    ranges = (
        torch.stack(take.ranges) if take.ranges else torch.zeros((0,), dtype=torch.float64, device=device)
    )
    if world > 1:
        stacked, ranges, extra_sums, extra_max, losses, gnorms = _all_reduce(
            stacked, ranges, extra_sums, extra_max, losses, gnorms, world, timeout_s
        )
    if not is_writer:
        return None
    # The one host copy of this logging step.
    tail = [t for t in (extra_sums, extra_max) if t is not None]
    # The loss scales are not reduced: every rank's scaler saw the same reduced gradients.
    scales = stack_or_nan([p.scale for p in pending], device).to(torch.float64)
    host = torch.cat([stacked.reshape(-1), losses, gnorms, ranges, *tail, scales]).cpu().tolist()
    return host_slices(host, len(take.keys), len(pending), take.n_extra)


def _all_reduce(
    stacked: torch.Tensor,
    ranges: torch.Tensor,
    extra_sums: torch.Tensor | None,
    extra_max: torch.Tensor | None,
    losses: torch.Tensor,
    gnorms: torch.Tensor,
    world: int,
    timeout_s: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The one SUM and one MAX all-reduce of :func:`reduce_to_host`, and their results cut back
    into the same pieces (losses as means, grad norms as root mean squares)."""
    import torch.distributed as dist

    from fp8track.numerics.stats import wait_collectives

    n_extra = 0 if extra_sums is None else extra_sums.numel()
    n_extra_max = 0 if extra_max is None else extra_max.numel()
    more_sums = [extra_sums] if extra_sums is not None else []
    more_max = [extra_max] if extra_max is not None else []
    sums = torch.cat([stacked[:, :NUM_SUM].reshape(-1), *more_sums, losses, gnorms.square()])
    maxes = torch.cat([stacked[:, NUM_SUM:].reshape(-1), ranges, *more_max])
    works = [dist.all_reduce(sums, op=dist.ReduceOp.SUM, async_op=True)]
    if maxes.numel():  # every rank has the same layers, so every rank skips it alike
        works.append(dist.all_reduce(maxes, op=dist.ReduceOp.MAX, async_op=True))
    # Bounded waits: a rank that died or hangs stops this one with a RankFailure.
    wait_collectives(works, timeout_s, "the logging step's all-reduce")
    n_sum = stacked.shape[0] * NUM_SUM
    n_max = stacked.shape[0] * (PARTIAL_SIZE - NUM_SUM)
    stacked = torch.cat(
        [sums[:n_sum].reshape(-1, NUM_SUM), maxes[:n_max].reshape(-1, PARTIAL_SIZE - NUM_SUM)], dim=1
    )
    ranges = maxes[n_max : maxes.numel() - n_extra_max]
    if n_extra:
        extra_sums = sums[n_sum : n_sum + n_extra]
    if n_extra_max:
        extra_max = maxes[maxes.numel() - n_extra_max :]
    scalars = sums[n_sum + n_extra :] / world
    n_pending = losses.numel()
    return stacked, ranges, extra_sums, extra_max, scalars[:n_pending], scalars[n_pending:].sqrt()


def share_burst(burst: Burst, device: torch.device) -> None:
    """Every rank samples the same steps and layers: the writer's burst window (all layers under
    several ranks) is broadcast, one small collective per sampled step when bursts are on."""
    import torch.distributed as dist

    window = torch.tensor([burst.start, burst.until], dtype=torch.int64, device=device)
    dist.broadcast(window, src=0)
    burst.start, burst.until = (int(v) for v in window.tolist())
    burst.layers = None


def total_grad_norm(model: nn.Module) -> torch.Tensor | None:
    """L2 norm of all parameter gradients as a device tensor (no host sync, no collective); None
    without grads.

    Sharded gradients (DTensors: FSDP2, tensor parallelism): this rank's *contribution*
    ``sqrt(world * share)``, where the shares (:func:`fp8track.monitoring.sharding.grad_sq_share`) sum
    to the squared global norm over the world; the flush (:func:`reduce_to_host`) reduces grad norms
    to their root mean square over ranks, which is then the global norm (and leaves a norm that is
    the same on every rank, as under DDP, unchanged).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    if any(is_dtensor(g) for g in grads):
        sq = grad_sq_share(model)
        return None if sq is None else (sq * dist_world()).sqrt()
    norms = torch._foreach_norm(grads)
    if all(n.dtype == torch.float32 for n in norms):  # one stack, no conversion per norm
        return torch.linalg.vector_norm(torch.stack(norms))
    return torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))

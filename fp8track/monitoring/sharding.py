"""How an observed tensor is spread over ranks, and the share of its statistics this rank computes.

The monitor reduces every partial with one world-wide SUM and one MAX (``MonitorCore.flush``). That
gives the statistics of the *logical* tensor as long as each element is counted by exactly one
rank. This module decides, per observation, what this rank contributes:

* **Split** mesh dimensions hold different elements on each rank: the data-parallel batch of an
  activation or gradient, a ``Shard`` placement of a DTensor (tensor parallelism). Every rank
  contributes its local tensor; the SUM merges them.
* **Copy** dimensions hold the same elements on each rank: a weight under DDP or FSDP2 (FSDP
  all-gathers it before the forward, so a hook sees the full weight on every rank), a
  ``Replicate`` DTensor (the input of a column-wise parallel linear, the output gradient of a
  row-wise one). The ``K`` copies split the work: the rank with copy index ``c`` computes slice
  ``c`` of ``K`` of the flattened tensor, so each element is counted once and no rank does the
  whole job.
* ``Partial`` DTensor placements (a row-wise linear's output before its all-reduce) are
  redistributed to ``Replicate`` first (one collective on that mesh dimension).

Scale: a tensor sharded by tensor parallelism is one logical tensor quantised with one scale, as
torchao's float8 tensor parallelism computes it (the amax of a ``DTensor`` is reduced over the
mesh) and as TE does for tensors it all-gathers in FP8 (``amax_reduction_group``). Under current
scaling the monitor therefore needs the global amax *before* it computes the statistics that
depend on the scale: one MAX all-reduce of a scalar over the shard group, in the hook (the
two-phase path; ``ShardSpec(scale="local")`` skips it and judges each shard with its own scale,
as TE's per-shard quantisers do). Data-parallel ranks keep their own scales: each quantises its
own batch. Slices of a copy use the scale of the whole tensor (its amax is local: the copy is
complete on every rank). A scale the backend reports (delayed scaling) is used as is.

Contract: every rank observes the same tensors in the same order (true of data and tensor
parallelism); pipeline parallelism is not covered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from fp8track.errors import ConfigError, invalid_choice
from fp8track.numerics.scaling import current_scale

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

SHARD_SCALES = ("global", "local")


@dataclass(frozen=True)
class ShardSpec:
    """The device mesh of a sharded run and which of its dimensions carry data parallelism.

    Attributes:
        mesh: the root ``DeviceMesh``
            (e.g. ``init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))``);
            ``None`` = the DTensors' own root mesh, or the whole world as one data-parallel
            dimension for plain tensors.
        data_dims: names of the mesh dimensions over which ranks see different batches
            (activations and gradients are split there; weights are copies). Required with
            ``mesh``; the others hold copies of plain (non-DTensor) tensors.
        scale: ``"global"`` (one current scale per tensor-parallel tensor, from the amax over its
            shards, as torchao does) or ``"local"`` (each shard its own, as TE's per-shard
            quantisers).
    """

    mesh: Any = None
    data_dims: tuple[str, ...] = ()
    scale: str = "global"

    def __post_init__(self) -> None:
        if self.scale not in SHARD_SCALES:
            raise invalid_choice("shard scale", self.scale, SHARD_SCALES)
        object.__setattr__(self, "data_dims", tuple(self.data_dims))
        if self.mesh is None:
            if self.data_dims:
                raise ConfigError("data_dims need a mesh: pass ShardSpec(mesh=..., data_dims=...)")
            return
        names = tuple(self.mesh.mesh_dim_names or ())
        if not self.data_dims:
            raise ConfigError(f"ShardSpec(mesh=...) needs data_dims, a subset of the mesh dimensions {names}")
        for d in self.data_dims:
            if d not in names:
                raise invalid_choice("data-parallel mesh dimension", d, names)


_NO_SPEC = ShardSpec()


@dataclass
class Share:
    """What this rank computes for one observed tensor.

    Attributes:
        local: this rank's elements (``DTensor.to_local()``, or the tensor itself).
        piece: this rank's index among the ``pieces`` copies of ``local``.
        pieces: number of ranks holding the same ``local`` (1 = none besides this one).
        amax_groups: process groups over which the tensor's shards share one scale.
        timeout_s: the longest :meth:`amax` waits for each of those all-reduces (None: the process
            group's own timeout); a peer that died or hangs raises :class:`fp8track.errors.RankFailure`.
    """

    local: torch.Tensor
    piece: int = 0
    pieces: int = 1
    amax_groups: tuple[Any, ...] = ()
    timeout_s: float | None = None
    _amax: torch.Tensor | None = field(default=None, repr=False)

    @property
    def trivial(self) -> bool:
        """The whole local tensor with its own scale: the unsharded path."""
        return self.pieces == 1 and not self.amax_groups

    def part(self) -> torch.Tensor:
        """This rank's slice of ``local`` (contiguous in the flattened order; may be empty)."""
        if self.pieces == 1:
            return self.local
        return self.local.reshape(-1).tensor_split(self.pieces)[self.piece]

    def amax(self) -> torch.Tensor:
        """Finite amax of the logical tensor (float32, on the device): the local amax, MAX-reduced
        over ``amax_groups`` (phase one of the two-phase path). Computed once per observation."""
        if self._amax is None:
            x = self.local.detach().to(torch.float32)
            a = torch.where(torch.isfinite(x), x.abs(), 0.0).amax() if x.numel() else x.new_zeros(())
            if self.amax_groups:
                import torch.distributed as dist

                from fp8track.numerics.stats import wait_collectives

                # One group after the other (a mesh's groups overlap); each wait bounded like the
                # statistics all-reduce, so a dead peer raises RankFailure instead of hanging a hook.
                for g in self.amax_groups:
                    work = dist.all_reduce(a, op=dist.ReduceOp.MAX, group=g, async_op=True)
                    wait_collectives([work], self.timeout_s, "the tensor-parallel amax all-reduce")
            self._amax = a
        return self._amax

    def scale(self, fmt: str, margin: int) -> torch.Tensor | None:
        """The current scale of the logical tensor, or ``None`` where the statistics kernel can derive
        it from what this rank computes (the unsharded path)."""
        if self.trivial:
            return None
        return current_scale(self.amax(), fmt, margin)


def share_of(x: torch.Tensor, kind: str, spec: ShardSpec | None, timeout_s: float | None = None) -> Share:
    """Decide this rank's share of the observed ``x`` of tensor kind ``kind`` (see module docstring);
    ``timeout_s`` bounds the amax all-reduce of a tensor sharded under one scale."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Share(_local(x))
    spec = spec or _NO_SPEC
    copies: list[tuple[int, int]] = []  # (size, my coordinate) per copy dimension
    groups: list[Any] = []
    mesh = None
    if is_dtensor(x):
        x = _without_partial(x)
        mesh = x.device_mesh
        for i, p in enumerate(x.placements):
            if p.is_replicate():
                copies.append((mesh.size(i), mesh.get_local_rank(i)))
            elif spec.scale == "global":
                groups.append(mesh.get_group(i))
    inner = set(mesh.mesh_dim_names or ()) if mesh is not None else set()
    root = spec.mesh if spec.mesh is not None else (_root(mesh) if mesh is not None else None)
    if root is None:
        if kind == "weight":  # a replicated (DDP) or all-gathered (FSDP) weight on every rank
            copies.append((dist.get_world_size(), dist.get_rank()))
    else:
        names = tuple(root.mesh_dim_names or ())
        for i, name in enumerate(names):
            if name in inner:
                continue
            data = name in spec.data_dims if spec.data_dims else True
            if kind == "weight" or not data:
                copies.append((root.size(i), root.get_local_rank(i)))
    piece, pieces = _linear_index(copies)
    return Share(_local(x), piece, pieces, tuple(groups), timeout_s)


def _linear_index(copies: Sequence[tuple[int, int]]) -> tuple[int, int]:
    piece, pieces = 0, 1
    for size, coord in copies:
        piece = piece * size + coord
        pieces *= size
    return piece, pieces


def _is_split(placement: Any) -> bool:
    """``Shard`` and FSDP's ``_StridedShard`` (neither replicated nor partial)."""
    return not placement.is_replicate() and not placement.is_partial()


def is_dtensor(x: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor``."""
    if type(x) in _PLAIN:  # the hooks' common case, without the import's cost per call
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if is_dtensor(x) else x


def _without_partial(x: DTensor) -> DTensor:
    if not any(p.is_partial() for p in x.placements):
        return x
    from torch.distributed.tensor import Replicate

    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])


def _root(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself when it is a root)."""
    getter = getattr(mesh, "_get_root_mesh", None)
    root = getter() if getter is not None else None
    return mesh if root is None else root


def observed_weight(in_forward: Any, resting: Any) -> Any:
    """The weight whose statistics a forward hook should take.

    Normally the weight the forward used (FSDP2: all-gathered, a copy on every rank). With FP8
    all-gather (torchao's ``enable_fsdp_float8_all_gather``) the forward sees the gathered FP8
    weight, a tensor subclass: its high-precision values exist only as the FSDP2 shards, so each
    rank judges its resting shard (a DTensor) and the shards merge over the mesh, with the global
    scale (the current scale from the amax over all shards, as torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` and its all-gather compute it).
    """
    if not isinstance(in_forward, torch.Tensor) or not is_dtensor(resting) or resting is in_forward:
        return in_forward
    if type(in_forward) in (torch.Tensor, torch.nn.Parameter) or is_dtensor(in_forward):
        return in_forward
    return resting


def grad_sq_share(model: torch.nn.Module, spec: ShardSpec | None = None) -> torch.Tensor | None:
    """This rank's share of the squared L2 norm of all parameter gradients (float32, on the device).

    A SUM over the world of these shares is the squared global norm: DTensor gradients contribute
    their local shard (divided by the number of ranks holding it, for ``Replicate`` dimensions
    and dimensions outside the gradient's mesh), plain gradients (DDP: identical everywhere)
    their square divided by the world size. ``None`` without gradients.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    total: torch.Tensor | None = None
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if is_dtensor(g):
            copies = math.prod(
                g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not _is_split(pl)
            )
            copies *= world // g.device_mesh.size()
            local = g.to_local()
        else:
            copies, local = world, g
        sq = torch.linalg.vector_norm(local.detach().to(torch.float32)).square() / copies
        total = sq if total is None else total + sq
    return total


__all__ = ["ShardSpec", "Share", "share_of", "observed_weight", "grad_sq_share", "is_dtensor", "SHARD_SCALES"]

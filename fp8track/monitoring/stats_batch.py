"""One statistics pass per hook phase: the observations of a forward, then of a backward, computed
together.

A sampled step observes every monitored layer's activation and weight in the forward and its dY
in the backward. Computing each observation on its own costs a call chain per (layer, tensor):
dozens of small launches, and on a GPU the host's launch path, not the device, sets the step time.
The layers' hooks instead hand a per-tensor (current or given scale) observation to the
monitor's :class:`StatsBatch`, which keeps a reference to the tensor and computes all of them in
grouped launches (:func:`fp8track.numerics.segment_stats.tensors_partial_stats`, one per element
format and margin) at the end of the phase, merging each result into its layer's accumulator.

Phase ends (where the batch is computed):

* the first dY hook of a backward (the forward's activations and weights: before any optimizer
  step can change a weight in place), and the end of that backward
  (``Variable._execution_engine.queue_callback``, as FSDP marks it) for the dY;
* the monitor's flush (anything still waiting), and a bound on the elements waiting
  (:data:`MAX_PENDING_NUMEL`), so the batch never holds more than that beyond what training holds.

What the batch holds is what training holds anyway (activations are saved for the backward,
weights are parameters), except dY, kept until the end of the backward (bounded as above). Tensors
too large to gain from grouping (:data:`DIRECT_NUMEL`), sharded ones, what-if block variants and
observations with a tensor dump take the per-tensor path at once; on CPU a phase's few tensors
that the compiled kernel takes are computed one by one at the phase end (:data:`PER_TENSOR_BELOW`:
there the grouped pass's fixed cost exceeds their calls').

One tensor, one pass: layers that read the same input (a transformer's q, k and v projections, an
MLP's gate and up projections) observe the same tensor, and under current scaling (the scale from
the tensor's own amax: an FP8 run with current scaling, the BF16 control's shadow statistics, the
``current`` what-if) its partial does not depend on the layer. Within a phase such an observation is
computed once, for the first layer, and the others merge the same partial (:func:`same_tensor_key`:
the same storage, view, dtype and version, the format and margin). A given scale (delayed scaling's
per-layer history) is the layer's own, so those observations are computed per layer. A shared
partial must stand alone, so the kernel cannot merge it into an accumulator in the same call: the
per-tensor path's later micro-batches wait for the phase end and merge in one stacked operation.
"""

from __future__ import annotations

import warnings

import torch

from fp8track.numerics.kernel_policy import wants_compiled
from fp8track.numerics.segment_stats import tensors_partial_stats
from fp8track.numerics.stats import merge_partials, partial_stats

MAX_PENDING_NUMEL = 1 << 22
"""Elements waiting before the batch is computed early (the grouped pass's float32 temporaries are
a few times this many)."""

DIRECT_NUMEL = {"cpu": 1 << 13}
"""Per device type, tensors of at least this many elements skip the batch (absent: only
:data:`MAX_PENDING_NUMEL` bounds them). On CPU the compiled per-tensor kernel processes large
tensors faster than the grouped eager pass, and its fixed cost per call is small next to theirs;
on a GPU the launch path costs more than any tensor's pass, so everything is grouped."""

PER_TENSOR_BELOW = {"cpu": 8}
"""Per device type: a phase's group (one format and margin) of fewer than this many tensors, each
of which the compile policy gives the compiled kernel (:func:`wants_compiled`), is computed tensor by
tensor at the phase end instead of in one grouped pass (absent: always grouped). On CPU the grouped
pass has a fixed cost of 0.55-0.65 ms (about a hundred small eager ops around two compiled calls)
and a compiled per-tensor call of 2,048-8,191 elements costs 70-110 us after a GEMM, so a few such
tensors (the example GPT's two 64x64 attention projections per forward) cost less one by one
(bench: k tensors of 4,096 elements, grouped against per tensor: 2 tensors 0.62 / 0.17 ms, 8 0.71 /
0.61, 16 0.84 / 1.14; docs/performance.md). A tensor the policy leaves eager keeps its group
together: its own eager partial costs ~0.3 ms, in the grouped pass a few tens of microseconds."""

Accumulators = dict[tuple[str, str], torch.Tensor]
_Item = tuple[Accumulators, tuple[str, str], torch.Tensor, int, str, "torch.Tensor | None", int, int]
"""(accumulators, key, tensor, its version counter at observation, format, scale or None, margin,
index of the item whose partial it shares: its own index, or that of an earlier observation of the
same tensor under current scaling)"""

_Merge = tuple[Accumulators, tuple[str, str], torch.Tensor]
"""(accumulators, key, partial waiting to be merged into ``accumulators[key]``)"""

SameTensorKey = tuple[torch.device, int, torch.Size, tuple[int, ...], torch.dtype, int, str, int]


def same_tensor_key(x: torch.Tensor, fmt: str, margin: int) -> SameTensorKey | None:
    """What makes two current-scaling observations one computation: the device, the first element's
    address, shape, strides and dtype (the same view of the same memory), the version counter (no
    in-place change in between), the format and the margin. Only valid while ``x`` is alive (the
    batch keeps a reference to every tensor it keys, so no other tensor can take its address).
    ``None`` (never shared) for a tensor subclass: a wrapper may have no storage of its own."""
    if type(x) is not torch.Tensor:
        return None
    return (x.device, x.data_ptr(), x.shape, x.stride(), x.dtype, x._version, fmt, margin)


class StatsBatch:
    """Observations waiting for one grouped statistics pass (one per monitor, shared by its layers)."""

    def __init__(self, max_pending_numel: int = MAX_PENDING_NUMEL) -> None:
        self.max_pending_numel = max_pending_numel
        self._items: list[_Item] = []
        self._numel = 0
        # This phase's current-scaling observations: queued (key -> item index), and computed at
        # once by the per-tensor path (key -> (tensor, kept alive for its address; partial)).
        self._queued: dict[SameTensorKey, int] = {}
        self._computed: dict[SameTensorKey, tuple[torch.Tensor, torch.Tensor]] = {}
        # Partials of the per-tensor path waiting to be merged into an accumulator that already
        # holds an earlier micro-batch's: (id(accumulators), key) -> (accumulators, key, partial).
        self._merges: dict[tuple[int, tuple[str, str]], _Merge] = {}
        self._in_backward = False
        self._warned = False

    def __len__(self) -> int:
        return len(self._items)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is grouped (non-empty floating point, below the device's direct size)."""
        n = x.numel()
        limit = DIRECT_NUMEL.get(x.device.type, self.max_pending_numel)
        return 0 < n < limit and x.is_floating_point()

    def add(
        self, into: Accumulators, key: tuple[str, str], x: torch.Tensor, fmt: str,
        scale: torch.Tensor | None, margin: int,
    ) -> None:
        """Queue ``x``'s partial (``fmt``; ``scale`` None: current scaling) for ``into[key]``; a
        current-scaling observation of a tensor already queued in this phase shares its partial.

        A given scale is copied now (a backend updates its scale tensor in place later)."""
        index = len(self._items)
        if scale is not None:
            scale = scale.detach().to(torch.float32, copy=True)
        elif (same_key := same_tensor_key(x, fmt, margin)) is not None:
            same = self._queued.setdefault(same_key, index)
            if same != index:
                self._items.append((into, key, x, x._version, fmt, None, margin, same))
                return
        self._items.append((into, key, x, x._version, fmt, scale, margin, index))
        self._numel += x.numel()
        if self._numel >= self.max_pending_numel:
            self.flush()

    def current_partial(self, x: torch.Tensor, fmt: str, margin: int) -> torch.Tensor:
        """``x``'s partial under current scaling by the per-tensor path (for tensors the batch does
        not group), computed once per phase for one tensor (the other layers that read it get the
        same partial, read only)."""
        key = same_tensor_key(x, fmt, margin)
        if key is None:
            return partial_stats(x, fmt, None, margin)
        hit = self._computed.get(key)
        if hit is None:
            hit = self._computed[key] = (x, partial_stats(x, fmt, None, margin))
        return hit[1]

    def merge_current(
        self, into: Accumulators, key: tuple[str, str], x: torch.Tensor, fmt: str, margin: int
    ) -> None:
        """Merge ``x``'s current-scaling partial (:meth:`current_partial`) into ``into[key]``.

        The first observation of a step takes the partial as it is. A later one (the next
        micro-batch) waits for the phase end, where all of them are merged in one stacked operation
        instead of a few eager ops each (the compiled kernel cannot merge them itself: the partial
        is shared, so it must stand alone). Bit-equal to merging at once: each row is the same
        two-operand sum and maximum."""
        p = self.current_partial(x, fmt, margin)
        token = (id(into), key)
        if token in self._merges:  # the same layer twice in one phase: merge in observation order
            self.merge_waiting()
        prev = into.get(key)
        if prev is None:
            into[key] = p
        else:
            self._merges[token] = (into, key, p)

    def merge_waiting(self) -> None:
        """Merge every waiting partial into its accumulator (one stacked merge per device)."""
        if not self._merges:
            return
        waiting, self._merges = list(self._merges.values()), {}
        by_device: dict[torch.device, list[_Merge]] = {}
        for item in waiting:
            by_device.setdefault(item[2].device, []).append(item)
        for items in by_device.values():
            prev = torch.stack([into[key].to(p.device) for into, key, p in items])
            merged = merge_partials(torch.stack([prev, torch.stack([p for *_, p in items])]))
            for (into, key, _), row in zip(items, merged.unbind(0), strict=True):
                into[key] = row

    def backward_started(self) -> None:
        """Called by every dY hook: at the first of a backward, compute the forward's batch and
        arrange for the backward's to be computed when it ends."""
        if self._in_backward:
            return
        self.flush()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:  # not inside the autograd engine (a hook called directly): stay per phase
            return
        self._in_backward = True

    def _backward_done(self) -> None:
        self._in_backward = False
        self.flush()

    def flush(self) -> None:
        """Compute every waiting observation, grouped by (device, format, margin), and merge each
        partial into its accumulator (in the order they were observed). Ends the phase: no later
        observation shares a partial computed before."""
        self.merge_waiting()
        self._computed.clear()
        if not self._items:
            return
        items, self._items, self._numel = self._items, [], 0
        self._queued.clear()
        groups: dict[tuple[torch.device, str, int], list[int]] = {}
        for i, item in enumerate(items):
            if item[7] == i:
                groups.setdefault((item[2].device, item[4], item[6]), []).append(i)
        rows: dict[int, torch.Tensor] = {}
        for (device, fmt, margin), idx in groups.items():
            xs, scales = [items[i][2] for i in idx], [items[i][5] for i in idx]
            if len(idx) < PER_TENSOR_BELOW.get(device.type, 0) and all(wants_compiled(x) for x in xs):
                parts = [partial_stats(x, fmt, s, margin) for x, s in zip(xs, scales, strict=True)]
            else:
                given = scales if any(s is not None for s in scales) else None
                parts = list(tensors_partial_stats(xs, fmt, given, margin).unbind(0))
            for i, row in zip(idx, parts, strict=True):
                rows[i] = row
        for into, key, x, version, *_, same in items:
            row = rows[same]
            prev = into.get(key)
            into[key] = row if prev is None else merge_partials([prev, row])
            if x._version != version:
                self._warn_modified()

    def _warn_modified(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "fp8track: a tensor observed by the monitor was modified in place before its "
                "statistics were computed (at the end of its forward or backward phase); they "
                "describe the modified values",
                stacklevel=3,
            )

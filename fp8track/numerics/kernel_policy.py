"""How the statistics kernel runs (the compile policy): eager, ``torch.compile`` per row length,
or the ahead-of-time package (:mod:`fp8track.numerics.aot_kernels`), chosen per process by
:func:`set_compile` (or ``$FP8TRACK_STATS_KERNEL``). The maths is in :mod:`fp8track.numerics.stats`
(what a partial is, merging, finalising) and :mod:`fp8track.numerics.stats_kernel` (the kernel as
a graph); this module decides only which path computes a partial, and gives the same numbers on
each (docs/statistics.md, docs/performance.md).

The compiled kernel sees a tensor as ``[R, C]`` rows (:func:`row_length`): rows are bounded per
device type (:data:`MAX_ROWS`), so on a GPU the kernel's speed does not depend on the first size
compiled; each row length has its own compiled kernel (its own Dynamo cache and recompile budget).
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch

from fp8track.errors import invalid_choice
from fp8track.numerics.stats_kernel import _CHUNK, _compiled_partial, _inductor_options, _row_sums

COMPILE_MIN_NUMEL = 2 * _CHUNK
"""Tensors with fewer elements take the eager path under the ``"auto"`` policy (see :func:`set_compile`)."""

_COMPILE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


MAX_ROWS: dict[str, int] = {"cuda": 4096}
"""Most rows of the compiled kernel's ``[R, C]`` view, per device type (absent: rows stay
:data:`_CHUNK` long). On a GPU a row is one thread block's reduction: bounding R by lengthening rows
keeps the over-rows stage small and the per-row stage parallel at every tensor size, whatever size
the kernel was first compiled for."""


def row_length(numel: int, device_type: str) -> int:
    """Row length C of the compiled kernel for ``numel`` elements on ``device_type``: :data:`_CHUNK`,
    doubled until ``numel / C`` rows fit :data:`MAX_ROWS` (a power of two, so a model meets few)."""
    max_rows = MAX_ROWS.get(device_type)
    c = _CHUNK
    if max_rows is not None:
        while c * max_rows < numel:
            c *= 2
    return c


DIRECT_DEVICES = ("cpu",)
"""Device types whose compiled kernel is called without Dynamo (:meth:`_CompilePolicy._build_direct`).
CUDA keeps ``torch.compile`` until the direct path has run on a GPU here."""


def _direct_key(inputs: tuple[torch.Tensor, ...]) -> tuple | None:
    """What a directly called graph assumed: the intra-op thread count (inductor's C++ code fixes
    its OpenMP team at compile time: a kernel built under ``torch.set_num_threads(1)`` stays on
    one thread), and of ``inputs`` the device, dtypes, every size but the rows of the first, and
    contiguity. ``None``: a layout the graph does not take (torch.compile serves it)."""
    if not all(t.is_contiguous() for t in inputs):
        return None
    layout = tuple((t.device, t.dtype, t.shape[1:] if i == 0 else t.shape) for i, t in enumerate(inputs))
    return (torch.get_num_threads(), *layout)


def _own_code(fn: Any) -> Any:
    """``fn`` with a code object of its own. Dynamo caches compiled graphs, and counts recompiles
    against its limit, per code object; a kernel per row length gets its own cache and budget."""
    import types

    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


COMPILE_MODES = ("auto", "aot", "compiled", "eager")
KERNEL_ENV = "FP8TRACK_STATS_KERNEL"
"""Environment variable naming the initial compile mode (e.g. ``aot`` for a run started from the
CLI or a Lightning script); :func:`set_compile` overrides it."""


def _mode_from_env() -> str:
    mode = os.environ.get(KERNEL_ENV, "auto")
    if mode not in COMPILE_MODES:
        raise invalid_choice(f"${KERNEL_ENV}", mode, COMPILE_MODES)
    return mode


class _CompilePolicy:
    """Holds the compile mode and the lazily built compiled kernels (one per device type and row
    length, per process)."""

    def __init__(self) -> None:
        self.mode: str = _mode_from_env()
        self.kernels: dict[tuple[str, int], Any] = {}
        self.failed = False
        self.aot: Any = None  # fp8track.numerics.aot_kernels.AotKernels, made on first use of "aot"
        # (device, dtype, row length, no tail) -> loaded runner, or None once its build failed
        self.aot_runners: dict[tuple[torch.device, torch.dtype, int, bool], Any] = {}
        # (graph name, device type) -> compiled per-row graph (R and C dynamic)
        self.row_kernels: dict[tuple[str, str], Any] = {}
        # _direct_key (thread count, input dtypes and sizes, R left out) -> inductor's compiled
        # graph called directly, or None once its build failed (torch.compile serves that variant)
        self.direct: dict[tuple, Any] = {}

    def wants(self, x: torch.Tensor) -> bool:
        if self.failed or self.mode == "eager" or x.dtype not in _COMPILE_DTYPES:
            return False
        return self.mode == "compiled" or x.numel() >= COMPILE_MIN_NUMEL

    def get_kernel(self, device_type: str, row_len: int) -> Any:
        key = (device_type, row_len)
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.kernels[key] = torch.compile(
                _own_code(_compiled_partial), options=_inductor_options()
            )
        return kernel

    def run(self, main: torch.Tensor, tail: torch.Tensor | None, *args: torch.Tensor) -> torch.Tensor:
        """:func:`_compiled_partial` on ``main`` (+ ``tail``): through the ahead-of-time package in
        ``"aot"`` mode once it is built, else (R >= 2) inductor's graph called directly on the
        :data:`DIRECT_DEVICES`, else ``torch.compile`` (R dynamic)."""
        device, c, rows = main.device, main.shape[1], main.shape[0]
        if self.mode == "aot" and rows >= 2:
            key = (device, main.dtype, c, tail is None)
            runner = self.aot_runners[key] if key in self.aot_runners else self._aot_runner(key)
            if runner is not None:
                return runner(main, tail, *args)
        if rows >= 2 and device.type in DIRECT_DEVICES:
            inputs = (main, *args) if tail is None else (main, tail, *args)
            if (shapes := _direct_key(inputs)) is not None:
                known = shapes in self.direct
                kernel = self.direct[shapes] if known else self._build_direct(shapes, tail is None, inputs)
                if kernel is not None:
                    return kernel(*inputs)
        if rows >= 2:
            torch._dynamo.mark_dynamic(main, 0)
        return self.get_kernel(device.type, c)(main, tail, *args)

    def _build_direct(self, key: tuple, no_tail: bool, inputs: tuple[torch.Tensor, ...]) -> Any:
        """Compile :func:`_compiled_partial` for ``inputs`` (R dynamic) to be called without Dynamo.

        Dynamo's frame evaluation, guards and AOT autograd's runtime wrappers cost about 40 us a
        call on CPU (35-44 us at 16K-262K elements, docs/performance.md): as much as the kernel
        itself on tensors of a few thousand elements. Here the graph is traced once with symbolic
        sizes (``make_fx``) and compiled by inductor with the same options
        (``torch._inductor.standalone_compile``): the same kernel (bit-equal results, tested),
        called straight. It has no guards: :func:`_direct_key` (thread count, dtypes, every size
        but R, contiguity) picks the graph instead. A build that fails leaves the variant to
        ``torch.compile``.
        """
        from torch._inductor import standalone_compile
        from torch.fx.experimental import _config as fx_config
        from torch.fx.experimental.proxy_tensor import make_fx

        def partial(*xs: torch.Tensor) -> torch.Tensor:
            return _compiled_partial(xs[0], None, *xs[1:]) if no_tail else _compiled_partial(*xs)

        kernel = None
        try:
            # No duck sizing (in the trace and in inductor's own shape environment): R must stay
            # a symbol of its own where it happens to equal another input's size.
            with fx_config.patch(use_duck_shape=False), torch.no_grad():  # type: ignore[attr-defined]
                graph = make_fx(partial, tracing_mode="symbolic")(*inputs)
                with torch._inductor.config.patch(_inductor_options()):
                    kernel = standalone_compile(graph, list(inputs))
        except Exception as exc:  # an inductor that cannot: torch.compile serves this variant
            warnings.warn(f"fp8track: direct build of the statistics kernel failed ({exc!r})", stacklevel=4)
        self.direct[key] = kernel
        return kernel

    def _aot_runner(self, key: tuple[torch.device, torch.dtype, int, bool]) -> Any:
        """Ask :class:`AotKernels` for the runner of ``key``; remember the answer once it is settled
        (loaded, or failed: ``None``), so later calls skip the spec and the build poll."""
        from fp8track.numerics import aot_kernels

        if self.aot is None:
            self.aot = aot_kernels.AotKernels()
        device, dtype, c, no_tail = key
        spec = aot_kernels.KernelSpec(device.type, str(dtype).removeprefix("torch."), c, not no_tail)
        runner = self.aot.get(spec, device.index)
        if runner is not None or spec in self.aot.failed:
            self.aot_runners[key] = runner
        return runner


_POLICY = _CompilePolicy()


def set_compile(mode: bool | str) -> None:
    """Choose how :func:`fp8track.numerics.stats.partial_stats` runs (process-wide).

    Args:
        mode: ``"auto"`` (default: ``torch.compile`` for tensors of at least :data:`COMPILE_MIN_NUMEL`
            elements, eager below, where call overhead dominates), ``"aot"`` (as ``"auto"``, but
            each kernel variant is also compiled ahead of time by AOTInductor in a background
            process and used once built: a fraction of the per-call host cost; see
            :mod:`fp8track.numerics.aot_kernels`), ``"compiled"``/``True`` (always compile),
            ``"eager"``/``False`` (never compile).

    The compiled kernel is built on first use (a few seconds; the first compile in a process also
    pays inductor's start-up). If compilation fails (e.g. no C++ compiler) a warning is issued
    once and the eager path is used from then on. Both paths give the same counts and agree on the
    sums to float rounding.
    """
    if mode is True:
        mode = "compiled"
    elif mode is False:
        mode = "eager"
    if mode not in COMPILE_MODES:
        raise invalid_choice("compile mode", mode, COMPILE_MODES)
    _POLICY.mode = str(mode)
    _POLICY.failed = False


def wait_for_aot_kernels(timeout_s: float = 600.0) -> dict[str, bool]:
    """Block until every ahead-of-time kernel build started so far (``"aot"`` mode) has finished.

    Training never needs this (it uses ``torch.compile`` until a package is ready); benchmarks and
    tests do, to measure or check the packaged kernels. Returns ``{variant: loaded}``.
    """
    if _POLICY.aot is None:
        return {}
    return {str(spec): ok for spec, ok in _POLICY.aot.wait_all(timeout_s).items()}


def get_compile() -> str:
    """The current compile mode (one of :data:`COMPILE_MODES`)."""
    return _POLICY.mode


def _split_rows(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``x`` flattened as ``main [R, c]`` (R >= 1, a view) and a zero-padded ``tail [1, c]``
    (``None`` when the length is a multiple of ``c``, as most layer shapes are: that graph
    skips the tail's reductions and buffers, which dominate the call cost of small tensors)."""
    flat = x.reshape(-1)
    n = flat.numel()
    r = n // c
    tail_n = n - r * c
    if tail_n == 0 and r >= 1:
        return flat.view(r, c), None, 0
    tail = flat.new_zeros((1, c))
    tail[0, :tail_n] = flat[r * c :]
    pad = c - tail_n
    if r == 0:
        return tail, flat.new_zeros((1, c)), pad + c
    return flat[: r * c].view(r, c), tail, pad


def compiled_partial(
    x: torch.Tensor, acc: torch.Tensor, *args: torch.Tensor
) -> tuple[torch.Tensor, int] | None:
    """``x``'s partial merged into ``acc`` by the compiled (or ahead-of-time) kernel, with the
    number of padding zeros it counted (to take out of the counts), or None when compilation
    failed: then a warning is issued once and the eager path is used from then on. ``args``: the
    kernel's 0-d scale, current-scaling flag and format constants."""
    main, tail, tail_pad = _split_rows(x, row_length(x.numel(), x.device.type))
    try:
        return _POLICY.run(main, tail, acc, *args), tail_pad
    except Exception as exc:  # compiler missing or broken: warn once, stay eager
        _compile_failed(exc)
        return None


def _compile_failed(exc: Exception) -> None:
    """Compilation failed (no C++ compiler, a broken toolchain): warn once, eager from then on."""
    _POLICY.failed = True
    warnings.warn(f"fp8track: torch.compile of the statistics kernel failed ({exc!r}); using eager",
                  stacklevel=4)


def _row_sums_graph(
    x32: torch.Tensor, s_rows: torch.Tensor, p_rows: torch.Tensor, fconst: torch.Tensor
) -> torch.Tensor:
    """What the compiled per-row kernel runs: :func:`_row_sums` with float64 accumulation and the
    FP8 grid rounding of the compiled partial kernel (equal to the real cast)."""
    return _row_sums(x32, s_rows, p_rows, fconst, None, torch.float64)


def row_extrema(x32: torch.Tensor) -> torch.Tensor:
    """``[R, 2]`` float32: each row's largest finite ``|x|`` (0 when none) and smallest non-zero
    finite ``|x|`` (``inf`` when none) of ``x32 [R, C]`` (C > 0). Max and min are exact in any
    order, so the eager and compiled graphs agree bit for bit."""
    finite_abs = torch.where(torch.isfinite(x32), x32.abs(), 0.0)
    row_amax = finite_abs.amax(dim=1)
    row_amin = torch.where(finite_abs > 0, finite_abs, math.inf).amin(dim=1)
    return torch.stack([row_amax, row_amin], dim=1)


def _run_rows(name: str, graph: Any, x32: torch.Tensor, *args: torch.Tensor) -> torch.Tensor | None:
    """``graph(x32, *args)`` compiled once per device type (R and C dynamic), or ``None`` where the
    policy keeps ``x32`` eager or compilation failed (then a warning once, eager from then on)."""
    if not _POLICY.wants(x32):
        return None
    try:
        key = (name, x32.device.type)
        kernel = _POLICY.row_kernels.get(key)
        if kernel is None:
            kernel = _POLICY.row_kernels[key] = torch.compile(
                _own_code(graph), dynamic=True, options=_inductor_options()
            )
        return kernel(x32, *args)
    except Exception as exc:  # compiler missing or broken: warn once, stay eager
        _compile_failed(exc)
        return None


def compiled_row_sums(
    x32: torch.Tensor, s_rows: torch.Tensor, p_rows: torch.Tensor, fconst: torch.Tensor
) -> torch.Tensor | None:
    """Per-row sums ``[R, 8]`` of ``x32 [R, C]`` (each row with its scale ``s_rows [R, 1]`` and
    normaliser ``p_rows [R, 1]``) in one fused pass, for the row groups of
    :func:`fp8track.numerics.segment_stats.segment_partial_stats`; ``None`` where the policy keeps
    ``x32`` eager or compilation failed (then a warning once, eager from then on). Eager, the eight
    sums are eight passes over the tensor plus the elementwise temporaries: several times the
    loop over groups it replaces; fused, a fraction of it."""
    return _run_rows("row_sums", _row_sums_graph, x32, s_rows, p_rows, fconst)


def compiled_row_extrema(x32: torch.Tensor) -> torch.Tensor | None:
    """:func:`row_extrema` of ``x32 [R, C]`` in one fused pass (eager it is about nine passes with
    full-size temporaries: ``isfinite``, ``abs``, two ``where``, a comparison, the reductions), or
    ``None`` as :func:`compiled_row_sums`."""
    return _run_rows("row_extrema", row_extrema, x32)  # _own_code gives it a code object of its own


def wants_compiled(x: torch.Tensor) -> bool:
    """Whether the policy computes ``x``'s partial with the compiled kernel."""
    return _POLICY.wants(x)


__all__ = [
    "COMPILE_MODES",
    "COMPILE_MIN_NUMEL",
    "KERNEL_ENV",
    "MAX_ROWS",
    "row_length",
    "set_compile",
    "get_compile",
    "wait_for_aot_kernels",
    "compiled_partial",
    "compiled_row_sums",
    "compiled_row_extrema",
    "row_extrema",
    "wants_compiled",
]

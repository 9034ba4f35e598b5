"""Ahead-of-time compiled statistics kernels (AOTInductor packages), built in a background process.

Why: a call of the ``torch.compile`` kernel spends most of its time around the kernel, not in it.
On CPU (4096 elements, idle machine) the call takes 0.051 ms of which the kernel is 0.012 ms; the
rest is dynamo's frame and guard handling and the AOT-autograd and inductor Python wrappers. On a
GPU the inductor wrapper also launches each of the ~8 Triton kernels from Python: 0.37 ms of host
time per call on an H200, so a monitored step there is bound by the host. The same graph exported
and compiled by AOTInductor runs through a C++ runner with no guards and no Python wrapper
(0.021 ms for the call above).

Building a package takes ~20 s on 2 CPU cores, once per (device type, dtype, row length, tail)
and torch version: too slow to do inline. :class:`AotKernels` therefore starts the build in a
subprocess (``python -m fp8track.numerics.aot_kernels SPEC``) on first use, the caller keeps using
the ``torch.compile`` kernel meanwhile, and the package is loaded once the file appears. Packages
are cached on disk (``$FP8TRACK_CACHE_DIR``, default ``~/.cache/fp8track``), keyed by the torch
version, the kernel's source (a hash of :mod:`fp8track.numerics.stats_kernel`), the inductor options and
the device (on CUDA, its compute capability), so a later run loads them at once.

A build that fails (no C++ compiler, a torch without AOTInductor, a package that crashes or
computes something else when loaded: the build process loads and checks it before publishing it)
warns once and leaves that kernel on ``torch.compile``; nothing else changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fp8track.errors import ConfigError
from fp8track.numerics import stats_kernel
from fp8track.numerics.formats import get_format

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOCK_STALE_S = 900.0
"""A build lock older than this is taken to belong to a build that died."""


@dataclass(frozen=True)
class KernelSpec:
    """One AOT-compiled variant of the statistics kernel.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: the observed tensor's dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        row_length: C of the kernel's ``[R, C]`` view (:func:`fp8track.numerics.kernel_policy.row_length`);
            R is dynamic (>= 2).
        tail: whether the graph takes the zero-padded tail row.
    """

    device_type: str
    dtype: str
    row_length: int
    tail: bool

    def __post_init__(self) -> None:
        if self.device_type not in ("cpu", "cuda"):
            raise ConfigError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.row_length < 1:
            raise ConfigError(f"row_length must be >= 1, got {self.row_length!r}")


def cache_dir() -> Path:
    """Where packages are kept: ``$FP8TRACK_CACHE_DIR`` or ``~/.cache/fp8track``, then ``aot_kernels``."""
    root = os.environ.get("FP8TRACK_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fp8track")
    return Path(root) / "aot_kernels"


def _fingerprint(spec: KernelSpec) -> str:
    device = spec.device_type
    if device == "cuda" and torch.cuda.is_available():
        device += "-sm{}{}".format(*torch.cuda.get_device_capability())
    source = Path(stats_kernel.__file__).read_bytes()
    parts = [torch.__version__, device, json.dumps(asdict(spec), sort_keys=True),
             json.dumps(stats_kernel._inductor_options(), sort_keys=True), hashlib.sha256(source).hexdigest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def package_path(spec: KernelSpec) -> Path:
    """The package file of ``spec`` for this torch, kernel source and device."""
    tail = "tail" if spec.tail else "notail"
    name = f"{spec.device_type}-{spec.dtype}-c{spec.row_length}-{tail}-{_fingerprint(spec)}.pt2"
    return cache_dir() / name


_Inputs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _example_inputs(spec: KernelSpec) -> _Inputs:
    """``(main, tail or None, into, scale, use_current, fconst)``: one call's arguments."""
    dev = torch.device(spec.device_type)
    fconst = stats_kernel._fmt_consts(get_format("e4m3"), 0, dev)
    main = torch.randn(4, spec.row_length, device=dev).to(_DTYPES[spec.dtype])
    tail = torch.zeros(1, spec.row_length, device=dev, dtype=main.dtype) if spec.tail else None
    flag = torch.tensor(True, device=dev)
    return (
        main,
        tail,
        stats_kernel.empty_partial(dev),
        fconst[stats_kernel._F_MARGIN].reshape(()),
        flag,
        fconst,
    )


class _Graph(torch.nn.Module):
    """The kernel's graph without the tail row (export takes tensors only, not ``None``)."""

    def forward(self, main, into, scale, use_current, fconst):  # noqa: ANN001, ANN201
        return stats_kernel._compiled_partial(main, None, into, scale, use_current, fconst)


class _GraphWithTail(torch.nn.Module):
    """The kernel's graph with the zero-padded tail row."""

    def forward(self, main, tail, into, scale, use_current, fconst):  # noqa: ANN001, ANN201
        return stats_kernel._compiled_partial(main, tail, into, scale, use_current, fconst)


def build(spec: KernelSpec, path: Path | None = None) -> Path:
    """Export and AOT-compile ``spec`` into ``path`` (default :func:`package_path`), synchronously.

    The package is published (renamed from a temporary name, so a reader never sees half of one)
    only after this process has loaded it and checked one call against the eager graph: on one
    H200 with torch 2.11 a CUDA package built fine and then crashed the process that loaded it, so
    loading is proven here, in the build process, before a training process ever tries.
    """
    path = path or package_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)  # fails at once, before compiling, if it cannot
    inputs = [t for t in _example_inputs(spec) if t is not None]
    rows = torch.export.Dim("rows", min=2)
    dynamic = ({0: rows},) + (None,) * (len(inputs) - 1)
    graph = _GraphWithTail() if spec.tail else _Graph()
    program = torch.export.export(graph, tuple(inputs), dynamic_shapes=dynamic)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp), inductor_configs=stats_kernel._inductor_options()
    )
    try:
        _check_package(spec, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def _check_package(spec: KernelSpec, path: Path) -> None:
    """Load ``path`` and compare one call (7 rows of fresh data) with the graph run eagerly."""
    main, tail, into, scale, flag, fconst = _example_inputs(spec)
    main = (torch.randn(7, spec.row_length, device=main.device) * 50).to(main.dtype)
    device_index = main.device.index if main.device.type == "cuda" else None
    got = _Runner(path, spec.tail, device_index)(main, tail, into, scale, flag, fconst).cpu()
    want = stats_kernel._compiled_partial(main, tail, into, scale, flag, fconst).cpu()
    if not (torch.equal(got[:5], want[:5]) and torch.allclose(got, want, rtol=1e-5, atol=0)):
        raise RuntimeError(
            f"the package's result {got.tolist()} differs from the eager graph's {want.tolist()}"
        )


class _Runner:
    """A loaded package: ``run(main, tail, into, scale, use_current, fconst)`` -> the merged partial."""

    def __init__(self, path: Path, tail: bool, device_index: int | None) -> None:
        index = -1 if device_index is None else device_index
        self.loader = torch._inductor.aoti_load_package(str(path), device_index=index).loader
        self.tail = tail
        self._run = getattr(self.loader, "boxed_run", None) or self.loader.run

    def __call__(self, main, tail, into, scale, use_current, fconst) -> torch.Tensor:  # noqa: ANN001
        args = (
            [main, tail, into, scale, use_current, fconst]
            if self.tail
            else [main, into, scale, use_current, fconst]
        )
        return self._run(args)[0]


class AotKernels:
    """The AOT kernels of one process: loaded runners, background builds in flight, failures."""

    def __init__(self, python: str | None = None) -> None:
        """``python``: the interpreter that runs the builds (default: this one)."""
        self.python = python or sys.executable
        self.runners: dict[tuple[KernelSpec, int | None], _Runner] = {}
        self.paths: dict[KernelSpec, Path] = {}
        self.building: dict[KernelSpec, subprocess.Popen | None] = {}
        self.failed: set[KernelSpec] = set()

    def get(self, spec: KernelSpec, device_index: int | None = None) -> _Runner | None:
        """The runner for ``spec`` (on CUDA device ``device_index``), or ``None`` while it is being
        built or if it cannot be. Never waits: at most a file check and a ``poll`` of the build."""
        runner = self.runners.get((spec, device_index))
        if runner is not None or spec in self.failed:
            return runner
        path = self.paths.get(spec)
        if path is None:
            path = self.paths[spec] = package_path(spec)
        if spec not in self.building:
            if path.exists():
                return self._load(spec, path, device_index)
            self.building[spec] = self._start(spec, path)
            return None
        proc = self.building[spec]
        if proc is not None and proc.poll() is None:
            return None
        if path.exists():
            return self._load(spec, path, device_index)
        if proc is None:  # another process holds the build lock: wait for its package or a stale lock
            if _lock_age(path) > LOCK_STALE_S:
                self.building[spec] = self._start(spec, path)
            return None
        log = _log_path(path)
        err = log.read_text(errors="replace")[-600:].strip() if log.exists() else ""
        _lock_path(path).unlink(missing_ok=True)  # ours: a dead builder cannot remove it
        self._fail(spec, f"the background build exited with code {proc.returncode}: {err}")
        return None

    def wait(
        self, spec: KernelSpec, device_index: int | None = None, timeout_s: float = 600.0
    ) -> _Runner | None:
        """Block until ``spec`` is loaded or has failed (benchmarks and tests; training never waits)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            runner = self.get(spec, device_index)
            if runner is not None or spec in self.failed:
                return runner
            time.sleep(0.2)
        return None

    def wait_all(self, timeout_s: float = 600.0) -> dict[KernelSpec, bool]:
        """Wait for every build started so far; returns spec -> whether its package loads."""
        deadline = time.monotonic() + timeout_s
        return {
            spec: self.wait(spec, timeout_s=max(0.0, deadline - time.monotonic())) is not None
            for spec in list(self.building)
        }

    def _start(self, spec: KernelSpec, path: Path) -> subprocess.Popen | None:
        lock = _lock_path(path)
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            if _lock_age(path) > LOCK_STALE_S:
                lock.unlink(missing_ok=True)
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None  # another process (a DDP rank) is building it
        except OSError as exc:
            self._fail(spec, f"cannot write to the cache folder {path.parent}: {exc}")
            return None
        cmd = [self.python, "-m", "fp8track.numerics.aot_kernels", json.dumps(asdict(spec)), str(path)]
        with open(_log_path(path), "wb") as log:  # a file, not a pipe: nobody reads a pipe while it builds
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))

    def _load(self, spec: KernelSpec, path: Path, device_index: int | None) -> _Runner | None:
        try:
            runner = self.runners[(spec, device_index)] = _Runner(path, spec.tail, device_index)
        except Exception as exc:  # a corrupt or foreign package: stay on torch.compile
            self._fail(spec, f"loading {path} failed: {exc!r}")
            return None
        _lock_path(path).unlink(missing_ok=True)
        return runner

    def _fail(self, spec: KernelSpec, why: str) -> None:
        self.failed.add(spec)
        warnings.warn(
            f"fp8track: no ahead-of-time statistics kernel for {spec} ({why}); using torch.compile",
            stacklevel=3,
        )


def _log_path(path: Path) -> Path:
    return path.with_name(path.name + ".log")


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _lock_age(path: Path) -> float:
    """Seconds since the build lock of ``path`` was taken (inf when there is none)."""
    try:
        return time.time() - _lock_path(path).stat().st_mtime
    except OSError:
        return float("inf")


def main(argv: list[str]) -> int:
    """Background build: ``python -m fp8track.numerics.aot_kernels SPEC_JSON PATH``."""
    spec = KernelSpec(**json.loads(argv[0]))
    path = Path(argv[1])
    try:
        build(spec, path)
    finally:
        _lock_path(path).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

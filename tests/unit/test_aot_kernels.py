"""Ahead-of-time statistics kernels: built in the background, loaded from disk, equal to the JIT kernel,
and a failure of any kind leaves the statistics on torch.compile."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from fp8track.errors import ConfigError
from fp8track.numerics import aot_kernels, stats, stats_kernel
from fp8track.numerics.aot_kernels import AotKernels, KernelSpec
from fp8track.numerics.stats import partial_stats


@pytest.fixture
def aot_mode(tmp_path, monkeypatch):
    """"aot" mode with an empty package cache of its own and no runners loaded."""
    monkeypatch.setenv("FP8TRACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(stats._POLICY, "aot", None)
    monkeypatch.setattr(stats._POLICY, "aot_runners", {})
    stats.set_compile("aot")
    yield tmp_path / "cache" / "aot_kernels"
    stats.set_compile("auto")


def _agree(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got[:5], want[:5])  # counts exactly
    assert torch.allclose(got[5:9], want[5:9], rtol=1e-6, atol=0)  # float32 row sums
    assert torch.equal(got[9:], want[9:])  # amax, amin, scale range


def test_packages_build_in_the_background_then_replace_the_jit_kernel(aot_mode, tmp_path):
    """Long (about 60-80 s): two AOTInductor packages are built; building them is what is tested.

    The builders wait for a gate file before they start, so no package can appear while the first
    calls (and another process's look at the cache) are checked: a build is faster than a cold
    ``torch.compile`` of the same kernel, and used to finish in between."""
    gate = tmp_path / "go"
    gated_python = tmp_path / "gated_python.sh"
    gated_python.write_text(
        f'#!/bin/sh\nwhile [ ! -e "{gate}" ]; do sleep 0.05; done\nexec "{sys.executable}" "$@"\n'
    )
    gated_python.chmod(0o755)
    stats._POLICY.aot = AotKernels(python=str(gated_python))
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4 * 1024, generator=gen) * 30).to(torch.bfloat16)  # whole rows: the tail-free graph
    y = torch.exp(3 * torch.randn(5000, generator=gen)).to(torch.bfloat16)  # a padded tail row
    y[::7] = 0.0
    cases = [(x, "e4m3", None, None), (y, "e5m2", 0.01, None), (y, "e4m3", None, "acc")]

    def run_all() -> list[torch.Tensor]:
        out = []
        for t, fmt, scale, into in cases:
            acc = partial_stats(x, "e4m3") if into else None
            out.append(partial_stats(t, fmt, scale, into=acc))
        return out

    first = run_all()  # starts both builds; these results come from torch.compile
    assert len(stats._POLICY.aot.building) == 2 and not stats._POLICY.aot_runners
    # Another process (a DDP rank on the same machine) finds the build lock and waits for the package.
    other = AotKernels()
    spec = KernelSpec("cpu", "bfloat16", 1024, False)
    assert other.get(spec) is None and other.building == {spec: None}
    stats.set_compile("auto")
    jit = run_all()
    for got, want in zip(first, jit, strict=True):
        assert torch.equal(got, want)
    stats.set_compile("aot")
    gate.touch()
    loaded = stats.wait_for_aot_kernels(600)
    assert sorted(loaded.values()) == [True, True], loaded
    packaged = run_all()
    assert len(stats._POLICY.aot_runners) == 2  # the packages served these calls
    for got, want in zip(packaged, jit, strict=True):
        _agree(got, want)
    assert sorted(p.name.split("-")[3] for p in aot_mode.glob("*.pt2")) == ["notail", "tail"]
    assert not list(aot_mode.glob("*.lock")) and not list(aot_mode.glob("*.tmp.pt2"))
    # A new process finds the packages on disk and loads them without building.
    fresh = AotKernels()
    assert fresh.get(spec) is not None and not fresh.building
    assert other.get(spec) is not None  # the waiting rank loads the package the first one built


def test_an_unwritable_cache_warns_once_and_stays_on_torch_compile(aot_mode, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("FP8TRACK_CACHE_DIR", str(blocker))
    x = torch.randn(4096).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="cannot write to the cache folder"):
        got = partial_stats(x, "e4m3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = partial_stats(x, "e4m3")  # no second warning, no second attempt
    stats.set_compile("auto")
    assert torch.equal(got, partial_stats(x, "e4m3")) and torch.equal(again, got)


def test_a_corrupt_package_warns_and_stays_on_torch_compile(aot_mode):
    spec = KernelSpec("cpu", "bfloat16", 1024, False)
    path = aot_kernels.package_path(spec)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a package")
    x = torch.randn(4096).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="loading .* failed"):
        got = partial_stats(x, "e4m3")
    stats.set_compile("auto")
    assert torch.equal(got, partial_stats(x, "e4m3"))


def test_package_names_change_with_the_kernel_source_and_the_variant(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8TRACK_CACHE_DIR", str(tmp_path))
    a = aot_kernels.package_path(KernelSpec("cpu", "bfloat16", 1024, False))
    assert a.parent == tmp_path / "aot_kernels"
    assert a != aot_kernels.package_path(KernelSpec("cpu", "bfloat16", 1024, True))
    assert a != aot_kernels.package_path(KernelSpec("cpu", "float32", 1024, False))
    monkeypatch.setattr(stats_kernel, "_INDUCTOR_OPTIONS", {"realize_reads_threshold": 3})
    assert a != aot_kernels.package_path(
        KernelSpec("cpu", "bfloat16", 1024, False)
    )  # other options, other key


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_type": "tpu"}, "'cpu' or 'cuda'.*'tpu'"),
        ({"dtype": "int8"}, r"\['bfloat16', 'float16', 'float32'\].*'int8'"),
        ({"row_length": 0}, "row_length must be >= 1"),
    ],
)
def test_kernel_spec_rejects_bad_values(kwargs, match):
    base = {"device_type": "cpu", "dtype": "bfloat16", "row_length": 1024, "tail": False}
    with pytest.raises(ConfigError, match=match):
        KernelSpec(**{**base, **kwargs})


def test_the_environment_chooses_the_initial_mode(monkeypatch):
    monkeypatch.setenv(stats.KERNEL_ENV, "aot")
    assert stats._CompilePolicy().mode == "aot"
    monkeypatch.setenv(stats.KERNEL_ENV, "fast")
    with pytest.raises(
        ConfigError, match=r"\$FP8TRACK_STATS_KERNEL 'fast'.*'auto', 'aot', 'compiled', 'eager'"
    ):
        stats._CompilePolicy()


def test_a_builder_that_crashes_leaves_the_statistics_on_torch_compile(aot_mode, tmp_path, monkeypatch):
    """A build process that dies (on the H200 with torch 2.11, loading a CUDA package segfaulted; the
    builder loads it first, so the crash happens there): one warning, no package, results unchanged."""
    crasher = tmp_path / "crash.sh"
    crasher.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crasher.chmod(0o755)
    stats._POLICY.aot = AotKernels(python=str(crasher))
    x = torch.randn(4096).to(torch.bfloat16)
    first = partial_stats(x, "e4m3")
    with pytest.warns(UserWarning, match="exited with code -11"):
        assert stats.wait_for_aot_kernels(60) == {str(KernelSpec("cpu", "bfloat16", 1024, False)): False}
    assert not list(aot_mode.glob("*.pt2")) and not list(aot_mode.glob("*.lock"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = partial_stats(x, "e4m3")
    stats.set_compile("auto")
    assert torch.equal(first, partial_stats(x, "e4m3")) and torch.equal(again, first)

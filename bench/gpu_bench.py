"""GPU benchmark and proof of the hot-path rules in one command (under 5 minutes on one H200).

Prints one JSON object:

* ``stats_vs_amax``: the statistics kernel (``partial_stats``, compiled for the device) against one
  ``x.abs().amax()`` pass on 4096x4096 and 16384x16384 bf16 (CUDA-event timed, interleaved).
* ``monitor``: step time of a 12-layer, 1024-wide GPT in FP8 (Transformer Engine, or torchao
  where TE is missing) with no monitor and with sampling every 100, 10 and 1 steps, interleaved in
  rounds; ``sync``: host synchronisations counted with ``torch.cuda.set_sync_debug_mode("warn")``
  in forward+backward (the hooks) on sampled and unsampled steps and in ``monitor.step`` (the
  flush: exactly one host copy per logging step; none on unsampled steps), each against the
  same step without a monitor.
* ``te_debug``: where Transformer Engine >= 2.7 is installed, the same model and statistics
  through TE's debug API (``LogFp8TensorStats`` via nvdlfw_inspect) every step, side by side.

Without CUDA it prints ``{"skipped": "no CUDA"}`` and exits 0. ``--dry-run`` runs every code path
that does not need CUDA on small CPU tensors (tests/unit/test_gpu_bench.py does this).

Usage: python bench/gpu_bench.py [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from fp8track import Monitor, MonitorConfig
from fp8track.examples.gpt import GPT, GPTConfig
from fp8track.execution.apply import apply_fp8
from fp8track.execution.backends import te as te_backend
from fp8track.numerics import stats

FULL = {
    "stats_shapes": [(4096, 4096), (16384, 16384)],
    "stats_reps": 20,
    "gpt": GPTConfig(n_layer=12, n_head=16, n_embd=1024, block_size=1024),
    "batch": 8,
    "every": {"none": None, "every_100": 100, "every_10": 10, "every_1": 1},
    "rounds": 4,
    "steps_per_round": 50,
}
DRY = {
    "stats_shapes": [(64, 1024)],
    "stats_reps": 3,
    "gpt": GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16),
    "batch": 2,
    "every": {"none": None, "every_2": 2, "every_1": 1},
    "rounds": 2,
    "steps_per_round": 2,
}


class _Clock:
    """Wall time of a callable: CUDA events on a GPU (no host wait inside the timed region), else
    ``perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def stats_vs_amax(device: torch.device, shapes: list[tuple[int, int]], reps: int) -> dict[str, Any]:
    """Median ms of the statistics kernel and of one amax pass, interleaved, per shape."""
    clock = _Clock(device)
    out: dict[str, Any] = {}
    for shape in shapes:
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        cands: dict[str, Callable[[], object]] = {
            "amax_pass_ms": lambda x=x: x.abs().amax(),
            "partial_stats_ms": lambda x=x: stats.partial_stats(x, "e4m3"),
        }
        t = time.perf_counter()
        for fn in cands.values():
            fn()
        first_call_s = time.perf_counter() - t
        times: dict[str, list[float]] = {k: [] for k in cands}
        for _ in range(reps):
            for k, fn in cands.items():
                times[k].append(clock(fn))
        row = {k: round(statistics.median(v), 4) for k, v in times.items()}
        row["ratio"] = round(row["partial_stats_ms"] / row["amax_pass_ms"], 3)
        row["first_call_s"] = round(first_call_s, 2)
        out[f"{shape[0]}x{shape[1]}_bf16"] = row
    return out


def _backend(device: torch.device) -> tuple[str, str]:
    """(backend, recipe): TE current scaling where TE works, else torchao (dynamic = current)."""
    if device.type == "cuda" and te_backend.available():
        return "te", "current"
    return "torchao", "current"


def build_gpt(cfg: GPTConfig, batch: int, device: torch.device, seed: int = 0) -> tuple[Any, ...]:
    """The FP8 GPT, its optimizer, a few fixed batches and the apply report (autocast for TE)."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    backend, recipe = _backend(device)
    report = apply_fp8(model, recipe, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(seed)
    batches = [
        torch.randint(0, cfg.vocab, (batch, cfg.block_size + 1), generator=g).to(device) for _ in range(4)
    ]
    return model, opt, batches, report, backend


def _fwd_bwd(model: Any, report: Any, b: torch.Tensor) -> torch.Tensor:
    with report.autocast():
        loss = model.loss(b[:, :-1], b[:, 1:])
    loss.backward()
    return loss


@contextmanager
def _count_syncs(device: torch.device, counter: list[int], sites: list[str] | None = None):
    """Count host synchronisations in the block (CUDA's sync debug mode as warnings); ``sites``
    collects the Python line that triggered each one."""
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # CUDA's message: "called a synchronizing CUDA operation"; not the one-off "prototype feature" notice.
    hits = [w for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
    counter[0] += len(hits)
    if sites is not None:
        sites.extend(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in hits)


def sync_counts(
    model: Any, opt: Any, batches: list[torch.Tensor], report: Any, device: torch.device
) -> dict[str, Any]:
    """Host syncs per phase, with and without the monitor (CUDA only; ``None`` elsewhere)."""
    if device.type != "cuda":
        return {"checked": False, "reason": "needs CUDA's sync debug mode"}
    mon = Monitor(model, MonitorConfig(every_n_steps=2), log_dir=tempfile.mkdtemp()).attach()
    out: dict[str, Any] = {"checked": True}
    first, first_sites = [0], []
    for i in range(2):  # warm-up (sampled, unsampled): the first sampled step builds the capture plan
        with _count_syncs(device, first, first_sites):
            loss = _fwd_bwd(model, report, batches[i])
            opt.step()
            mon.step(loss=loss)
        opt.zero_grad(set_to_none=True)
    out["warmup_syncs"], out["warmup_sync_sites"] = first[0], sorted(set(first_sites))
    sites: list[str] = []
    phases = (("sampled", True), ("unsampled", False))
    for i, (name, monitored) in enumerate([*phases, ("unmonitored", None)]):
        if monitored is None:
            mon.detach()
        fb, st = [0], [0]
        b = batches[i % len(batches)]
        with _count_syncs(device, fb, sites):
            loss = _fwd_bwd(model, report, b)
        opt.step()
        with _count_syncs(device, st, sites if monitored is False else None):
            if monitored is not None:
                mon.step(loss=loss)
        opt.zero_grad(set_to_none=True)
        out[f"{name}_forward_backward"] = fb[0]
        out[f"{name}_monitor_step"] = st[0]
    mon.close()
    out["sync_sites"] = sorted(set(sites))
    out["hooks_add_no_sync"] = out["sampled_forward_backward"] == out["unmonitored_forward_backward"] == out[
        "unsampled_forward_backward"
    ]
    out["one_host_copy_per_logging_step"] = (
        out["sampled_monitor_step"] == 1 and out["unsampled_monitor_step"] == 0
    )
    return out


def monitor_overhead(device: torch.device, p: dict[str, Any]) -> dict[str, Any]:
    """Interleaved step times with no monitor and each sampling rate."""
    model, opt, batches, report, backend = build_gpt(p["gpt"], p["batch"], device)
    clock = _Clock(device)
    tmp = tempfile.mkdtemp()
    monitors = {
        k: Monitor(model, MonitorConfig(every_n_steps=n), log_dir=tmp) if n else None
        for k, n in p["every"].items()
    }
    times: dict[str, list[float]] = {k: [] for k in monitors}
    sampled: dict[str, list[float]] = {k: [] for k in monitors}

    def steps(
        mon: Monitor | None, n: int, sink: list[float], sampled_sink: list[float] | None = None
    ) -> None:
        for i in range(n):
            b = batches[i % len(batches)]
            hit = mon is not None and mon.sampling

            def one(b: torch.Tensor = b) -> None:
                loss = _fwd_bwd(model, report, b)
                opt.step()
                if mon is not None:
                    mon.step(loss=loss)
                opt.zero_grad(set_to_none=True)

            sink.append(clock(one))
            if hit and sampled_sink is not None:
                sampled_sink.append(sink[-1])

    for mon in monitors.values():  # warm-up: every path once, kernels compiled
        if mon is not None:
            mon.attach()
        steps(mon, 3, [])
        if mon is not None:
            mon.detach()
    names = list(monitors)
    for r in range(p["rounds"]):  # the order rotates each round: no configuration always runs first
        for k in names[r % len(names):] + names[: r % len(names)]:
            mon = monitors[k]
            if mon is not None:
                mon.attach()
            steps(mon, p["steps_per_round"], times[k], sampled[k])
            if mon is not None:
                mon.detach()
    for mon in monitors.values():
        if mon is not None:
            mon.close()
    base = statistics.fmean(times["none"])
    base_median = statistics.median(times["none"])
    out: dict[str, Any] = {"backend": backend, "model": vars(p["gpt"]), "batch": p["batch"]}
    for k, ts in times.items():
        out[k] = {
            "mean_ms": round(statistics.fmean(ts), 3),
            "median_ms": round(statistics.median(ts), 3),
            "mean_ratio": round(statistics.fmean(ts) / base, 4),
            "median_ratio": round(statistics.median(ts) / base_median, 4),
            "steps": len(ts),
        }
        if sampled[k]:  # a sampled step after a gap (every 10, 100) against one in a row (every 1)
            out[k]["sampled_step_median_ms"] = round(statistics.median(sampled[k]), 3)
            out[k]["sampled_steps"] = len(sampled[k])
    out["sync"] = sync_counts(model, opt, batches, report, device)
    return out


def te_debug_side_by_side(device: torch.device, p: dict[str, Any]) -> dict[str, Any]:
    """TE's own statistics (LogFp8TensorStats every step) on the same model, against fp8track."""
    if device.type != "cuda" or not te_backend.available():
        return {"skipped": "needs CUDA and Transformer Engine"}
    import transformer_engine
    from packaging.version import Version

    version = Version(transformer_engine.__version__.split("+")[0])
    if version < Version("2.7"):
        return {"skipped": f"Transformer Engine {version} < 2.7 (no mse/overflow stats)"}
    from pathlib import Path

    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger

    class Collect(BaseLogger):
        def __init__(self) -> None:
            super().__init__()
            self.values: dict[str, float] = {}

        def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
            self.values[name] = float(value)

    sink = Collect()
    config = {
        "fp8_stats": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "transformer_engine": {
                "LogFp8TensorStats": {
                    "enabled": True,
                    "tensors": ["activation", "gradient", "weight"],
                    "stats": ["underflows%", "scale_inv_min", "scale_inv_max", "mse"],
                    "freq": 1,
                }
            },
        }
    }
    cfg_path = Path(tempfile.mkdtemp()) / "te_debug.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(config))
    features = str(Path(transformer_engine.__file__).parent / "debug" / "features")
    # TE reads the debug state when its modules are built: initialise first (research/te_debug.md).
    debug_api.initialize(
        config_file=str(cfg_path), feature_dirs=[features], log_dir=tempfile.mkdtemp(),
        statistics_logger=sink, default_logging_enabled=False,
    )
    try:
        model, opt, batches, report, _ = build_gpt(p["gpt"], p["batch"], device)
        debug_api.infer_and_assign_layer_names(model)
        clock = _Clock(device)
        mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tempfile.mkdtemp()).attach()
        times: dict[str, list[float]] = {"te_debug_every_1": [], "fp8track_every_1": []}
        n = p["steps_per_round"]
        for _ in range(p["rounds"]):
            for k in times:
                if k == "fp8track_every_1":
                    mon.attach()
                for i in range(n):
                    b = batches[i % len(batches)]

                    def one(k: str = k, b: torch.Tensor = b) -> None:
                        loss = _fwd_bwd(model, report, b)
                        opt.step()
                        if k == "fp8track_every_1":
                            mon.step(loss=loss)
                        debug_api.step()
                        opt.zero_grad(set_to_none=True)

                    times[k].append(clock(one))
                if k == "fp8track_every_1":
                    mon.detach()
        mon.close()
        some = sorted(sink.values)[:8]
        return {
            "te_version": str(version),
            **{k: round(statistics.median(v), 3) for k, v in times.items()},
            "note": "te_debug_every_1 runs TE's stats every step with the fp8track monitor detached; "
            "fp8track_every_1 adds the monitor on top of the same (debug-enabled) model",
            "te_sample_values": {k: sink.values[k] for k in some},
        }
    finally:
        debug_api.end_debug()


def run(device: torch.device, dry_run: bool = False) -> dict[str, Any]:
    p = DRY if dry_run else FULL
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": dry_run,
    }
    errors: dict[str, str] = {}
    for name, fn in (
        ("stats_vs_amax", lambda: stats_vs_amax(device, p["stats_shapes"], p["stats_reps"])),
        ("monitor", lambda: monitor_overhead(device, p)),
        ("te_debug", lambda: te_debug_side_by_side(device, p)),
    ):
        try:
            out[name] = fn()
        except Exception as exc:  # report every section; the exit code says something failed
            errors[name] = repr(exc)
    out["kernel_row_lengths"] = sorted(c for d, c in stats._POLICY.kernels if d == device.type)
    if errors:
        out["errors"] = errors
    if device.type != "cuda":
        out["load_average_1min"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="small sizes on CPU: the code paths, no numbers"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    else:
        device = torch.device("cuda")
    result = run(device, dry_run=args.dry_run)
    print(json.dumps(result, indent=2))
    return 1 if "errors" in result else 0


if __name__ == "__main__":
    sys.exit(main())

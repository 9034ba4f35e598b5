"""Training overhead of the monitor (CPU): the sampling-cost report (default) and the older
step-time / peak-memory report (``--models``).

Sampling-cost report (JSON on stdout, and ``--out FILE``): for the example GPT and a Hugging Face
Llama built from a config (width 64; ``gpt256``, ``gpt512`` and ``llama512`` are wider), the
emulated FP8 run (current scaling) unsampled (every 1000) / every 10 / every step and the BF16
control (shadow statistics) every 10 / every step, each as a ratio over the same model and run
without the monitor, interleaved in rounds (the order rotating each round), with per-step medians
and spreads, and ``statistics_only``: the statistics kernel on that model's observed tensors of one
step, called back to back (:func:`kernel_only_ms`), as ms and as the step ratio it alone would give
(about the least every-step sampling can cost with the statistics unchanged); plus the host-time
proxy: microseconds of host time per sampled (layer, tensor) on 16x16 tensors. ``os.getloadavg()``
at start and end: the numbers mean something only on an idle machine. ``--compare-direct`` adds
every step with the compiled kernel called through ``torch.compile`` (on CPU it is called
directly: ``kernel_policy.DIRECT_DEVICES``), in the same rounds; ``--compare-grouping`` every step
with every phase's small tensors in one grouped pass, as before
``stats_batch.PER_TENSOR_BELOW`` sent a few of compiled size one by one. ``malloc_env``: the
``MALLOC_*_`` variables glibc started with (run it once as is and once with those of
tests/helpers/allocator.py exported to see what page faults of freed-and-trimmed heap cost a CPU
step).

Older report (``--models``):

Prints JSON. Configurations are measured side by side, interleaved in rounds (in an order that
rotates each round) so machine noise hits all of them alike: no monitor, sampling every 1000
steps (the cost of a step the monitor skips), every 10 steps, every step, and the last two with
the ahead-of-time kernels. Two models: the BF16 control
(shadow statistics on plain linears: the cheapest step, so the hardest ratio) and emulated FP8
with delayed scaling; ``--models`` adds the wider one.

``sampled_step_ms``: median time of the sampled steps alone, so a sampled step after nine
unsampled ones (every 10) can be compared with one in a row (every step).

Step time: per-step wall time of forward + backward + optimizer step + ``monitor.step``.
``mean`` includes the sampled steps (amortised cost); ``median`` is the typical step.
Peak memory: bytes allocated through malloc (glibc ``mallinfo2``, which torch's CPU allocator
uses) at the peaks of each step, maximum over 30 steps, in a fresh subprocess per configuration
(CPU has no counter like CUDA's ``max_memory_allocated``).

Usage: python bench/monitor_bench.py [--rounds 6] [--steps-per-round 20] [--out results.json]
       python bench/monitor_bench.py --models small/bf16,small/delayed  (the older report)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from fp8track import Monitor, MonitorConfig
from fp8track.examples.gpt import GPT, GPTConfig
from fp8track.numerics import stats

CONFIGS = {  # name: (every_n_steps or None for no monitor, statistics compile mode)
    "none": (None, "auto"),
    "every_1000": (1000, "auto"),
    "every_10": (10, "auto"),
    "every_1": (1, "auto"),
    "every_10_aot": (10, "aot"),
    "every_1_aot": (1, "aot"),
}


MODELS = {
    "small": (GPTConfig(), 16),  # the example's defaults: 2 blocks, width 64
    "wide": (GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=128), 8),
}


def build(recipe: str, model_name: str = "small", seed: int = 0):
    from fp8track.execution.apply import apply_fp8

    cfg, batch = MODELS[model_name]
    torch.manual_seed(seed)
    model = GPT(cfg)
    apply_fp8(model, recipe, backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    batches = [torch.randint(0, cfg.vocab, (batch, cfg.block_size + 1), generator=g) for _ in range(8)]
    return model, opt, batches


def train_steps(model, opt, batches, n, monitor, times, sampled=None, loss_fn=None):
    for i in range(n):
        b = batches[i % len(batches)]
        if sampled is not None:
            sampled.append(monitor is not None and monitor.config.samples(monitor.global_step))
        t0 = time.perf_counter()
        loss = (loss_fn or model.loss)(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        if monitor is not None:
            monitor.step(loss=loss)
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)


def step_times(recipe: str, model_name: str, rounds: int, per_round: int) -> dict:
    model, opt, batches = build(recipe, model_name)
    tmp = tempfile.mkdtemp()
    monitors = {
        name: Monitor(model, MonitorConfig(every_n_steps=n), log_dir=tmp) if n else None
        for name, (n, _) in CONFIGS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    sampled: dict[str, list[bool]] = {name: [] for name in CONFIGS}

    def run(name: str, n: int, sink: list[float], hits: list[bool] | None = None) -> None:
        mon = monitors[name]
        stats.set_compile(CONFIGS[name][1])
        if mon is not None:
            mon.attach()  # each monitor keeps its own step count: 2 sampled steps per round of 20
        train_steps(model, opt, batches, n, mon, sink, hits)
        if mon is not None:
            mon.detach()

    # Warm-up: every code path once (compilation of the statistics kernels included; the
    # ahead-of-time packages are waited for, then loaded).
    for name in monitors:
        run(name, 5, [])
    built = stats.wait_for_aot_kernels()
    for name in monitors:
        run(name, 2, [])
    names = list(monitors)
    for r in range(rounds):  # the order rotates each round: no configuration always runs first
        for name in names[r % len(names):] + names[: r % len(names)]:
            run(name, per_round, times[name], sampled[name])
    stats.set_compile("auto")
    for mon in monitors.values():
        if mon is not None:
            mon.close()
    base_mean, base_median = statistics.fmean(times["none"]), statistics.median(times["none"])
    out = {}
    for name, ts in times.items():
        out[name] = {
            "mean_ms": 1e3 * statistics.fmean(ts),
            "median_ms": 1e3 * statistics.median(ts),
            "mean_ratio": statistics.fmean(ts) / base_mean,
            "median_ratio": statistics.median(ts) / base_median,
            "steps": len(ts),
        }
        hits = [t for t, hit in zip(ts, sampled[name], strict=True) if hit]
        if hits:
            out[name]["sampled_step_ms"] = 1e3 * statistics.median(hits)
            out[name]["sampled_steps"] = len(hits)
    out["aot_kernels_loaded"] = built  # builds waited for (empty when the disk cache had them)
    out["aot_runners_used"] = sorted(
        f"{d}:{str(t).removeprefix('torch.')}:c{c}:{'notail' if nt else 'tail'}"
        for (d, t, c, nt), r in stats._POLICY.aot_runners.items()
        if r is not None
    )
    return out


def steps_after_a_sampled_step(recipe: str, model_name: str, cycles: int = 30) -> dict:
    """Median step time at each position of a 10-step cycle (position 0 sampled), against no monitor.

    Cycles of 10 monitored steps (``every_n_steps=10``) alternate with 10 unmonitored ones; shows
    whether the steps right after a sampled one cost more than the rest of the cycle.
    """
    model, opt, batches = build(recipe, model_name)
    mon = Monitor(model, MonitorConfig(every_n_steps=10), log_dir=tempfile.mkdtemp())
    base: list[float] = []
    at: dict[int, list[float]] = {k: [] for k in range(10)}
    mon.attach()
    train_steps(model, opt, batches, 20, mon, [])  # warm-up, kernels compiled
    mon.detach()
    for _ in range(cycles):
        mon.attach()
        for _ in range(10):
            k = mon.global_step % 10
            train_steps(model, opt, batches, 1, mon, at[k])
        mon.detach()
        train_steps(model, opt, batches, 10, None, base)
    out = {"none_ms": 1e3 * statistics.median(base)}
    out.update({f"position_{k}_ms": 1e3 * statistics.median(v) for k, v in at.items()})
    cycle = sorted(t for v in at.values() for t in v)
    out["cycle_median_ratio"] = statistics.median(cycle) / statistics.median(base)
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _allocated_bytes() -> int:
    """Bytes currently allocated through glibc malloc (torch's CPU allocator uses it)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _memory_child(recipe: str, model_name: str, every: int, steps: int, mode: str = "auto") -> None:
    # CPU has no max_memory_allocated; glibc's mallinfo2 gives the bytes allocated now. Sample it
    # where a training step peaks (after the last layer's forward: every activation is alive, and
    # after backward: every gradient is alive) and keep the maximum.
    if every < 0:  # the baseline with inductor's machinery loaded, as the compiled monitor has it
        import torch._inductor.compile_fx  # noqa: F401

        every = 0
    stats.set_compile(mode)  # "aot": the packages built by step_times load from the disk cache
    model, opt, batches = build(recipe, model_name)
    peak = [0]

    def sample(*_: object) -> None:
        peak[0] = max(peak[0], _allocated_bytes())

    model.lm_head.register_forward_hook(sample)
    mon = (
        Monitor(model, MonitorConfig(every_n_steps=every), log_dir=tempfile.mkdtemp()).attach()
        if every
        else None
    )
    for i in range(steps):
        b = batches[i % len(batches)]
        loss = model.loss(b[:, :-1], b[:, 1:])
        loss.backward()
        sample()
        opt.step()
        if mon is not None:
            mon.step(loss=loss)
        opt.zero_grad(set_to_none=True)
    print(json.dumps({"peak_allocated_bytes": peak[0]}))


def peak_memory(recipe: str, model_name: str, steps: int) -> dict:
    out = {}
    for name, (every, mode) in {"none_inductor_loaded": (-1, "auto"), **CONFIGS}.items():
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-child",
                recipe,
                model_name,
                str(every or 0),
                str(steps),
                mode,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    for v in out.values():
        v["ratio"] = v["peak_allocated_bytes"] / out["none"]["peak_allocated_bytes"]
        v["ratio_vs_inductor_loaded"] = (
            v["peak_allocated_bytes"] / out["none_inductor_loaded"]["peak_allocated_bytes"]
        )
    return out


# --- the sampling-cost report: every-step sampling, the BF16 control, host time per tensor ----------

SAMPLING_RUNS = {  # run: (FP8 recipe or None for the BF16 control, the configurations measured)
    "fp8_current": ("current", ("none", "every_1000", "every_10", "every_1")),
    "bf16_control": (None, ("none", "every_10", "every_1")),
}
TORCH_COMPILE_CONFIG = "every_1_torch_compile"
"""Every step with the CPU's compiled kernel called through ``torch.compile`` (Dynamo's wrappers)
instead of directly (``--compare-direct``): the direct call's gain, measured in the same rounds."""
ALWAYS_GROUPED_CONFIG = "every_1_always_grouped"
"""Every step with :data:`fp8track.monitoring.stats_batch.PER_TENSOR_BELOW` emptied (every phase's
small tensors in one grouped pass, the path before it), measured in the same rounds
(``--compare-grouping``)."""
SAMPLING_EVERY = {
    "none": None, "every_1000": 1000, "every_10": 10, "every_1": 1,
    TORCH_COMPILE_CONFIG: 1, ALWAYS_GROUPED_CONFIG: 1,
}


def _hf_llama(width: int = 64, intermediate: int = 128, tokens: tuple[int, int] = (8, 64)):
    """A Hugging Face Llama from a config (random weights, no download): 2 layers, heads of 16-64."""
    import transformers

    heads = max(4, width // 64)
    cfg = transformers.LlamaConfig(
        hidden_size=width, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=256, max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(cfg)

    def loss(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, loss, tokens


def _example_gpt(n_embd: int = 64):
    model = GPT(GPTConfig(n_embd=n_embd, n_head=max(4, n_embd // 64)))  # heads of 16-64
    return model, model.loss, (16, model.config.block_size)


SAMPLING_MODELS = {
    "gpt": _example_gpt,
    "llama": _hf_llama,
    # The example GPT 4x and 8x wider: the statistics pass costs a fixed amount per element of a
    # tensor, a GEMM per element about its inner width, so the ratio falls as the width grows.
    "gpt256": lambda: _example_gpt(256),
    "gpt512": lambda: _example_gpt(512),
    # Llama's SwiGLU width rule (8/3 of the width, rounded up to a multiple of 256), as many tokens
    # as the GPT's.
    "llama512": lambda: _hf_llama(512, 1536, (16, 64)),
}


def _spread(ts: list[float]) -> dict:
    """Median, interquartile range and median absolute deviation (ms; spreads also in % of the median)."""
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
    med = statistics.median(ts)
    mad = statistics.median([abs(t - med) for t in ts])
    return {
        "median_ms": 1e3 * med, "iqr_ms": 1e3 * (q[2] - q[0]), "mad_pct": 100 * mad / med,
        "mean_ms": 1e3 * statistics.fmean(ts), "steps": len(ts),
    }


def _observed_tensors(
    model, loss_fn, batch: torch.Tensor, monitor: Monitor
) -> list[tuple[str, object, torch.Tensor]]:
    """Copies of what ``monitor`` computes statistics of in one training step, as ``(tensor kind,
    layer plan, tensor)``: each monitored layer's activation, weight and output gradient, collected
    by hooks of this benchmark's own (the monitor is not attached). An input several layers read
    (q, k and v projections) is taken once, as the monitor computes it once under current scaling."""
    from fp8track.execution.layers import gemm_weight
    from fp8track.monitoring.plans import fp8_format
    from fp8track.monitoring.stats_batch import same_tensor_key

    seen: list[tuple[str, object, torch.Tensor]] = []
    inputs: dict[object, torch.Tensor] = {}  # holds each input, so no other can take its address
    handles = []
    for cap in monitor.captures.values():
        def hook(module, args, output, cap=cap):
            x = args[0]
            key = same_tensor_key(x, fp8_format(cap.plan, "activation"), cap.plan.margin)
            if key is None or key not in inputs:
                inputs[key] = x
                seen.append(("activation", cap, x.detach().clone()))
            seen.append(("weight", cap, gemm_weight(module).detach().clone()))
            output.register_hook(lambda g, cap=cap: seen.append(("gradient", cap, g.detach().clone())))
        handles.append(cap.module.register_forward_hook(hook))
    loss_fn(batch[:, :-1], batch[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    return [(t, cap.plan, x) for t, cap, x in seen if t in cap.tensors]


def kernel_only_ms(model, loss_fn, batch: torch.Tensor, monitor: Monitor, repeats: int = 10) -> float:
    """The statistics of one sampled step with nothing around them: the per-tensor partials of the
    step's observed tensors (copies), computed back to back by the path a lone tensor takes
    (``plans.tensor_partial``: the compiled kernel, eager below its size), median over ``repeats``.
    Every monitored step pays at least about this (its tensors are hot in cache when the hooks
    see them, the copies here are not, so it is not a strict lower bound)."""
    from fp8track.monitoring.plans import tensor_partial

    observed = _observed_tensors(model, loss_fn, batch, monitor)

    def once() -> float:
        t0 = time.perf_counter()
        for tensor, plan, x in observed:
            tensor_partial(x, plan, tensor)
        return time.perf_counter() - t0

    once()  # compile what the monitored runs did not (tensors below the batch's size)
    return 1e3 * statistics.median(once() for _ in range(repeats))


def sampling_costs(
    model_name: str, run: str, rounds: int, per_round: int, compare_direct: bool = False,
    compare_grouping: bool = False,
) -> dict:
    """Step times of one (model, run) under each sampling configuration, interleaved in rounds
    (the order rotating each round), as ratios over the same model and run without the monitor:
    the median step ratio, the mean ratio over all steps, the spread of the per-round median ratios,
    and ``amortised_ratio`` (:func:`_amortised_ratio` over the unmonitored median step): the cost a
    long run pays per step, the one to read for every 10 steps, whose median step is an unsampled
    one; ``amortised_round_min``/``max``: the spread of the rounds' mean step time over the
    unmonitored round's mean (each round holds whole 10-step periods: ``per_round`` must be a
    multiple of 10; two sampled steps a round make these noisy); ``paired`` and
    ``paired_amortised``: the same two measures taken per round, over the same round's unmonitored
    median, then their median over rounds, with the gap between the even and the odd rounds
    (:func:`_paired`: the figures to compare across runs)."""
    if per_round % 10:
        raise ValueError(f"--steps-per-round must be a multiple of 10 (the every-10 period), got {per_round}")
    from fp8track.execution.apply import apply_fp8
    from fp8track.monitoring import stats_batch
    from fp8track.numerics import kernel_policy

    recipe, configs = SAMPLING_RUNS[run]
    if compare_direct:
        configs = (*configs, TORCH_COMPILE_CONFIG)
    if compare_grouping:
        configs = (*configs, ALWAYS_GROUPED_CONFIG)
    per_tensor_below = stats_batch.PER_TENSOR_BELOW
    direct_devices = kernel_policy.DIRECT_DEVICES
    torch.manual_seed(0)
    model, loss_fn, (batch, seq) = SAMPLING_MODELS[model_name]()
    if recipe is not None:
        apply_fp8(model, recipe, backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (batch, seq + 1), generator=g) for _ in range(8)]
    tmp = tempfile.mkdtemp()
    monitors = {c: None if (every := SAMPLING_EVERY[c]) is None else Monitor(
        model, MonitorConfig(every_n_steps=every), log_dir=tmp) for c in configs}
    times: dict[str, list[float]] = {c: [] for c in configs}
    round_medians: dict[str, list[float]] = {c: [] for c in configs}
    round_means: dict[str, list[float]] = {c: [] for c in configs}
    round_amortised_s: dict[str, list[float]] = {c: [] for c in configs}  # _amortised_ratio per round
    # Each step's place in its sampling period (global_step % every; 0 is the sampled step).
    positions: dict[str, list[int]] = {c: [] for c in configs}

    def go(c: str, n: int, sink: list[float]) -> None:
        mon = monitors[c]
        if mon is not None:
            mon.attach()
        kernel_policy.DIRECT_DEVICES = () if c == TORCH_COMPILE_CONFIG else direct_devices
        stats_batch.PER_TENSOR_BELOW = {} if c == ALWAYS_GROUPED_CONFIG else per_tensor_below
        try:
            train_steps(model, opt, batches, n, mon, sink, loss_fn=loss_fn)
        finally:
            kernel_policy.DIRECT_DEVICES = direct_devices
            stats_batch.PER_TENSOR_BELOW = per_tensor_below
        if mon is not None:
            mon.detach()

    for c in configs:  # warm-up: every path once (the statistics kernels compiled)
        go(c, 4, [])
    for r in range(rounds):
        for c in configs[r % len(configs):] + configs[: r % len(configs)]:
            n0 = len(times[c])
            every = SAMPLING_EVERY[c]
            if every is not None and every <= per_round:  # every 1000: no sampled step measured
                start = monitors[c].global_step
                positions[c].extend((start + i) % every for i in range(per_round))
            go(c, per_round, times[c])
            ts = times[c][n0:]
            round_medians[c].append(statistics.median(ts))
            round_means[c].append(statistics.fmean(ts))
            round_amortised_s[c].append(_amortised_ratio(ts, positions[c][n0:]))
    floor_ms = kernel_only_ms(model, loss_fn, batches[0], next(m for m in monitors.values() if m is not None))
    for mon in monitors.values():
        if mon is not None:
            mon.close()
    base, base_mean = statistics.median(times["none"]), statistics.fmean(times["none"])
    out: dict = {"statistics_only": {"ms": floor_ms, "ratio": 1 + floor_ms / (1e3 * base)}}
    for c in configs:
        ratios = [m / b for m, b in zip(round_medians[c], round_medians["none"], strict=True)]
        round_amortised = [m / b for m, b in zip(round_means[c], round_means["none"], strict=True)]
        out[c] = {
            **_spread(times[c]),
            "median_ratio": statistics.median(times[c]) / base,
            "mean_ratio": statistics.fmean(times[c]) / base_mean,
            "round_ratio_min": min(ratios), "round_ratio_max": max(ratios),
            "amortised_ratio": _amortised_ratio(times[c], positions[c]) / base,
            "amortised_round_min": min(round_amortised), "amortised_round_max": max(round_amortised),
            **_paired("paired", round_medians[c], round_medians["none"]),
            **_paired("paired_amortised", round_amortised_s[c], round_medians["none"]),
        }
    return out


def _paired(name: str, rounds: list[float], base_rounds: list[float]) -> dict:
    """Each round's step time over the same round's unmonitored median (the two measured seconds
    apart, so a load or clock change between rounds cancels), summarised over rounds: ``name``, the
    median of the rounds' ratios; ``name_halves_pct``, how far the medians of the even and of the
    odd rounds lie apart, in % of ``name`` (the run's own estimate of how well a second run agrees;
    ``None`` under two rounds)."""
    ratios = [t / b for t, b in zip(rounds, base_rounds, strict=True)]
    med = statistics.median(ratios)
    halves = None
    if len(ratios) >= 2:
        halves = 100 * abs(statistics.median(ratios[0::2]) - statistics.median(ratios[1::2])) / med
    return {name: med, f"{name}_halves_pct": halves}


def _amortised_ratio(times: list[float], positions: list[int]) -> float:
    """The step time a long run pays on average (s): the mean over the positions of a sampling
    period of the median step time at that position. Robust to outliers as a median is, yet it
    counts the sampled step and any dearer step after it (a plain median of every-10 steps is
    an unsampled step's time). No positions (no monitor, or a period longer than a round): the
    median step."""
    if not positions:
        return statistics.median(times)
    at: dict[int, list[float]] = {}
    for t, k in zip(times, positions, strict=True):
        at.setdefault(k, []).append(t)
    return statistics.fmean(statistics.median(v) for v in at.values())


def _batched_and_per_tensor(model) -> dict:
    """No monitor, a monitor with its batch (``batched``) and one without (``per_tensor``: each
    observation computed at once, the path before grouping), every step sampled."""
    mons = {"none": None, **{
        name: Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tempfile.mkdtemp())
        for name in ("batched", "per_tensor")
    }}
    for cap in mons["per_tensor"].captures.values():
        cap.batch = None
    return mons


def _interleaved_cpu(model, mons: dict, forward_backward, rounds: int, steps: int) -> tuple[dict, dict]:
    """CPU time of this thread per step under each of ``mons``, in ``forward_backward()`` (the
    capture: hooks and statistics) and in ``monitor.step`` (the flush), interleaved in rounds
    (the order rotating each round; round 0 a warm-up); closes the monitors."""
    capture: dict[str, list[float]] = {k: [] for k in mons}
    flush: dict[str, list[float]] = {k: [] for k in mons}
    names = list(mons)
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[: r % len(names)]:
            mon = mons[name]
            if mon is not None:
                mon.attach()
            for _ in range(steps):
                c0 = time.thread_time()
                loss = forward_backward()
                c1 = time.thread_time()
                if mon is not None:
                    mon.step(loss=loss)
                c2 = time.thread_time()
                model.zero_grad(set_to_none=True)
                if r:
                    capture[name].append(c1 - c0)
                    flush[name].append(c2 - c1)
            if mon is not None:
                mon.detach()
    for mon in mons.values():
        if mon is not None:
            mon.close()
    return capture, flush


def host_us_per_tensor(layers: int = 32, steps: int = 30, rounds: int = 3) -> dict:
    """Host time per sampled (layer, tensor) on tiny tensors (host work dominates): a stack of
    ``layers`` ``nn.Linear(16, 16)`` on 16 tokens (activation, weight and gradient all 16x16),
    one thread; the BF16 control (shadow statistics, current scaling) and emulated FP8 with
    current scaling. Per (layer, tensor): the capture, ``(forward + backward monitored every step
    - unmonitored) / (layers * 3)``, and the flush, ``monitor.step / (layers * 3)``, in CPU time of
    this thread (``time.thread_time``: waiting for a loaded machine's cores does not count);
    medians over steps. Three configurations interleaved (rotating order): unmonitored, the
    grouped pass per hook phase (``batched``) and each tensor on its own (``per_tensor``: the
    monitor's batch switched off, the path before grouping), so the two compare under one load."""
    from fp8track.execution.apply import apply_fp8

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict = {}
    med = statistics.median
    for run, recipe in (("bf16_control", None), ("fp8_current", "current")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
        if recipe is not None:
            apply_fp8(model, recipe, backend="emulated")
        x = torch.randn(16, 16)

        def forward_backward(model=model, x=x) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            return loss

        mons = _batched_and_per_tensor(model)
        capture, flush = _interleaved_cpu(model, mons, forward_backward, rounds, steps)
        n = layers * 3
        out[run] = {"layers": layers, "tensors_per_layer": 3,
                    "step_cpu_ms_unmonitored": 1e3 * med(capture["none"])}
        for name in ("batched", "per_tensor"):
            cap_us = 1e6 * (med(capture[name]) - med(capture["none"])) / n
            out[run][name] = {
                "host_us_per_tensor_capture": cap_us,  # hooks + statistics
                "host_us_per_tensor_flush": 1e6 * med(flush[name]) / n,  # monitor.step: rows, analyzers
                "host_us_per_tensor_total": cap_us + 1e6 * med(flush[name]) / n,
            }
        key = "host_us_per_tensor_capture"
        out[run]["capture_speedup"] = out[run]["per_tensor"][key] / out[run]["batched"][key]
    torch.set_num_threads(threads)
    return out


def host_us_micro_batches(
    layers: int = 16, width: int = 128, tokens: int = 128, micro_batches: int = 4, steps: int = 8,
    rounds: int = 4,
) -> dict:
    """Host time per observation of the per-tensor path under gradient accumulation: a stack of
    ``layers`` ``nn.Linear(width, width)`` on ``tokens`` tokens (every activation and dY of at least
    :data:`fp8track.monitoring.stats_batch.DIRECT_NUMEL` elements, so none is grouped), BF16
    control, ``micro_batches`` forwards and backwards per step, one thread, CPU time of this thread.
    ``batched``: the monitor's batch (each partial computed once, later micro-batches merged in one
    stacked merge per phase); ``per_tensor``: each observation computed at once, the kernel merging
    it into the accumulator in the same call. Per observation: ``(monitored - unmonitored) /
    (layers * 2 * micro_batches)`` (activation and dY; the weight is observed once per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(tokens, width)

    def forward_backward() -> None:
        for _ in range(micro_batches):
            model(x).square().mean().backward()

    capture, _ = _interleaved_cpu(model, _batched_and_per_tensor(model), forward_backward, rounds, steps)
    torch.set_num_threads(threads)
    base = statistics.median(capture["none"])
    n = layers * 2 * micro_batches
    out: dict = {"layers": layers, "width": width, "tokens": tokens, "micro_batches": micro_batches}
    for name in ("batched", "per_tensor"):
        out[name] = {"host_us_per_observation": 1e6 * (statistics.median(capture[name]) - base) / n}
    return out


def sampling_report(args: argparse.Namespace) -> dict:
    result: dict = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg_at_start": [round(v, 2) for v in os.getloadavg()],
        # glibc's heap settings (tests/helpers/allocator.py): they decide whether each step's large
        # temporaries fault their pages in again, which the CUDA caching allocator never does.
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "rounds": args.rounds, "steps_per_round": args.steps_per_round,
        "host_proxy": host_us_per_tensor(rounds=max(1, args.rounds // 2)),
        "host_micro_batches": host_us_micro_batches(rounds=max(1, args.rounds // 2)),
    }
    for model_name in args.sampling_models.split(","):
        for run in SAMPLING_RUNS:
            result[f"{model_name}/{run}"] = sampling_costs(
                model_name, run, args.rounds, args.steps_per_round, args.compare_direct,
                args.compare_grouping,
            )
    result["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument(
        "--models", default=None,
        help="the older report (step time and peak memory per compile mode), e.g. small/bf16,small/delayed",
    )
    parser.add_argument(
        "--sampling-models", default="gpt,llama",
        help=f"models of the sampling-cost report, comma-separated, from {', '.join(SAMPLING_MODELS)}",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument(
        "--compare-direct", action="store_true",
        help=f"also every step through torch.compile's wrappers ({TORCH_COMPILE_CONFIG})",
    )
    parser.add_argument(
        "--compare-grouping", action="store_true",
        help=f"also every step with every phase's small tensors grouped ({ALWAYS_GROUPED_CONFIG})",
    )
    parser.add_argument("--no-memory", action="store_true", help="step times only")
    parser.add_argument(
        "--positions", action="store_true", help="also: step time at each position after a sampled step"
    )
    parser.add_argument("--memory-child", nargs=5)
    args = parser.parse_args()
    unknown = [m for m in args.sampling_models.split(",") if m not in SAMPLING_MODELS]
    if unknown:
        parser.error(f"--sampling-models: unknown {unknown}; valid: {', '.join(SAMPLING_MODELS)}")
    if args.memory_child:
        recipe, model_name, every, steps, mode = args.memory_child
        _memory_child(recipe, model_name, int(every), int(steps), mode)
        return
    result = sampling_report(args) if args.models is None else legacy_report(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def legacy_report(args: argparse.Namespace) -> dict:
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "models": {k: {"config": vars(c), "batch": b} for k, (c, b) in MODELS.items()},
    }
    for key in args.models.split(","):
        model_name, recipe = key.split("/")
        result[key] = {
            "step_time": step_times(recipe, model_name, args.rounds, args.steps_per_round),
            "peak_memory": None if args.no_memory else peak_memory(recipe, model_name, 30),
        }
        if args.positions:
            result[key]["steps_after_a_sampled_step"] = steps_after_a_sampled_step(recipe, model_name)
    result["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    return result


if __name__ == "__main__":
    main()

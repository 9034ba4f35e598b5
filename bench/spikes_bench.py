"""Spike/divergence detector benchmark: false-positive rate on healthy streams, recall on planted
spikes and divergences, and throughput. Prints one JSON object.

    python bench/spikes_bench.py [--streams 200] [--steps 5000] [--seed 0]

Healthy streams: power-law decaying loss (start 8-11, floor 2-3.5, tau 50-500, alpha 0.3-1) with
multiplicative noise of 0.5-3% per step, for each noise kind of fp8track.analysis.synthetic_loss
(gaussian, heavy-tailed Student-t df=3, AR(1) phi=0.7). Every event on a healthy stream is a false
positive.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fp8track.analysis import synthetic_loss as sl
from fp8track.analysis.divergence import DivergenceDetector
from fp8track.analysis.spikes import SpikeConfig, SpikeDetector


def run_spikes(x: np.ndarray, config: SpikeConfig | None = None) -> list:
    det = SpikeDetector(config)
    for s, v in enumerate(x.tolist()):
        det.update(s, v)
    det.finalize()
    return det.events


def run_divergence(x: np.ndarray) -> list:
    det = DivergenceDetector()
    for s, v in enumerate(x.tolist()):
        det.update(s, v)
    return det.events


# Alternatives measured on the same streams as the defaults, to show what each default buys.
ALTERNATIVES = {
    "instant_rel=0.5": SpikeConfig(instant_rel=0.5),
    "confirm_steps=1": SpikeConfig(confirm_steps=1),
    "z_threshold=4": SpikeConfig(z_threshold=4.0),
}


def false_positives(streams: int, steps: int, rng: np.random.Generator) -> dict:
    out = {}
    for kind in sl.NOISE_KINDS:
        spikes = div = 0
        alt = dict.fromkeys(ALTERNATIVES, 0)
        for _ in range(streams):
            x = sl.healthy(sl.random_curve(rng, kind), steps, rng)
            spikes += sum(1 for e in run_spikes(x) if e.kind == "spike")
            div += len(run_divergence(x))
            for name, cfg in ALTERNATIVES.items():
                alt[name] += sum(1 for e in run_spikes(x, cfg) if e.kind == "spike")
        total = streams * steps
        out[kind] = {
            "streams": streams,
            "steps": total,
            "spike_events": spikes,
            "spikes_per_10k_steps": 1e4 * spikes / total,
            "divergence_events": div,
            "divergences_per_10k_steps": 1e4 * div / total,
            "alternatives_spikes_per_10k_steps": {k: 1e4 * v / total for k, v in alt.items()},
        }
    return out


def planted_spikes(n: int, steps: int, rng: np.random.Generator, lo: int = 1000, hi: int | None = None) -> dict:
    """One spike per stream at a random step in [lo, hi) (default [1000, steps - 1000)), height
    10-100%, rise 1-5 steps, decay 2-100 steps; found = an event starting within [-2, rise + 3] of
    the plant. ``lo=70, hi=300`` plants them while the loss is still falling fast."""
    by_height: dict[str, list[int]] = {"0.10-0.25": [], "0.25-0.50": [], "0.50-1.00": []}
    start_err, peak_err = [], []
    extra = 0
    for i in range(n):
        kind = sl.NOISE_KINDS[i % len(sl.NOISE_KINDS)]
        x = sl.healthy(sl.random_curve(rng, kind), steps, rng)
        start = int(rng.integers(lo, steps - 1000 if hi is None else hi))
        height = float(rng.uniform(0.10, 1.0))
        rise = int(rng.integers(1, 6))
        x = sl.plant_spike(x, start, height, rise=rise, decay=float(rng.uniform(2, 100)))
        events = [e for e in run_spikes(x) if e.kind == "spike"]
        hits = [e for e in events if start - 2 <= e.start_step <= start + rise + 3]
        bucket = "0.10-0.25" if height < 0.25 else "0.25-0.50" if height < 0.5 else "0.50-1.00"
        by_height[bucket].append(1 if hits else 0)
        extra += len(events) - min(len(hits), 1)
        if hits:
            start_err.append(hits[0].start_step - start)
            peak_err.append(hits[0].peak_step - (start + rise - 1))
    return {
        "streams": n,
        "recall_by_height": {k: (sum(v) / len(v) if v else None) for k, v in by_height.items()},
        "recall": sum(sum(v) for v in by_height.values()) / n,
        "median_abs_start_error_steps": float(np.median(np.abs(start_err))) if start_err else None,
        "median_abs_peak_error_steps": float(np.median(np.abs(peak_err))) if peak_err else None,
        "other_events": extra,
    }


def planted_divergences(n: int, steps: int, rng: np.random.Generator) -> dict:
    """Half start-of-training (rise from step 0..200), half mid-training (from step 1500..3500);
    rate 0.0005-0.003 per step (the loss grows 1.6x-20x over 1000 steps)."""
    found, phase_ok, start_err, delay = 0, 0, [], []
    for i in range(n):
        kind = sl.NOISE_KINDS[i % len(sl.NOISE_KINDS)]
        x = sl.healthy(sl.random_curve(rng, kind), steps, rng)
        early = i % 2 == 0
        start = int(rng.integers(0, 200)) if early else int(rng.integers(1500, 3500))
        x = sl.plant_divergence(x, start, float(rng.uniform(0.0005, 0.003)))
        events = run_divergence(x)
        if events:
            e = events[0]
            found += 1
            phase_ok += e.phase == ("start" if early else "mid")
            start_err.append(e.start_step - start)
            delay.append(e.detect_step - start)
    return {
        "streams": n,
        "recall": found / n,
        "phase_accuracy": phase_ok / max(found, 1),
        "median_abs_start_error_steps": float(np.median(np.abs(start_err))) if start_err else None,
        "median_detection_delay_steps": float(np.median(delay)) if delay else None,
    }


def throughput(steps: int, rng: np.random.Generator) -> dict:
    x = sl.healthy(sl.Curve(noise="student_t"), steps, rng).tolist()
    out = {}
    for name, make in (("spike_detector", SpikeDetector), ("divergence_detector", DivergenceDetector)):
        det = make()
        t = time.perf_counter()
        for s, v in enumerate(x):
            det.update(s, v)
        dt = time.perf_counter() - t
        out[name] = {"steps_per_s": steps / dt, "us_per_step": 1e6 * dt / steps}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=200, help="healthy streams per noise kind")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--planted", type=int, default=150, help="streams with a planted spike / divergence")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    t = time.perf_counter()
    result = {
        "config": {
            "streams_per_noise_kind": a.streams,
            "steps": a.steps,
            "planted": a.planted,
            "seed": a.seed,
        },
        "false_positives": false_positives(a.streams, a.steps, rng),
        "planted_spikes": planted_spikes(a.planted, a.steps, rng),
        "planted_spikes_falling_loss": planted_spikes(a.planted, a.steps, rng, lo=70, hi=300),
        "planted_divergences": planted_divergences(a.planted, a.steps, rng),
        "throughput": throughput(100_000, rng),
    }
    result["wall_s"] = time.perf_counter() - t
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Synthetic loss curves for testing and benchmarking the spike and divergence detectors.

A healthy curve decays as a power law towards a floor, with multiplicative per-step noise:
``L(t) = floor + (start - floor) * (1 + t / tau) ** -alpha`` times ``1 + sigma * eps_t``, where
``eps_t`` is standard normal (``"gaussian"``), Student-t with 3 degrees of freedom scaled to unit
variance (``"student_t"``, heavy tails), or an AR(1) process with coefficient 0.7 and unit
variance (``"ar1"``, correlated noise as data ordering gives). Planted events are added on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp8track.errors import invalid_choice

NOISE_KINDS = ("gaussian", "student_t", "ar1")


@dataclass(frozen=True)
class Curve:
    """Parameters of a healthy decaying loss curve (see the module docstring)."""

    start: float = 10.0
    floor: float = 2.5
    tau: float = 200.0
    alpha: float = 0.6
    sigma: float = 0.02
    noise: str = "gaussian"

    def __post_init__(self) -> None:
        if self.noise not in NOISE_KINDS:
            raise invalid_choice("noise kind", self.noise, NOISE_KINDS)


def noise(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Unit-variance noise of ``kind`` (:data:`NOISE_KINDS`), ``n`` samples."""
    if kind == "gaussian":
        return rng.standard_normal(n)
    if kind == "student_t":
        return rng.standard_t(3, n) / np.sqrt(3.0)  # t3 has variance 3
    if kind == "ar1":
        phi = 0.7
        e = rng.standard_normal(n) * np.sqrt(1 - phi**2)
        out = np.empty(n)
        prev = rng.standard_normal()
        for i in range(n):
            prev = phi * prev + e[i]
            out[i] = prev
        return out
    raise invalid_choice("noise kind", kind, NOISE_KINDS)


def trend(curve: Curve, n: int) -> np.ndarray:
    """The noiseless curve at steps ``0 .. n-1``."""
    t = np.arange(n, dtype=np.float64)
    return curve.floor + (curve.start - curve.floor) * (1.0 + t / curve.tau) ** (-curve.alpha)


def healthy(curve: Curve, n: int, rng: np.random.Generator) -> np.ndarray:
    """A healthy noisy loss curve of ``n`` steps."""
    return trend(curve, n) * (1.0 + curve.sigma * noise(curve.noise, n, rng))


def random_curve(rng: np.random.Generator, noise_kind: str) -> Curve:
    """A random healthy curve: start 8-11, floor 2-3.5, tau 50-500, alpha 0.3-1, sigma 0.5-3%."""
    return Curve(
        start=float(rng.uniform(8, 11)),
        floor=float(rng.uniform(2, 3.5)),
        tau=float(rng.uniform(50, 500)),
        alpha=float(rng.uniform(0.3, 1.0)),
        sigma=float(rng.uniform(0.005, 0.03)),
        noise=noise_kind,
    )


def plant_spike(loss: np.ndarray, start: int, height: float, rise: int = 1, decay: float = 5.0) -> np.ndarray:
    """Add a spike: the loss is multiplied by ``1 + height * shape`` where ``shape`` rises linearly
    over ``rise`` steps to 1 at ``start + rise - 1`` and then decays as ``exp(-k / decay)``."""
    out = loss.copy()
    n = len(loss)
    k = np.arange(n - start, dtype=np.float64)
    shape = np.where(k < rise, (k + 1) / rise, np.exp(-(k - rise + 1) / decay))
    out[start:] *= 1.0 + height * shape
    return out


def plant_divergence(loss: np.ndarray, start: int, rate: float) -> np.ndarray:
    """From ``start`` on, the loss grows by a factor ``exp(rate * (t - start))`` (a runaway rise)."""
    out = loss.copy()
    t = np.arange(len(loss) - start, dtype=np.float64)
    out[start:] *= np.exp(rate * t)
    return out

"""Rolling robust statistics: the one median/MAD window that spike, divergence and baseline
analysis share (a median and MAD ignore the outliers a mean and standard deviation would chase)."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): makes MAD a consistent estimator of a normal's sigma


class RobustWindow:
    """Rolling median and ``1.4826 * MAD`` of the last ``size`` finite values.

    Values are kept in arrival order and in a sorted list (``bisect``), so the median costs O(1)
    and an append O(size) memory moves; the MAD (one numpy pass) is computed only when asked for
    and cached until the next append.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: deque[float] = deque()
        self._sorted: list[float] = []
        self._sigma: float | None = None

    def __len__(self) -> int:
        return len(self.values)

    def append(self, value: float) -> None:
        v = float(value)
        self.values.append(v)
        bisect.insort(self._sorted, v)
        if len(self.values) > self.size:
            old = self.values.popleft()
            _remove(self._sorted, old)
        self._sigma = None

    def clear(self) -> None:
        self.values.clear()
        self._sorted.clear()
        self._sigma = None

    def median(self) -> float:
        """Median of the window (NaN when empty)."""
        return sorted_median(self._sorted)

    def sigma(self) -> float:
        """``1.4826 * median(|x - median|)`` (NaN when empty)."""
        if self._sigma is None:
            if not self._sorted:
                return math.nan
            a = np.asarray(self._sorted, dtype=np.float64)
            self._sigma = MAD_TO_SIGMA * float(np.median(np.abs(a - self.median())))
        return self._sigma



def centred_median(values: np.ndarray, width: int) -> np.ndarray:
    """Running median over ``width`` points centred on each value (shrinking at the ends)."""
    n = len(values)
    if width <= 1 or n == 0:
        return values.astype(np.float64, copy=True)
    half = width // 2
    padded = np.pad(values.astype(np.float64), half, mode="constant", constant_values=np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    # In blocks, so a long run (every step's loss) never builds an n x width copy at once.
    block = max(1, (1 << 22) // width)
    out = np.empty(n, dtype=np.float64)
    # Only the ends hold padding: without NaNs in the values the middle takes the faster np.median.
    lo, hi = (half, n - half) if not np.isnan(values).any() else (n, n)
    for a, b, median in ((0, min(lo, n), np.nanmedian), (lo, hi, np.median), (max(hi, lo), n, np.nanmedian)):
        for i in range(a, b, block):
            out[i : min(i + block, b)] = median(windows[i : min(i + block, b)], axis=1)
    return out


class HalvesWindow:
    """The last ``size`` values split into an older and a newer half, with O(1) medians of each.

    The newer half holds ``n // 2`` values (``n`` = values held), the older half the rest; both
    are kept as sorted lists (``bisect``) next to the arrival order.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: deque[float] = deque()
        self._older: list[float] = []
        self._newer: list[float] = []

    def __len__(self) -> int:
        return len(self.values)

    def append(self, value: float) -> None:
        v = float(value)
        self.values.append(v)
        bisect.insort(self._newer, v)
        if len(self.values) > self.size:
            _remove(self._older, self.values.popleft())
        n = len(self.values)
        while len(self._newer) > n // 2:
            moving = self.values[n - len(self._newer)]  # oldest value of the newer half
            _remove(self._newer, moving)
            bisect.insort(self._older, moving)

    def medians(self) -> tuple[float, float]:
        """``(median of older half, median of newer half)``."""
        return sorted_median(self._older), sorted_median(self._newer)

    def quantiles(self, q: float) -> tuple[float, float]:
        """``(q-quantile of older half, q-quantile of newer half)`` (linear interpolation, as numpy)."""
        return sorted_quantile(self._older, q), sorted_quantile(self._newer, q)


class TrendWindow:
    """The last ``size`` ``(step, value)`` pairs with a robust local linear trend and the spread of
    the values around it (a falling loss's own trend is not noise).

    The trend is the line through the medians of the older and the newer half (each at the centre
    of its steps): ``trend(s) = m_new + slope * (s - c_new)``, ``slope = (m_new - m_old) / (c_new -
    c_old)``. Medians ignore spikes; the line removes the drift that made a plain median/MAD window
    count a falling loss's trend as noise. :meth:`sigma` is ``1.4826 * MAD`` of the residuals about
    the line (computed on demand, cached until the next append). With fewer than 4 values the trend
    is flat (the median).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._halves = HalvesWindow(size)
        self.steps: deque[int] = deque()
        self._line: tuple[float, float, float] | None = None  # (m_new, slope, c_new)
        self._sigma: float | None = None

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def values(self) -> deque[float]:
        return self._halves.values

    def append(self, step: int, value: float) -> None:
        self.steps.append(int(step))
        self._halves.append(value)
        if len(self.steps) > self.size:
            self.steps.popleft()
        self._line = self._sigma = None

    def clear(self) -> None:
        self._halves = HalvesWindow(self.size)
        self.steps.clear()
        self._line = self._sigma = None

    def _fit(self) -> tuple[float, float, float]:
        if self._line is None:
            n = len(self.steps)
            m_old, m_new = self._halves.medians()
            n_old = n - n // 2
            if n < 4:
                med = sorted_median(sorted(self.values))
                self._line = (med, 0.0, float(self.steps[-1]) if n else 0.0)
            else:
                c_old = 0.5 * (self.steps[0] + self.steps[n_old - 1])
                c_new = 0.5 * (self.steps[n_old] + self.steps[-1])
                slope = (m_new - m_old) / (c_new - c_old) if c_new > c_old else 0.0
                self._line = (m_new, slope, c_new)
        return self._line

    def trend(self, step: int) -> float:
        """The trend line's value at ``step`` (NaN when empty)."""
        if not self.steps:
            return math.nan
        m, slope, c = self._fit()
        return m + slope * (step - c)

    def sigma(self) -> float:
        """``1.4826 * median(|r - median(r)|)`` of the residuals ``r`` about the trend line (NaN when empty)."""
        if self._sigma is None:
            if not self.steps:
                return math.nan
            m, slope, c = self._fit()
            r = np.asarray(self.values, dtype=np.float64) - (m + slope * (np.asarray(self.steps, dtype=np.float64) - c))
            self._sigma = MAD_TO_SIGMA * float(np.median(np.abs(r - np.median(r))))
        return self._sigma


def sorted_quantile(s: list[float], q: float) -> float:
    """``q``-quantile of an ascending list, linear interpolation as numpy (NaN when empty)."""
    n = len(s)
    if n == 0:
        return math.nan
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _remove(sorted_list: list[float], value: float) -> None:
    del sorted_list[bisect.bisect_left(sorted_list, value)]


def sorted_median(s: list[float]) -> float:
    """Median of an ascending list (NaN when empty)."""
    n = len(s)
    if n == 0:
        return math.nan
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


W = TypeVar("W", RobustWindow, HalvesWindow)


def filled(window: W, values: Iterable[float]) -> W:
    """``window`` after appending ``values`` in order (restoring a window from a saved state)."""
    for v in values:
        window.append(v)
    return window


__all__ = [
    "MAD_TO_SIGMA",
    "RobustWindow",
    "HalvesWindow",
    "TrendWindow",
    "centred_median",
    "filled",
    "sorted_median",
    "sorted_quantile",
]

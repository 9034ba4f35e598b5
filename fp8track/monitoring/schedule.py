"""When the monitor samples: a fixed schedule as Transformer Engine's debug API has it, plus bursts.

Fixed schedule (TE debug API's feature fields, ``transformer_engine/debug/features/utils/__init__.py``
``next_enabled_iter``: a step runs when ``step % freq == 0`` and ``start_step <= step <= end_step``,
``end_step`` inclusive, ``start_end_list`` replacing start/end): ``every_n_steps`` is TE's ``freq``;
``steps`` are sampled whatever the rest says.

Burst: when an analysis event opens (loss spike, non-finite loss or gradient, divergence onset, a
drift excursion on a sampled step) the monitor samples every step of the next ``burst_steps``
steps, all layers or the ones the event names, then returns to its schedule. A burst opened while
one runs extends it. Why each step was sampled is recorded (:meth:`Burst.reason`).

Budget: events that recur (a spike every few steps) would keep extending a burst, so sampling
"every 10 steps" became "every step". Bursts may sample at most ``burst_budget`` of the steps of
any ``burst_window`` consecutive steps (default 25 of every 100; never less than one burst of
``burst_steps``): an event past the budget opens a shorter burst or none, recorded as a
``burst_skipped`` event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fp8track.errors import ConfigError, as_names, check_float, check_int, invalid_choice
from fp8track.monitoring.records import EventRecord

BURST_TRIGGERS = ("spike", "nonfinite", "divergence", "drift")
"""Event kinds that may open a burst (their analyzers' ``EventRecord.kind``)."""
DEFAULT_BURST_TRIGGERS = ("spike", "nonfinite", "divergence")
"""The default: loss events. ``drift`` is opt-in: on the example GPT under delayed scaling, drift
excursions opened 13 bursts in 240 healthy steps (74 burst steps, median step 1.12x),
bench/results_burst.json."""
BURST_LAYERS = ("implicated", "all")
DEFAULT_BURST_BUDGET = 0.25
"""Share of any ``burst_window`` consecutive steps that bursts may sample: with the default
window of 100 and ``burst_steps=8``, three bursts' worth, so sampling every 10 steps costs at most
a third of the steps in a stretch of recurring events (a burst step costs 1.3x an unsampled one
on the example GPT, bench/results_burst.json)."""
DEFAULT_BURST_WINDOW = 100


def normalise_windows(windows: Iterable[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """``[[start, end], ...]`` (inclusive, as TE) validated and as tuples.

    Raises:
        ConfigError: a window that is not two integers ``0 <= start <= end``.
    """
    out = []
    for w in windows:
        pair = tuple(w)
        if len(pair) != 2:
            raise ConfigError(f"start_end_list entries must be [start, end] pairs, got {list(pair)!r}")
        for v in pair:
            check_int("start_end_list bound", v, 0)
        if pair[0] > pair[1]:
            raise ConfigError(f"start_end_list window {list(pair)!r} starts after it ends")
        out.append((int(pair[0]), int(pair[1])))
    return tuple(out)


def scheduled(
    step: int,
    every_n_steps: int,
    steps: Sequence[int] = (),
    start_step: int = 0,
    end_step: int | None = None,
    start_end_list: Sequence[tuple[int, int]] = (),
) -> bool:
    """Whether the fixed schedule samples ``step`` (see the module docstring).

    Example:
        >>> [s for s in range(30) if scheduled(s, 5, (7,), start_end_list=((10, 20),))]
        [7, 10, 15, 20]
    """
    if step in steps:
        return True
    if step % every_n_steps:
        return False
    if start_end_list:
        return any(a <= step <= b for a, b in start_end_list)
    return step >= start_step and (end_step is None or step <= end_step)


@dataclass(frozen=True)
class BurstPolicy:
    """How the monitor reacts to an event.

    Attributes:
        steps: K, how many steps after the event's flush are all sampled (0 switches bursts off).
        layers: ``"implicated"`` (the layers an event names; all layers for loss events, which
            name none) or ``"all"``.
        triggers: the event kinds that open a burst (:data:`BURST_TRIGGERS`).
        budget: the share of any ``window`` consecutive steps bursts may sample, in (0, 1]
            (:data:`DEFAULT_BURST_BUDGET`); at least ``steps`` steps per window whatever the share.
        window: the length of that window in steps (>= 1).
    """

    steps: int = 8
    layers: str = "implicated"
    triggers: tuple[str, ...] = DEFAULT_BURST_TRIGGERS
    budget: float = DEFAULT_BURST_BUDGET
    window: int = DEFAULT_BURST_WINDOW

    @property
    def cap(self) -> int:
        """The most burst steps in any ``window`` consecutive steps."""
        return max(self.steps, int(self.budget * self.window))

    def __post_init__(self) -> None:
        check_int("burst_steps", self.steps, 0)
        check_int("burst_window", self.window, 1)
        check_float("burst_budget", self.budget, 0.0, strict=True)
        if self.budget > 1:
            raise ConfigError(f"burst_budget is a share of steps in (0, 1], got {self.budget!r}")
        if self.layers not in BURST_LAYERS:
            raise invalid_choice("burst_layers", self.layers, BURST_LAYERS)
        triggers = as_names(self.triggers)  # "spike" is ("spike",)
        for t in triggers:
            if t not in BURST_TRIGGERS:
                raise invalid_choice("burst trigger", t, BURST_TRIGGERS)
        object.__setattr__(self, "triggers", triggers)


def opens(event: EventRecord, triggers: Sequence[str]) -> bool:
    """Whether ``event`` opens a burst: a trigger kind, and for spikes / non-finite losses their
    opening record (a closing record reports a recovery)."""
    if event.kind not in triggers:
        return False
    status = event.data.get("status")
    return status in (None, "open")


def implicated_layers(event: EventRecord) -> str | None:
    """The layer an event names (drift excursions and layer outliers), else ``None`` (loss events)."""
    layer = event.data.get("layer")
    return str(layer) if layer else None


class Burst:
    """The burst state of one monitor: which steps are sampled densely, for which layers, and why.

    Plain data in :meth:`state_dict`, so a resumed run finishes a burst it was in.
    """

    def __init__(self, policy: BurstPolicy) -> None:
        self.policy = policy
        self.start = 0  # first step of the current burst
        self.until = -1  # last step of the current burst (inclusive)
        self.trigger: dict[str, Any] = {}
        self.layers: set[str] | None = None  # None: every layer
        self.spans: list[tuple[int, int]] = []  # granted burst steps of the last window, [a, b]

    def active(self, step: int) -> bool:
        return self.start <= step <= self.until

    def open(self, step: int, events: Sequence[EventRecord]) -> EventRecord | None:
        """After the flush of ``step``: open (or extend) a burst over ``step+1 .. step+K`` when an
        event in ``events`` triggers one, as far as the budget allows. Returns the ``burst`` event
        recording it (``new``: a burst that starts here, not an extension; ``capped``: cut short by
        the budget), a ``burst_skipped`` event when the budget leaves no step, or ``None``."""
        if self.policy.steps == 0:
            return None
        fired = [e for e in events if opens(e, self.policy.triggers)]
        if not fired:
            return None
        first = fired[0]
        extending = self.active(step + 1)
        begin = self.until + 1 if extending else step + 1
        want = step + self.policy.steps
        end = self._granted(begin, want)
        if end < begin:
            return EventRecord(
                "burst_skipped",
                step,
                {"trigger": first.kind, "trigger_step": first.step, "burst_until": self.until,
                 "reason": f"budget: at most {self.policy.cap} burst steps in any "
                           f"{self.policy.window} consecutive steps"},
            )  # fmt: skip
        names = {implicated_layers(e) for e in fired}
        if self.policy.layers == "all" or None in names or (extending and self.layers is None):
            layers: set[str] | None = None
        else:
            layers = {n for n in names if n} | ((self.layers or set()) if extending else set())
        self.layers = layers
        if not extending:
            self.start = begin
        self.until = end
        self.spans.append((begin, end))
        self.trigger = {"kind": first.kind, "step": first.step}
        return EventRecord(
            "burst",
            step,
            {
                "from": self.start,
                "to": self.until,
                "trigger": first.kind,
                "trigger_step": first.step,
                "triggers": sorted({e.kind for e in fired}),
                "layers": "all" if layers is None else sorted(layers),
                "new": not extending,
                "capped": end < want,
            },
        )

    def _granted(self, begin: int, want: int) -> int:
        """The last step of ``begin .. want`` that keeps every window within the budget (a step
        before ``begin``: none). Each granted step ``t`` has at most ``cap`` burst steps in
        ``t - window + 1 .. t``, so every window of that length has at most ``cap``."""
        window, cap = self.policy.window, self.policy.cap
        self.spans = [(a, b) for a, b in self.spans if b > begin - window]  # older ones never count again
        for end in range(want, begin - 1, -1):
            low = end - window + 1
            used = sum(max(0, min(b, end) - max(a, low) + 1) for a, b in self.spans)
            if used + end - begin + 1 <= cap:
                return end
        return begin - 1

    def wants(self, step: int, layer: str) -> bool:
        """Whether ``layer`` is sampled at ``step`` by the burst."""
        return self.active(step) and (self.layers is None or layer in self.layers)

    def reason(self, step: int) -> dict[str, Any]:
        """Why ``step`` is sampled densely (the ``sampled`` event's data)."""
        return {
            "why": "burst",
            "trigger": self.trigger.get("kind"),
            "trigger_step": self.trigger.get("step"),
            "layers": "all" if self.layers is None else sorted(self.layers),
            "until": self.until,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "until": self.until,
            "trigger": dict(self.trigger),
            "layers": None if self.layers is None else sorted(self.layers),
            "spans": [list(span) for span in self.spans],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.start = int(state.get("start", self.start))
        self.until = int(state.get("until", self.until))
        self.trigger = dict(state.get("trigger", self.trigger))
        layers = state.get("layers", None)
        self.layers = None if layers is None else set(layers)
        self.spans = [(int(a), int(b)) for a, b in state.get("spans", [])]


class Sampler:
    """Which steps and layers one monitor samples: the fixed schedule plus its :class:`Burst`,
    applied to the captures at each step's start. Layers change state only around sampled steps:
    an unsampled step after an unsampled one does no per-layer work.

    Args:
        fixed: whether the fixed schedule samples a step (``CaptureConfig.samples``).
        policy: the burst policy.
    """

    def __init__(self, fixed: Callable[[int], bool], policy: BurstPolicy) -> None:
        self.fixed = fixed
        self.burst = Burst(policy)
        self.sampled = False
        self.why: str | None = None  # "schedule" or "burst" on a sampled step
        self.full = False  # every layer sampled this step (the FP8 FLOP share needs all)
        self._idle = False  # every layer known to be in the unsampled state

    def begin(self, step: int, captures: Mapping[str, Any]) -> bool:
        """Set every capture's state for ``step``; returns whether the step is sampled."""
        fixed = self.fixed(step)
        burst = self.burst.active(step)
        sampled = fixed or burst
        if sampled or self.sampled or not self._idle:
            for fqn, cap in captures.items():
                cap.begin_step(fixed or self.burst.wants(step, fqn))
            self._idle = not sampled
        self.sampled = sampled
        self.why = None if not sampled else ("schedule" if fixed else "burst")
        self.full = fixed or (burst and self.burst.layers is None)
        return sampled

    def end(self, captures: Mapping[str, Any]) -> None:
        """After a sampled step's flush: nothing is captured between steps (e.g. validation)."""
        self.sampled = False
        for cap in captures.values():
            cap.begin_step(False)
            cap.recorder = None
        self._idle = True


__all__ = [
    "Sampler",
    "BURST_TRIGGERS",
    "DEFAULT_BURST_TRIGGERS",
    "BURST_LAYERS",
    "DEFAULT_BURST_BUDGET",
    "DEFAULT_BURST_WINDOW",
    "BurstPolicy",
    "Burst",
    "scheduled",
    "normalise_windows",
    "opens",
    "implicated_layers",
]

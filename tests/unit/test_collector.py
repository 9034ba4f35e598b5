"""The cyclic garbage collector is paused around a sampled step's flush and left as it was."""

from __future__ import annotations

import gc

import pytest
import torch

from fp8track import Monitor, MonitorConfig
from fp8track.monitoring.collector import collector_paused

from helpers.analyzers import StatelessAnalyzer
from helpers.models import mlp


class _SeesTheCollector(StatelessAnalyzer):
    """An analyzer that records whether the collector was on when the flush called it."""

    def __init__(self) -> None:
        self.enabled: list[bool] = []

    def observe(self, losses, rows):
        self.enabled.append(gc.isenabled())
        return {}, []


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _run(tmp_path, steps: int, every: int) -> tuple[list[bool], bool]:
    seen = _SeesTheCollector()
    model = mlp(16, 32, 4)
    mon = Monitor(model, MonitorConfig(every_n_steps=every), log_dir=tmp_path, analyzers=[seen]).attach()
    after = []
    for _ in range(steps):
        model(torch.randn(2, 16)).sum().backward()
        mon.step(loss=1.0)
        after.append(gc.isenabled())
    mon.close()
    return seen.enabled, all(after)


def test_the_flush_runs_with_the_collector_paused_and_the_step_ends_with_it_on(tmp_path, collector_on):
    during, after = _run(tmp_path, steps=4, every=2)
    assert during == [False, False, False]  # steps 0 and 2, then close's flush of step 3's loss
    assert after and gc.isenabled()


def test_a_process_that_switched_the_collector_off_keeps_it_off(tmp_path, collector_on):
    gc.disable()
    during, after = _run(tmp_path, steps=2, every=1)
    assert during == [False, False]  # close had nothing pending
    assert not after and not gc.isenabled()


def test_the_collector_comes_back_when_the_block_raises(collector_on):
    with pytest.raises(RuntimeError, match="boom"), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_objects_dead_by_the_end_of_the_block_never_meet_a_collection(collector_on):
    collections: list[int] = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        before = gc.get_count()[0]
        with collector_paused():
            n = 20 * gc.get_threshold()[0]
            rows = [{"amax": float(i), "cos": 1.0} for i in range(n)]
            assert gc.get_count()[0] >= before + len(rows)  # counted while alive
            del rows
        after = gc.get_count()[0]
    finally:
        gc.callbacks.remove(count)
    assert collections == []
    assert after - before < n // 50  # freed by reference count: they no longer count

"""The diagnosis benchmark's CI subset end to end: real FP8 and BF16 runs recorded by the Monitor,
every planted phenomenon checked independently of the diagnosis, then the public diagnosis scored.

The diagnosis's accuracy on this subset is asserted (every kind on top, no false alarm, the
planted layer first) and recorded (printed, and as pytest properties)."""

from __future__ import annotations

import json

import diagnosis_bench as bench  # bench/, on pytest's pythonpath
import pytest


@pytest.mark.slow
def test_ci_subset_plants_materialise_and_are_scored(tmp_path, record_property):
    """Long (about 2.5 min): eight real trainings of the scenarios' own 160 steps (their plants sit at
    steps 48-160), shared with the full benchmark, then a rerun read from the cache. They train in
    this process (jobs=1), one thread: the suite's other worker keeps the second core busy, and a
    pool of two would only add two processes' imports and kernel compiles to an oversubscribed
    machine."""
    result = bench.run("ci", cache=tmp_path / "cache", jobs=1)
    rows = result["scenarios"]
    assert {r["expected_kind"] for r in rows} >= {
        "healthy",
        "shared_spikes",
        "fp8_only_spikes",
        "mid_training_gap",
    }
    for r in rows:
        gt = r["ground_truth"]
        # The ground truth: every planted phenomenon happened, and the plant left the BF16 model alone.
        assert gt["materialised"], (r["name"], gt)
        assert gt["checks"]["bf16_unaffected"], r["name"]
        assert r["verified"]
        assert r["diagnosis"]["findings"], r["name"]
    by = {r["expected_kind"]: r for r in rows}
    # A lasting gap means the FP8 loss stays >= 5 % above the control after the plant, not before.
    gap = by["mid_training_gap"]["ground_truth"]
    assert gap["ratio_before"] <= 1.03 and gap["ratio_late"] >= 1.05
    spikes = by["fp8_only_spikes"]["ground_truth"]["spikes"]
    assert any(s["peak_ratio_smoothed"] >= 1.10 for s in spikes)  # beyond what healthy pairs show
    # The diagnosis on this subset (issue 19's bar, measured on the full set in README): every kind
    # on top, no false alarm, the planted layer first in the ranking.
    # Every kind on top, except where a latent-damage plant also moved the loss: whether that counts
    # as a lasting gap the ground truth judges on a fixed 5 % tail ratio, the diagnosis in the loss's
    # own noise, so a mid-training gap naming the destroyed layer is a defensible headline there;
    # what such a plant must get is the verdict naming its layer (asserted below for every plant).
    missed = [(r["name"], r["diagnosis"]["findings"][:1]) for r in rows
              if not r["score"]["kind_top"] and r["expected_kind"] != "latent_damage"]
    assert not missed, missed
    # One verdict per pair, right on every scenario; a destroyed layer is never called healthy and
    # the verdict names the planted layer as the cause, not a consequence downstream of it.
    wrong = [(r["name"], r["diagnosis"]["verdict"]) for r in rows if not r["score"]["verdict_right"]]
    assert not wrong, wrong
    t = result["totals"]
    assert t["causal_top1"]["n"] >= 2 and t["causal_top1"]["share"] == 1.0, t["causal_top1"]
    assert t["headline_not_cause"] == [] and t["destroyed_called_healthy"] == []
    assert not by["healthy"]["score"]["false_alarm"]
    # Single-layer plants are scored on the layer; the naive rules see the planted layer's rows.
    for r in rows:
        if r["plant"] and r["plant"]["position"] != "all":
            for key in bench.LAYER_KEYS:
                assert key + "_top1" in r["score"], (r["name"], key)
            assert r["score"]["naive_underflow_rank"] is not None and r["score"]["naive_mse_rank"] is not None
            # the layer's own ground truth: its GEMM, measured in the training loop, is the broken one
            dmg = r["ground_truth"]["layer_damage"]
            assert r["layer_verified"], (r["name"], dmg)
            assert dmg["planted_error"] >= 3 * dmg["worst_other_error"], (r["name"], dmg)
            assert dmg["planted_error_before"] < 0.1, (r["name"], dmg)
            assert r["score"]["diagnosis_top1"], (r["name"], r["diagnosis"]["ranking_top5"])
    assert t["verified"] == t["scenarios"] == len(rows)
    for key in ("kind_top", "kind_among", "false_alarms", "diagnosis_top1", "diagnosis_top3",
                "naive_underflow_top1", "naive_mse_top1", "verdict_right", "causal_top1"):
        record_property(key, json.dumps(t[key]))
    print(json.dumps({k: t[k] for k in t if k != "by_kind"}, indent=1))
    # A rerun reads every run back from the cache and diagnoses again: the same answers.
    again = bench.run("ci", cache=tmp_path / "cache", jobs=1)
    assert [r["diagnosis"]["findings"] for r in again["scenarios"]] == [
        r["diagnosis"]["findings"] for r in rows
    ]
    assert again["seconds"]["train_or_cache"] < result["seconds"]["train_or_cache"]

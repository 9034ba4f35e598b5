"""bench/diagnosis_bench.py scoring and bench/diagnosis_scenarios.py ground truth, on constructed
inputs whose answers are worked out by hand."""

from __future__ import annotations

import math

import diagnosis_bench as bench  # bench/, on pytest's pythonpath
import diagnosis_scenarios as ds
import pytest

from fp8track.analysis.diagnose import Finding
from fp8track.monitoring.records import TensorStatsRow


def _row(step, layer, tensor, variant="actual", **stats):
    return TensorStatsRow(step, layer, tensor, stats, variant)


ROWS = [
    # layer a: max underflow 40 (weight, step 10), max mse 0.5
    _row(0, "a", "activation", underflow_pct=10.0, mse=0.5),
    _row(10, "a", "weight", underflow_pct=40.0, mse=0.1),
    # layer b: max underflow 90 (gradient), max mse 0.2; a what-if row with 100 % must be ignored
    _row(0, "b", "gradient", underflow_pct=90.0, mse=0.2),
    _row(0, "b", "activation", "current", underflow_pct=100.0, mse=9.0),
    # layer c: underflow NaN at one step (ignored), 40 at another (ties with a), mse 3.0
    _row(0, "c", "activation", underflow_pct=math.nan, mse=3.0),
    _row(10, "c", "activation", underflow_pct=40.0, mse=1.0),
]


def test_naive_rules_rank_layers_by_their_largest_actual_value():
    # underflow: b 90 > a 40 = c 40 (tie kept in name order)
    assert bench.naive_ranking(ROWS, "underflow_pct") == ["b", "a", "c"]
    # mse: c 3.0 > a 0.5 > b 0.2 (b's what-if 9.0 does not count)
    assert bench.naive_ranking(ROWS, "mse") == ["c", "a", "b"]
    assert bench.naive_ranking(ROWS, "sqnr_db") == []


def test_rank_of_compares_canonical_names_and_counts_each_layer_once():
    ranking = [
        "model.layers.1.mlp.up_proj",
        "layers.1.mlp.up_proj",
        "_orig_mod.model.layers.0.self_attn.q_proj",
    ]
    assert bench.rank_of(ranking, "layers.0.self_attn.q_proj") == 2  # the duplicate is one layer
    assert bench.rank_of(ranking, "model.layers.1.mlp.up_proj") == 1
    assert bench.rank_of(ranking, "lm_head") is None
    assert bench.canonical("base_model.model.module.blocks.0.attn.qkv") == "blocks.0.attn.qkv"


def _finding(kind, severity, layers=()):
    return Finding(kind, severity, 0.5, "t", "x", layers=tuple(layers))


def test_false_alarm_is_a_non_healthy_high_or_medium_finding():
    assert not bench.false_alarm([_finding("healthy", "info")])
    assert not bench.false_alarm([_finding("layer_outlier", "low"), _finding("healthy", "info")])
    assert bench.false_alarm([_finding("layer_outlier", "medium")])
    assert bench.finding_layers(
        [_finding("healthy", "info"), _finding("mid_training_gap", "high", ["x", "y"])]
    ) == ["x", "y"]


def test_score_row_and_totals():
    layers = {"diagnosis": ["b", "planted", "c"], "finding": ["planted"], "top_finding": [],
              "naive_underflow": ["planted"], "naive_mse": ["a", "b", "c", "planted"]}
    s = bench.score_row("mid_training_gap", ["layer_outlier", "mid_training_gap"], layers, "planted", False)
    assert (s["kind_top"], s["kind_among"]) == (False, True)
    assert (s["diagnosis_rank"], s["diagnosis_top1"], s["diagnosis_top3"]) == (2, False, True)
    assert (s["naive_mse_rank"], s["naive_mse_top3"]) == (4, False)
    assert s["finding_top1"] and s["naive_underflow_top1"]
    assert (s["top_finding_rank"], s["top_finding_top3"]) == (None, False)
    assert "false_alarm" not in s
    healthy = bench.score_row("healthy", ["layer_outlier", "healthy"], None, None, True)
    assert healthy == {"kind_top": False, "kind_among": True, "false_alarm": True}
    # spikes that also left a lasting gap: a mid_training_gap on top is right, the spikes must still be named
    both = bench.score_row("fp8_only_spikes", ["mid_training_gap"], None, None, False,
                           ["fp8_only_spikes", "mid_training_gap"])
    assert (both["kind_top"], both["kind_among"]) == (True, False)

    # a broken middle layer that did not move the loss: scored on the layer, not on the kind
    quiet = bench.score_row("mid_training_gap", ["healthy"], {k: ["planted", "b"] for k in layers}, "planted",
                            False)
    rows = [
        {"name": "g", "verified": True, "layer_verified": True, "expected_kind": "mid_training_gap",
         "score": s},
        {"name": "h", "verified": True, "expected_kind": "healthy", "score": healthy},
        {"name": "u", "verified": False, "expected_kind": "healthy",
         "score": bench.score_row("healthy", ["healthy"], None, None, False)},
        {"name": "q", "verified": False, "layer_verified": True, "expected_kind": "mid_training_gap",
         "score": quiet},
        {"name": "x", "verified": False, "layer_verified": False, "expected_kind": "mid_training_gap",
         "score": quiet},
    ]
    verdicts = {"g": ("fp8_problem", ["b"]), "h": ("fp8_problem", ["a"]), "u": ("healthy", []),
                "q": ("healthy", []), "x": ("healthy", [])}
    for r in rows:
        v, named = verdicts[r["name"]]
        planted = "planted" if r["expected_kind"] != "healthy" else None
        r["score"] = {**r["score"], **bench.verdict_scores(r["expected_kind"], v, named, planted,
                                                           r.get("layer_verified", False))}
        r["diagnosis"] = {"findings": [{"confidence": 0.95, "right": r["name"] == "g"}]}
    t = bench.totals(rows)
    # g: fp8_problem (right) headlining "b" (not the cause); h: a healthy pair called fp8_problem
    assert t["verdict_right"] == {"n": 2, "hits": 1, "share": 0.5}
    # causal scores over the layer-verified plants (g, q): q's destroyed layer was called healthy
    assert t["causal_top1"] == {"n": 2, "hits": 0, "share": 0.0}
    assert (t["headline_not_cause"], t["destroyed_called_healthy"]) == (["g"], ["q"])
    # calibration over the verified rows' findings (g right, h wrong), both in the top bin
    assert t["calibration"][2] == {"confidence": [0.9, 1.0], "n": 2, "right": 1, "share_right": 0.5}
    assert (t["scenarios"], t["verified"], t["not_materialised"]) == (5, 2, ["u", "q", "x"])
    assert t["kind_top"] == {"n": 2, "hits": 0, "share": 0.0}
    assert t["kind_among"] == {"n": 2, "hits": 2, "share": 1.0}
    assert t["false_alarms"] == {"n": 1, "hits": 1, "share": 1.0}
    assert (t["layer_scored"], t["layer_not_verified"]) == (["g", "q"], ["x"])
    assert t["diagnosis_top1"] == {"n": 2, "hits": 1, "share": 0.5}
    assert t["diagnosis_top3"] == {"n": 2, "hits": 2, "share": 1.0}
    assert t["diagnosis_top1_loss_verified"] == {"n": 1, "hits": 0, "share": 0.0}
    assert t["naive_underflow_top1"]["share"] == 1.0 and t["naive_mse_top3"]["hits"] == 1


def _gap_scenario():
    plant = ds.Plant("amax", "activation", "middle", ((50, 100),))
    return ds.Scenario("g", "mid_training_gap", ds.RunSpec("gpt", ds.DELAYED, 0, 100, 5, 0, plant=plant))


@pytest.mark.parametrize(("late", "materialised"), [(1.10, True), (1.01, False)])
def test_ground_truth_of_a_mid_training_gap(late, materialised):
    ctl = [3.0 - 0.01 * i for i in range(100)]
    fp8 = [c * (late if i >= 50 else 1.0) for i, c in enumerate(ctl)]
    out = ds.ground_truth(_gap_scenario(), {"loss": fp8, "plant_touches": 3}, {"loss": ctl}, {"ok": True})
    assert out["checks"]["tracks_before_plant"]
    assert out["ratio_tail"] == pytest.approx(late, rel=1e-6)
    assert out["materialised"] is materialised


def test_ground_truth_fails_when_the_plant_reaches_the_bf16_model_or_never_acted():
    ctl = [3.0] * 100
    fp8 = [3.0] * 50 + [3.6] * 50
    assert not ds.ground_truth(
        _gap_scenario(), {"loss": fp8, "plant_touches": 3}, {"loss": ctl}, {"ok": False}
    )["materialised"]
    assert not ds.ground_truth(
        _gap_scenario(), {"loss": fp8, "plant_touches": 0}, {"loss": ctl}, {"ok": True}
    )["materialised"]


def test_ground_truth_of_fp8_only_spikes_needs_a_calm_control():
    plant = ds.Plant("outlier", "activation", "last", ((40, 44),))
    sc = ds.Scenario("s", "fp8_only_spikes", ds.RunSpec("gpt", "current", 0, 100, 5, 0, plant=plant))
    ctl = [2.0] * 100
    fp8 = list(ctl)
    fp8[42] = 2.6  # one step at ratio 1.3: a raw blip healthy pairs show too (the smoothed ratio stays 1.0)
    one = ds.ground_truth(sc, {"loss": fp8, "plant_touches": 4}, {"loss": ctl}, {"ok": True})
    assert not one["materialised"] and one["spikes"][0]["peak_ratio_smoothed"] == pytest.approx(1.0)
    fp8[41:44] = [2.6] * 3  # three steps: the 5-step running median of the ratio reaches 1.3
    out = ds.ground_truth(sc, {"loss": fp8, "plant_touches": 4}, {"loss": ctl}, {"ok": True})
    peak = out["spikes"][0]
    assert peak["peak_step"] == 41 and peak["peak_ratio_smoothed"] == pytest.approx(1.3)
    assert out["materialised"] and out["accepted_kinds"] == ["fp8_only_spikes"]
    lasting = fp8[:80] + [2.4] * 20  # the damage leaves a lasting 20 % gap too
    assert ds.ground_truth(sc, {"loss": lasting, "plant_touches": 4}, {"loss": ctl}, {"ok": True})[
        "accepted_kinds"] == ["fp8_only_spikes", "mid_training_gap"]
    both = list(ctl)
    both[41:44] = [2.8] * 3  # the control spiked there too: not FP8-only
    assert not ds.ground_truth(sc, {"loss": fp8, "plant_touches": 4}, {"loss": both}, {"ok": True})[
        "materialised"
    ]


def test_scenario_set_covers_every_kind_three_families_and_both_scalings():
    scs = ds.scenarios()
    kinds = {s.expected_kind for s in scs}
    assert kinds == {
        "healthy",
        "shared_spikes",
        "fp8_only_spikes",
        "divergence_from_start",
        "mid_training_gap",
        "downstream_drop_with_normal_loss",
        "latent_damage",
    }
    assert sum(s.expected_kind == "healthy" for s in scs) >= 4
    assert {s.fp8.family for s in scs} == set(ds.FAMILIES)
    assert {s.fp8.recipe.split(":")[0] for s in scs} == {"delayed", "current"}
    layer = [s.fp8.plant for s in scs if s.scores_layer]
    assert {p.tensor for p in layer} == set(ds.TENSORS)
    assert {p.position for p in layer} == {*ds.POSITIONS, *ds.ROLES}
    assert len({s.name for s in scs}) == len(scs)
    assert all(s.control().recipe == "bf16" and s.control().plant is None for s in scs)
    with pytest.raises(ValueError, match="unknown families"):
        ds.select("full", ["bert"])


def test_cli_refuses_an_unknown_family_with_exit_2(capsys):
    assert bench.main(["--subset", "ci", "--families", "gpt,bert"]) == 2
    assert "bert" in capsys.readouterr().err


def _damage_case(planted_err, other_err):
    plant = ds.Plant("amax", "weight", "middle", ((40, 44),))
    sc = ds.Scenario("s", "fp8_only_spikes", ds.RunSpec("gpt", ds.DELAYED, 0, 100, 5, 0, plant=plant))
    # window 40-43 plus the 16-step history: steps 40..59 count; step 60 and the steps before do not
    errs = {"p": {**{t: planted_err for t in range(40, 60)}, 20: 0.02, 60: 5.0},
            "o": {**{t: other_err for t in range(40, 60)}, 24: 9.0}}
    return sc, {"planted_layers": ["p"], "gemm_error": {"forward": errs, "dgrad": {}}}


@pytest.mark.parametrize(("planted_err", "other_err", "verified"),
                         [(0.9, 0.05, True), (0.25, 0.01, False), (0.9, 0.31, False), (0.95, 0.31, True)])
def test_layer_damage_needs_a_broken_gemm_that_stands_out(planted_err, other_err, verified):
    sc, fp8 = _damage_case(planted_err, other_err)
    assert ds.damage_steps(sc.fp8.plant, sc.fp8.recipe, 100) == list(range(40, 60))
    out = ds.layer_damage(sc, fp8)
    assert out["measure"] == "forward" and out["worst_other_layer"] == "o"
    assert out["planted_error"] == pytest.approx(planted_err)
    assert out["worst_other_error"] == pytest.approx(other_err)
    assert out["planted_error_before"] == pytest.approx(0.02)
    assert out["verified"] is verified


def test_gemm_error_probe_reads_zero_in_high_precision_and_one_for_a_flushed_weight():
    import torch
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    import fp8track
    from fp8track.execution.faults import Fault, plant

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), Conv1D(16, 48))
    rep = fp8track.apply_fp8(model, "current", backend="emulated")
    names = list(rep.fp8_layers)
    probe = ds.GemmErrorProbe(model, names, backward=True)
    x = torch.randn(8, 32, requires_grad=True)
    probe.measure(0, True)
    model(x).square().sum().backward()
    fwd, dgrad = probe.errors["forward"], probe.errors["dgrad"]
    # healthy E4M3 GEMMs: a few percent off float32; the E5M2 gradient a little more; never zero
    assert all(0.001 < fwd[n][0] < 0.1 for n in names), fwd
    assert all(0.001 < dgrad[n][0] < 0.2 for n in names), dgrad
    # the second layer's weight flushed to zero: its output is its bias, a relative error near 1
    flush = plant(model, Fault("scale", "weight", log2=40.0, in_eval=True), [names[1]])
    probe.measure(1, True)
    with torch.no_grad():
        torch.nn.init.zeros_(model.get_submodule(names[1]).bias)
    model(x).sum().backward()
    flush.detach()
    assert fwd[names[1]][1] == pytest.approx(1.0, abs=1e-6) and fwd[names[0]][1] < 0.1
    # not measured when off, nor in evaluation
    probe.measure(2, False)
    model(x).sum().backward()
    probe.measure(3, True)
    with torch.no_grad():
        model(x)
    probe.detach()
    assert 2 not in fwd[names[0]] and 3 not in fwd[names[0]]


def test_verdict_and_finding_scores_and_the_reliability_table():
    assert bench.expected_verdict("shared_spikes") == "healthy"
    assert bench.expected_verdict("latent_damage") == "fp8_problem"
    v = bench.verdict_scores("mid_training_gap", "fp8_problem", ["model.blocks.0.attn.qkv"],
                             "blocks.0.attn.qkv", True)  # wrapper prefixes dropped before comparing
    assert v == {"verdict": "fp8_problem", "verdict_right": True, "causal_top1": True,
                 "headline_not_cause": False, "destroyed_called_healthy": False}
    # no verified layer: only the verdict is scored
    assert bench.verdict_scores("healthy", "healthy", [], None, False) == {"verdict": "healthy",
                                                                           "verdict_right": True}
    right = bench.finding_right
    assert right("healthy", [], "shared_spikes", ["shared_spikes"], None, False)
    assert not right("healthy", [], "latent_damage", ["latent_damage"], "p", True)
    assert right("layer_outlier", ["p"], "mid_training_gap", ["mid_training_gap"], "p", True)
    assert not right("layer_outlier", ["lm_head", "p"], "mid_training_gap", ["mid_training_gap"], "p", True)
    assert not right("layer_outlier", ["x"], "healthy", ["healthy"], None, False)  # a false alarm
    assert right("mid_training_gap", ["x"], "mid_training_gap", ["mid_training_gap"], "p", False)
    table = bench.calibration([{"confidence": c, "right": r} for c, r in
                               ((0.5, False), (0.69, True), (0.7, True), (0.9, True), (1.0, False))])
    assert [(b["n"], b["right"], b["share_right"]) for b in table] == [(2, 1, 0.5), (1, 1, 1.0), (2, 1, 0.5)]

"""The layer ranking: hand-worked z-scores on small constructed row sets, the like-with-like rules
(tensor kind x element format, excess over the control), own-onset windows and peaks, ties, the
error of the non-outlier elements against an independent reference, and planted cases built from
real quantisation statistics (fp8track.numerics.stats.quant_stats) where the ranking must name the
planted layer and do at least as well as the naive rules "highest max MSE" / "highest max underflow"."""

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fp8track.analysis.baseline import RunData
from fp8track.analysis.diagnose import diagnose
from fp8track.analysis.layer_history import history_shifts
from fp8track.analysis.ranking import material, outliers, rank_layers, tied
from fp8track.analysis.risk_signals import (
    SIGNALS,
    bulk_sqnr_db,
    element_format,
    largest_element_error,
    peak,
    robust_z,
)
from fp8track.errors import ConfigError
from fp8track.monitoring.records import TensorStatsRow
from fp8track.numerics.stats import quant_stats


def _row(
    layer, tensor, step, sqnr=30.0, cos=0.9995, under=1.0, over=0.0, drift=0.0, variant="actual", **extra
):
    return TensorStatsRow(step, layer, tensor, {"sqnr_db": sqnr, "cos": cos, "underflow_pct": under,
                                                "overflow_pct": over, "scale_drift_log2": drift,
                                                "mse": 1e-4, "amax": 1.0, **extra}, variant)


def test_robust_z_hand_worked():
    # values 1,2,3,4,100: median 3, |v-3| = 2,1,0,1,97 -> MAD 1 -> scale 1.4826
    z = robust_z([1, 2, 3, 4, 100], floor=0.1)
    assert z[2] == 0.0
    assert z[3] == pytest.approx(1 / 1.4826)
    assert z[4] == pytest.approx(97 / 1.4826)
    # a floor wins over a zero MAD; NaN stays NaN; inf is clipped to the finite extremes
    assert robust_z([0, 0, 0, 1], floor=0.5) == [0, 0, 0, 2.0]
    z = robust_z([1.0, math.nan, math.inf, 1.0], floor=1.0)
    assert math.isnan(z[1]) and z[2] == 0.0
    with pytest.raises(ConfigError):
        robust_z([1.0], floor=0)


def test_peak_is_the_second_largest_from_five_samples_and_ties_are_relative():
    assert peak([1.0, 9.0, 2.0, 3.0]) == 9.0  # fewer than 5 samples: the largest
    assert peak([1.0, 9.0, 2.0, 3.0, 4.0]) == 4.0  # one odd sample does not set it
    assert peak([1.0, 9.0, 8.0, 3.0, 4.0, math.nan]) == 8.0  # two do
    assert math.isnan(peak([math.nan]))
    assert tied(10.0, 9.1) and not tied(10.0, 8.9)  # within 10% of the larger
    assert tied(0.2, 0.6) and not tied(0.2, 0.8)  # or within 0.5 absolute


def test_element_format_from_current_scale_times_amax():
    assert element_format({"current_scale": 448 / 3.0, "amax": 3.0}) == "e4m3"
    assert element_format({"current_scale": 57344 / 3.0, "amax": 3.0}) == "e5m2"
    assert element_format({"current_scale": 256 / 3.0, "amax": 3.0}) == "e4m3"  # power-of-2 scale, margin 0
    assert element_format({"amax": 3.0}) == "?" and element_format({"current_scale": 1.0, "amax": 0.0}) == "?"
    # the real statistics carry it
    assert element_format(quant_stats(torch.randn(256), "e5m2")) == "e5m2"
    assert element_format(quant_stats(torch.randn(256), "e4m3")) == "e4m3"


@pytest.mark.parametrize("big", [None, 30.0, 1e3, 1e7])
@pytest.mark.parametrize("stale", [1.0, 0.37])
def test_bulk_sqnr_matches_the_error_of_the_non_outlier_elements(big, stale):
    """Independent reference: quantise with torch's float8 dtype (saturating), then the SQNR of every
    element but the largest; at the current scale and at a stale (delayed) one, where the largest
    element is not exact and its own error must not be charged to the others."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2000, generator=g)  # under the compile threshold: eager, fast
    if big is not None:
        x[0] = big
    scale = 448.0 / float(x.abs().max()) * stale
    s = quant_stats(x, "e4m3", torch.tensor(scale))
    sc = torch.tensor(scale, dtype=torch.float32)
    q = (x * sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() / sc
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[x.abs().argmax()] = False
    ref = 10 * math.log10(float((x[keep].double() ** 2).sum() / ((x[keep] - q[keep]).double() ** 2).sum()))
    amax2 = float(x.abs().max()) ** 2
    assert largest_element_error(s) == pytest.approx(
        float((x.abs().max() - q[~keep].abs()) ** 2), rel=1e-4, abs=1e-9 * amax2
    )
    if big == 1e7:
        # the outlier carries all but 4e-11 of the energy: SQNR > 100 dB, cos 1.0, and every ordinary
        # element is flushed. float32 sums cannot resolve the rest; the flushed-majority rule does:
        assert s["underflow_pct"] > 99.9
        if stale == 1.0:
            assert s["sqnr_db"] > 100 and s["cos"] > 0.999999
        assert ref == pytest.approx(0.0, abs=1e-6)
        assert bulk_sqnr_db(s) == pytest.approx(10 * math.log10(100 / s["underflow_pct"]))
        assert bulk_sqnr_db(s) < 0.01
    else:
        assert bulk_sqnr_db(s) == pytest.approx(ref, abs=0.01)
    if big == 1e3 and stale == 1.0:
        assert s["sqnr_db"] - bulk_sqnr_db(s) > 25  # the outlier hides 27 dB of the others' error


def test_z_scores_within_tensor_kind_and_format_hand_worked():
    """Hybrid: activations E4M3 at ~31.8 dB, gradients E5M2 at ~25.9 dB by format alone. Pooled, every
    gradient would look worse than every activation; within their group none stands out, and the
    one damaged activation (26.0 dB) does."""
    e4, e5 = {"current_scale": 448.0, "amax": 1.0}, {"current_scale": 57344.0, "amax": 1.0}
    act = [31.8, 31.6, 26.0, 31.9, 31.7]
    grad = [25.9, 25.7, 26.0, 25.8, 26.1]
    rows = [_row(f"l{i}", "activation", 0, sqnr=a, **e4) for i, a in enumerate(act)]
    rows += [_row(f"l{i}", "gradient", 0, sqnr=g, **e5) for i, g in enumerate(grad)]
    ranking = rank_layers(rows)
    assert ranking[0].layer == "l2" and ranking[0].tensor == "activation" and ranking[0].fmt == "e4m3"
    # rel_error_db = -sqnr over (-31.8, -31.6, -26.0, -31.9, -31.7): median -31.7, |dev| 0.1,0.1,5.7,0.2,0
    # -> MAD 0.1 -> 0.148 < floor 1 dB: z = (-26.0 + 31.7) / 1 = 5.7
    assert ranking[0].z["rel_error_db"] == pytest.approx(5.7)
    # the gradients' own group: median -25.9, worst -25.7 -> z 0.2 (and nothing else differs)
    l1 = next(r for r in ranking if r.layer == "l1")
    assert l1.score == pytest.approx(0.2, abs=1e-9) and l1.tensor == "gradient"
    assert set(ranking[0].z) == set(SIGNALS)
    # 5.7 dB worse than its group's median is not material (MATERIAL_MARGINS: 6 dB)
    assert outliers(ranking) == []
    rows[2] = _row("l2", "activation", 0, sqnr=25.0, **e4)  # 6.7 dB worse: an outlier
    assert [r.layer for r in outliers(rank_layers(rows))] == ["l2"]


def test_excess_over_the_control_hand_worked():
    """Underflow peaks 1,2,3,20,2 in FP8 and 1,2,3,19,2 in the control: layer 3 is hard to quantise in
    both runs, so its excess is 1 like l0's; l2's excess 0... z of the excess (0,0,0,1,0): median 0,
    MAD 0 -> floor 0.5 -> l3 scores 2, nobody stands out."""
    fp8 = [_row(f"l{i}", "weight", 0, under=u) for i, u in enumerate([1, 2, 3, 20, 2])]
    ctl = [_row(f"l{i}", "weight", 0, under=u, variant="shadow") for i, u in enumerate([1, 2, 3, 19, 2])]
    alone = rank_layers(fp8)
    assert alone[0].layer == "l3" and alone[0].z["underflow_pct"] == pytest.approx((20 - 2) / 1.4826)
    ranking = rank_layers(fp8, control=ctl)
    assert all(r.excess for r in ranking)
    assert ranking[0].layer == "l3" and ranking[0].score == pytest.approx(2.0)
    assert outliers(ranking) == []
    # a control in another format is not comparable: plain peer comparison
    ctl5 = [
        TensorStatsRow(0, r.layer, r.tensor, {**r.stats, "current_scale": 57344.0}, "shadow") for r in ctl
    ]
    assert not any(r.excess for r in rank_layers(fp8, control=ctl5))


def test_ties_are_reported_and_ordered_by_model_order_not_name():
    rows = []
    for step in range(3):
        for layer in ("z.first", "m.second", "a.third", "b.fourth", "c.fifth"):
            bad = layer in ("z.first", "a.third")
            rows.append(_row(layer, "activation", step, under=12.0 if bad else 1.0))
    ranking = rank_layers(rows)
    assert [r.layer for r in ranking[:2]] == ["z.first", "a.third"]  # model order, not alphabetical
    assert ranking[0].rank == ranking[1].rank == 1 and ranking[2].rank == 3
    assert ranking[0].tied == ("a.third",) and ranking[1].tied == ("z.first",)
    assert ranking[0].score == pytest.approx(11.0 / 0.5)


def test_own_onset_window_and_history_shift_as_evidence():
    """A layer whose underflow rises from 1% to 30% at step 60 of 100: its window starts at its own
    onset, its median statistics come from there, and its own_shift z is the history shift's."""
    rows = []
    for step in range(0, 100, 10):
        for i in range(6):
            u = 30.0 if (i == 4 and step >= 60) else 1.0 + 0.01 * ((step // 10 + i) % 3)
            rows.append(_row(f"l{i}", "activation", step, under=u))
    shift = next(h for h in history_shifts(rows) if h.layer == "l4")
    # before: median of 1.01, 1.02, 1.00, 1.01, 1.02, 1.00 (steps 0-50) = 1.01
    assert (shift.step, shift.signal, shift.after) == (60, "underflow_pct", 30.0)
    assert shift.before == pytest.approx(1.01)
    ranking = rank_layers(rows)
    top = ranking[0]
    assert top.layer == "l4" and top.onset == 60
    assert top.stats["activation"]["steps"] == 4 and top.stats["activation"]["underflow_pct"] == 30.0
    # own_shift: robust z of (0, ..., shift.z, ...) with floor 2 -> shift.z / 2
    assert top.z["own_shift"] == pytest.approx(shift.z / 2.0)
    # the drift events that name it count too: severity 3 against none elsewhere (floor 1)
    ev = [("drift", 70, {"layer": "l4", "tensor": "activation", "severity": 3.0, "source": "recipe"}),
          ("drift", 70, {"layer": "l1", "tensor": "activation", "severity": 9.0, "source": "what_if"})]
    assert rank_layers(rows, events=ev)[0].z["drift_events"] == pytest.approx(3.0)


def test_what_if_rows_are_ignored_and_alike_layers_have_no_outlier():
    rows = [_row(f"l{i}", "weight", s, sqnr=30 + 0.01 * i) for i in range(6) for s in range(3)]
    rows.append(_row("l0", "weight", 0, sqnr=-50, variant="mxfp8"))
    ranking = rank_layers(rows)
    assert outliers(ranking) == []
    assert all(r.score < 1.0 for r in ranking)


# --- planted cases from real quantisation statistics ---------------------------------------------

LAYERS = [f"blocks.{i}.{m}" for i in range(3) for m in ("attn", "mlp")]
TENSORS = {"activation": "e4m3", "weight": "e4m3", "gradient": "e5m2"}
FMT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
STEPS, NUMEL, HISTORY = 8, 256, 4


@dataclass(frozen=True)
class Plant:
    """``kind``: ``stale_outlier`` (the scale is set for an outlier ``strength`` x the amax that is no
    longer there: delayed scaling after a spike, ordinary values underflow), ``outlier_element`` (one
    steady element ``strength`` x the tensor's typical magnitude: the scales follow it, the rest
    flushes while SQNR and cos stay high), ``overflow`` (scale ``strength`` x too large: saturation)."""

    layer: str
    tensor: str
    kind: str
    strength: float
    start: int = STEPS // 2


def _model(seed):
    """Per layer and tensor kind: a magnitude spanning decades (raw MSE then ranks magnitudes), and
    one layer whose gradients are heavy-tailed (a high underflow share in every run, FP8's or not)."""
    rng = np.random.default_rng(seed)
    mags = {(layer, t): float(10 ** rng.uniform(*{"activation": (-1.5, 1.5), "weight": (-2.5, -0.5),
                                                      "gradient": (-6, -3)}[t]))
            for layer in LAYERS for t in TENSORS}
    heavy = LAYERS[int(rng.integers(len(LAYERS)))]
    # the heavy tail is a fixed per-element profile (outlier features), so its amax is steady
    profile = torch.exp(2.5 * torch.from_numpy(rng.standard_normal(NUMEL)).float())
    return mags, heavy, profile


def _run(seed, fp8, plant=None):
    mags, heavy, profile = _model(seed)
    g = torch.Generator().manual_seed(1000 * seed + int(fp8))
    history = {}
    rows = []
    for step in range(STEPS):
        for layer in LAYERS:
            for t, fmt in TENSORS.items():
                x = torch.randn(NUMEL, generator=g) * mags[(layer, t)]
                if layer == heavy and t == "gradient":
                    x = x * profile
                amax = float(x.abs().max())
                planted = (
                    fp8
                    and plant is not None
                    and (layer, t) == (plant.layer, plant.tensor)
                    and step >= plant.start
                )
                if planted and plant.kind == "outlier_element":
                    x[0] = plant.strength * mags[(layer, t)]  # a steady outlier: exact at the format's max
                hist = history.setdefault((layer, t), [])
                if fp8:  # delayed scaling: the scale from the amax history before this step
                    scale = FMT_MAX[fmt] / max(hist[-HISTORY:] or [float(x.abs().max())])
                else:  # the control's shadow rows: current scaling
                    scale = FMT_MAX[fmt] / float(x.abs().max())
                if planted and plant.kind == "stale_outlier":
                    scale = FMT_MAX[fmt] / (plant.strength * amax)
                if planted and plant.kind == "overflow":
                    scale *= plant.strength
                hist.append(float(x.abs().max()))
                rows.append(
                    TensorStatsRow(step, layer, t, quant_stats(x, fmt, scale), "actual" if fp8 else "shadow")
                )
    return rows


CASES = {
    "act-first": Plant(LAYERS[0], "activation", "stale_outlier", 300.0),
    "act-middle": Plant(LAYERS[2], "activation", "stale_outlier", 1e4),
    "act-last": Plant(LAYERS[-1], "activation", "stale_outlier", 30.0),
    "weight-first": Plant(LAYERS[0], "weight", "outlier_element", 1e6),
    "weight-middle": Plant(LAYERS[3], "weight", "outlier_element", 1e3),
    "weight-last": Plant(LAYERS[-1], "weight", "outlier_element", 1e7),
    "grad-first": Plant(LAYERS[0], "gradient", "overflow", 64.0),
    "grad-middle": Plant(LAYERS[2], "gradient", "stale_outlier", 100.0),
    "grad-last": Plant(LAYERS[-1], "gradient", "overflow", 16.0),
}


def _naive(rows, stat):
    """The naive rule: the layer with the highest maximum of ``stat`` over its tensors and steps."""
    best = {}
    for r in rows:
        if r.variant in ("actual", "shadow"):
            best[r.layer] = max(best.get(r.layer, -math.inf), float(r.stats[stat]))
    return max(best, key=best.get)


@pytest.fixture(scope="module")
def planted():
    out = {}
    for i, (name, plant) in enumerate(CASES.items()):
        out[name] = (plant, _run(i, True, plant), _run(i, False))
    return out


def test_planted_layer_ranks_first_and_beats_the_naive_rules(planted):
    ours, by_mse, by_under, n_material = 0, 0, 0, 0
    for name, (plant, fp8, ctl) in planted.items():
        ranking = rank_layers(fp8, control=ctl)
        assert ranking[0].layer == plant.layer, (name, [(r.layer, round(r.score, 1)) for r in ranking[:3]])
        assert ranking[0].tensor == plant.tensor, name
        assert ranking[0].rank == 1 and not ranking[0].tied, name
        # an outlier only where the plant changed the layer's error by an amount that matters
        # (MATERIAL_MARGINS); a stale scale that only drifts nominates the layer without flagging it
        flagged = [r.layer for r in outliers(ranking)]
        if material(ranking[0]):
            assert flagged[:1] == [plant.layer], name
            n_material += 1
        else:
            assert flagged == [], name
        ours += 1
        by_mse += _naive(fp8, "mse") == plant.layer
        by_under += _naive(fp8, "underflow_pct") == plant.layer
    # the magnitudes span decades and one layer's gradients are heavy-tailed in every run: the
    # naive rules name the largest tensor or the naturally underflowing one
    assert ours == len(CASES) and by_mse < ours and by_under < ours
    # the outliers that destroy elements (the weights' flushed bulk, overflowing gradients, a
    # 1e4-stale activation scale) are material; the 30-300x stale scales are not
    assert n_material == 6


def test_outlier_hiding_damage_is_corroborated_by_its_error(planted):
    """weight-first: one steady element 1e6 x the typical magnitude; SQNR and cos look perfect, the
    other elements are nearly all flushed. Its error of the non-outlier elements stands out; with
    the loss 5% above the control from the plant on (same batches) it is a high finding, with a flat
    loss a layer to watch (statistics nominate, the loss decides)."""
    plant, fp8, ctl = planted["weight-first"]
    # (at the plant's first step the delayed scale predates the outlier, which saturates)
    late = [
        r.stats for r in fp8 if (r.layer, r.tensor) == (plant.layer, plant.tensor) and r.step > plant.start
    ]
    assert min(s["sqnr_db"] for s in late) > 40 and min(s["cos"] for s in late) > 0.9999
    assert min(s["underflow_pct"] for s in late) > 95
    risk = rank_layers(fp8, control=ctl)[0]
    assert risk.layer == plant.layer and risk.z["rel_error_db"] > 2.0  # CORROBORATE_Z
    assert max(s["bulk_sqnr_db"] for s in [risk.stats["weight"]]) < 1.0  # dB, the ordinary elements

    # with a flat loss the layer is still damaged (its ordinary elements flushed on every sampled
    # step): latent damage of medium severity, the layer named, never "healthy"
    flat = diagnose(_rundata("fp8", fp8), _rundata("control", ctl))
    assert flat.kinds() == ["latent_damage"] and flat.top.layers == (plant.layer,)
    assert flat.top.severity == "medium" and flat.verdict.verdict == "fp8_problem"

    rose = diagnose(_rundata("fp8", fp8, rise=(plant.start, 0.05)), _rundata("control", ctl))
    assert rose.kinds()[0] == "mid_training_gap" and rose.top.layers[0] == plant.layer
    outlier = next(f for f in rose.findings if f.kind == "layer_outlier")
    assert outlier.layers == (plant.layer,) and outlier.severity == "high"
    # the onset against its own history: the plant's first step (saturation) or the next (flushing)
    assert plant.start * LOSS_EVERY <= outlier.steps[0] <= (plant.start + 1) * LOSS_EVERY


def _rundata(name, rows, seed=0, rise=None):
    """A run with ``rows``, a loss at every step and a data fingerprint (both runs: the same batches);
    ``rise=(step, rel)``: the loss rises to ``rel`` higher over 20 steps from ``step`` on."""
    rng = np.random.default_rng(seed)
    steps = range(STEPS * LOSS_EVERY)
    loss = {s: (2.0 + math.exp(-s / 30)) * (1 + 0.01 * rng.standard_normal()) for s in steps}
    fp8 = name != "control"
    if fp8:  # the same batches: the FP8 loss follows the control's step to step, with a little own noise
        own = np.random.default_rng(seed + 1)
        loss = {s: v * (1 + 0.002 * own.standard_normal()) for s, v in loss.items()}
    if rise is not None:
        t0 = rise[0] * LOSS_EVERY  # a rise over 20 steps, not a jump (a jump is a spike)
        loss = {s: v * (1 + rise[1] * min(max(s - t0, 0) / 20, 1.0)) for s, v in loss.items()}
    meta = {"config": {"data": {"seed": 0, "order_sha256": "same"}},
            "recipe": {"name": "delayed" if fp8 else "bf16"}}
    rows = [TensorStatsRow(r.step * LOSS_EVERY, r.layer, r.tensor, r.stats, r.variant) for r in rows]
    return RunData(name, {"loss": loss}, rows, meta)


LOSS_EVERY = 10
"""Loss steps per sampled statistics step in :func:`_rundata`."""


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_healthy_runs_flag_no_layer_with_high_severity(seed):
    fp8, ctl = _run(seed, True), _run(seed, False)
    d = diagnose(_rundata("fp8", fp8, seed), _rundata("control", ctl, seed))
    assert not [f for f in d.findings if f.severity == "high"]
    assert d.kinds()[0] in ("healthy", "layer_outlier")


def test_rank_layers_ranks_one_whatif_variant_never_mixed_with_the_main_rows():
    """A BF16 control with what-if nvfp4 rows: by default only its shadow rows count (layer a is
    worst); with ``variant="nvfp4"`` only the nvfp4 rows and their column-wise rows (layer c is
    worst), exactly as if they were a run's own rows."""
    rows = []
    for step in range(6):
        for layer in "abcd":
            rows.append(_row(layer, "activation", step, sqnr=10.0 if layer == "a" else 30.0,
                             variant="shadow"))
            rows.append(_row(layer, "activation", step, sqnr=5.0 if layer == "c" else 20.0, variant="nvfp4"))
            rows.append(_row(layer, "activation", step, under=40.0 if layer == "b" else 1.0,
                             variant="nvfp4_columnwise"))
            rows.append(_row(layer, "activation", step, sqnr=0.0 if layer == "d" else 30.0, variant="mxfp8"))
    assert rank_layers(rows)[0].layer == "a"
    got = rank_layers(rows, variant="nvfp4")
    relabelled = [TensorStatsRow(r.step, r.layer, r.tensor, r.stats, r.variant.replace("nvfp4", "actual"))
                  for r in rows if r.variant in ("nvfp4", "nvfp4_columnwise")]
    want = rank_layers(relabelled)
    assert [(r.layer, r.score, r.tensor) for r in got] == [(r.layer, r.score, r.tensor) for r in want]
    assert {got[0].layer, got[1].layer} == {"b", "c"}  # the two planted, d's mxfp8 rows ignored
    assert {r.tensor for r in got[:2]} == {"activation", "activation_columnwise"}
    assert rank_layers(rows, variant="block") == []


def test_nvfp4_rows_rank_without_the_largest_elements_own_error():
    """E2M1 rows: the row's scale is not the largest element's block scale, so that element's own
    error is unknown (NaN) and the ordinary elements' SQNR is charged all of it."""
    from fp8track.numerics.stats import nvfp4_quant_stats

    torch.manual_seed(0)
    stats = nvfp4_quant_stats(torch.randn(32, 64))
    assert element_format(stats) == "e2m1"
    assert math.isnan(largest_element_error(stats))
    assert bulk_sqnr_db(stats) <= stats["sqnr_db"] + 1e-9
    rows = [TensorStatsRow(s, layer, "activation", nvfp4_quant_stats(torch.randn(16, 64) * (50 if layer == "x"
            and s > 2 else 1) + (torch.arange(64) == 3) * (500.0 if layer == "x" else 0)), "actual")
            for s in range(6) for layer in ("w", "x", "y")]
    assert rank_layers(rows)[0].layer == "x"


def test_block_rows_carry_their_largest_blockwise_dynamic_range_into_the_ranking():
    from fp8track.report.figures import stats_line

    rows = [_row(layer, "activation", s, max_blockwise_dynamic_range=float(s + (layer == "b")))
            for s in range(4) for layer in "ab"]
    rows += [_row("a", "gradient", s) for s in range(4)]  # a per-tensor row has none
    risks = {r.layer: r for r in rank_layers(rows)}
    assert risks["a"].stats["activation"]["max_blockwise_dynamic_range"] == 3.0  # max, not the median
    assert risks["b"].stats["activation"]["max_blockwise_dynamic_range"] == 4.0
    assert "max_blockwise_dynamic_range" not in risks["a"].stats["gradient"]
    assert stats_line(risks["b"].stats["activation"]).endswith("max_blockwise_dynamic_range 4")
    assert "blockwise" not in stats_line(risks["a"].stats["gradient"])

"""The diagnosis on synthetic run directories written with RunWriter: each failure kind planted on
purpose, the healthy case, and the control-relative rules (no fixed thresholds)."""

import json
import math

import numpy as np
import pytest

from fp8track.analysis.diagnose import (
    DiagnosisConfig,
    compare_loss,
    confidence,
    diagnose,
    newly_enabled,
    relative_noise,
)
from fp8track.analysis.synthetic_loss import Curve, healthy, plant_divergence, plant_spike

from helpers.synthetic_runs import EVERY, LAYERS, PLANTED, N, layer_rows, synthetic_pair, write_run


def test_healthy_fp8_run_is_healthy_with_no_layer_outlier(tmp_path):
    d = diagnose(*synthetic_pair(tmp_path))
    assert d.kinds() == ["healthy"]
    assert d.top.severity == "info"
    # |gap| within noise_k control-noise sigmas: the numbers behind the verdict
    ev = d.top.evidence
    # tolerance: 3 standard errors of a 13-step running median (n=300 -> width 13) of the control's noise
    # (not below the 2% band healthy FP8 runs keep against the control: loss_gap.GapConfig.min_gap)
    assert abs(ev["final_gap_rel"]) < ev["tolerance_rel"] == pytest.approx(
        max(3 * 1.2533 * ev["control_noise_rel"] / 13**0.5, 0.02), rel=1e-4)
    assert 0.01 < ev["control_noise_rel"] < 0.03  # the planted 2% multiplicative noise
    assert len(d.layer_ranking) == len(LAYERS)


def test_planted_outlier_layer_with_a_normal_loss_is_a_layer_to_watch(tmp_path):
    """Statistics nominate, the loss decides: the planted layer stands out and is ranked first from
    its own onset, but with a loss like the control's it is named under `healthy` as a layer to
    watch, with its error standing out (SQNR 12 dB against ~30 dB)."""
    d = diagnose(*synthetic_pair(tmp_path, fp8_rows=lambda rng: layer_rows(rng, planted_from=150)))
    assert d.kinds() == ["healthy"]
    f = d.top
    assert f.layers == (PLANTED,)
    watch = f.evidence["watch"]
    assert [(w["layer"], w["tensor"], w["error_stands_out"]) for w in watch] == [
        (PLANTED, "activation", True)
    ]
    assert d.layer_ranking[0].layer == PLANTED
    # the planted layer is judged from its own onset on; the ranking spans every sampled step
    assert d.layer_ranking[0].onset == 150 and d.ranking_window == (0, N - EVERY)
    assert d.layer_ranking[0].stats["activation"]["steps"] == (N - 150) / EVERY
    assert d.layer_ranking[0].stats["activation"]["underflow_pct"] == pytest.approx(18.0, abs=0.5)


def test_divergence_from_start_lists_newly_enabled_options(tmp_path):
    def broken(control, rng):  # a bug breaks training at step 0: the loss never comes down
        return control[0] * (1 + rng.normal(0, 0.02, N))

    precision = {"recipe": "delayed", "fp8_weights": True, "cpu_offloading": True, "torch_compile": False}
    run, ctl = synthetic_pair(
        tmp_path, fp8_loss=broken, fp8_rows=lambda rng: layer_rows(rng, planted_from=0), precision=precision
    )
    d = diagnose(run, ctl)
    assert d.top.kind == "divergence_from_start"
    assert d.top.severity == "high"
    assert d.top.evidence["newly_enabled"] == {
        "recipe": "delayed",
        "fp8_weights": True,
        "cpu_offloading": True,
    }
    exps = d.top.next_experiments
    assert "FP8 recipe" in exps[0] and "FP8 weights" in exps[1] and "CPU offloading" in exps[2]
    assert d.layer_ranking[0].layer == PLANTED
    assert d.loss.phase == "start" and d.loss.onset_step is not None and d.loss.onset_step <= 0.1 * N


def test_mid_training_instability_is_a_mid_training_gap_with_the_planted_layer_first(tmp_path):
    run, ctl = synthetic_pair(
        tmp_path,
        fp8_loss=lambda c, rng: plant_divergence(c * (1 + rng.normal(0, 0.002, N)), 180, 0.004),
        fp8_rows=lambda rng: layer_rows(rng, planted_from=170),
    )
    d = diagnose(run, ctl)
    assert d.top.kind == "mid_training_gap"
    # a runaway rise from 180: loss_gap.judge_gap walks a gradual rise back to the midpoint of its
    # two levels, so the onset lands inside the rise
    assert 180 <= d.top.steps[0] <= 230
    assert d.layer_ranking[0].layer == PLANTED and d.top.layers[0] == PLANTED
    exps = d.top.next_experiments
    # the path's order: BF16 GEMM with FP8 inputs, current scaling, block scaling,
    # BF16 fallback of the top layers
    assert [
        "fp8_input_bf16_gemm" in exps[0],
        "current" in exps[1],
        "mxfp8" in exps[2],
        PLANTED in exps[3],
    ] == [True] * 4
    assert "layer_outlier" in d.kinds()


def test_downstream_drop_with_normal_loss(tmp_path):
    ctl_evals = {s: {"val_acc": 0.60 + 0.1 * s / N} for s in range(59, N, 60)}
    fp8_evals = {s: {"val_acc": v["val_acc"] * (0.7 if s > 200 else 1.0)} for s, v in ctl_evals.items()}
    d = diagnose(*synthetic_pair(tmp_path, fp8_evals=fp8_evals, ctl_evals=ctl_evals))
    assert d.kinds() == ["downstream_drop_with_normal_loss"]
    ev = d.top.evidence["eval"]["val_acc"]
    assert ev["worse_rel"] == pytest.approx(0.3)
    assert ev["higher_is_better"] is True
    assert "check-inference" in d.top.next_experiments[0]


SPIKE_STEPS = (120, 190, 260)


def _spiky(control, rng):
    """The control's loss with a little own noise and 1.5x spikes at :data:`SPIKE_STEPS`."""
    out = control * (1 + rng.normal(0, 0.002, N))
    for s in SPIKE_STEPS:
        out = plant_spike(out, s, 1.5, decay=4.0)
    return out


def test_fp8_only_spikes_name_the_layer_that_jumps(tmp_path):
    spike_steps = SPIKE_STEPS
    run, ctl = synthetic_pair(
        tmp_path, fp8_loss=_spiky, fp8_rows=lambda rng: layer_rows(rng, planted_steps=spike_steps)
    )
    d = diagnose(run, ctl)
    assert d.top.kind == "fp8_only_spikes"
    assert d.top.steps == spike_steps
    assert d.top.layers[0] == PLANTED


def test_fp8_only_spikes_name_a_layer_broken_all_along_that_stands_out(tmp_path):
    """The planted layer is broken from step 40 on (SQNR 12 dB against ~30 dB): at the spikes it does
    not jump against its own history, but it stands out against the other layers: it is named."""
    run, ctl = synthetic_pair(
        tmp_path, fp8_loss=_spiky, fp8_rows=lambda rng: layer_rows(rng, planted_from=40)
    )
    d = diagnose(run, ctl)
    assert d.top.kind == "fp8_only_spikes"
    assert d.top.layers[0] == PLANTED and d.top.evidence["layers_standing_out"][0] == PLANTED
    assert d.top.evidence["layer_jumps"] == [] and "standing out over the run" in d.top.text
    # a layer that jumps at the spikes is named as such, and nothing is "standing out" then
    run, ctl = synthetic_pair(tmp_path / "b", fp8_loss=_spiky,
                     fp8_rows=lambda rng: layer_rows(rng, planted_steps=SPIKE_STEPS))
    assert diagnose(run, ctl).top.evidence["layers_standing_out"] == []


def _noisy_pair(tmp_path, bump: float, paired: bool, seed: int = 5):
    """Batches whose difficulty moves both losses by ~6 % per step (common noise), and an FP8 run
    that follows its control except for a slow excursion of ``bump`` over steps 150-170 (as while a
    delayed scale recovers from one bad amax); the runs record the same data fingerprint when
    ``paired``."""
    from fp8track.monitoring.monitor import data_fingerprint

    rng = np.random.default_rng(seed)
    control = healthy(Curve(start=6.0, floor=2.0, tau=60.0, sigma=0.06), N, rng)
    excursion = np.zeros(N)
    excursion[150:171] = bump * np.sin(np.linspace(0, np.pi, 21))
    fp8 = control * (1 + excursion) * (1 + rng.normal(0, 0.002, N))
    data = data_fingerprint(seed=seed, order=range(N)) if paired else None
    ctl = write_run(tmp_path, "control", control, layer_rows(rng, "shadow"), recipe="bf16", data=data)
    run = write_run(tmp_path, "fp8", fp8, layer_rows(rng), data=data)
    return run, ctl


def test_an_fp8_only_excursion_hidden_in_the_batch_noise_is_found_on_the_paired_ratio(tmp_path):
    # a 15 % bump is 2.5 sigma of the raw loss's batch noise, 70 sigma of the ratio's
    unpaired = diagnose(*_noisy_pair(tmp_path / "a", 0.15, paired=False))
    assert "fp8_only_spikes" not in unpaired.kinds()
    d = diagnose(*_noisy_pair(tmp_path / "b", 0.15, paired=True))
    assert d.loss.unit == "paired"
    assert d.top.kind == "fp8_only_spikes", d.kinds()
    (step,) = d.top.steps
    assert 150 <= step <= 165
    # the same pair without the excursion: nothing to find in either unit
    for paired in (True, False):
        healthy_pair = diagnose(*_noisy_pair(tmp_path / f"h{paired}", 0.0, paired=paired))
        assert healthy_pair.top.kind == "healthy", healthy_pair.kinds()


def test_spikes_in_both_runs_are_shared(tmp_path):
    def both(control):
        return plant_spike(control, 200, 1.5, decay=4.0)

    rng = np.random.default_rng(3)
    control = both(healthy(Curve(start=6.0, floor=2.0, tau=60.0, sigma=0.02), N, rng))
    fp8 = control * (1 + rng.normal(0, 0.002, N))
    ctl = write_run(tmp_path, "control", control, layer_rows(rng, "shadow"), recipe="bf16")
    run = write_run(tmp_path, "fp8", fp8, layer_rows(rng))
    d = diagnose(run, ctl)
    assert "shared_spikes" in d.kinds() and "fp8_only_spikes" not in d.kinds()
    shared = next(f for f in d.findings if f.kind == "shared_spikes")
    assert shared.steps == (200,)


def test_a_layer_hard_in_the_control_too_is_not_an_fp8_outlier(tmp_path):
    rng = np.random.default_rng(0)
    control = healthy(Curve(start=6.0, floor=2.0, tau=60.0, sigma=0.02), N, rng)
    ctl = write_run(tmp_path, "control", control, layer_rows(rng, "shadow", planted_from=0), recipe="bf16")
    run = write_run(tmp_path, "fp8", control * 1.0005, layer_rows(rng, planted_from=0))
    d = diagnose(run, ctl)
    # judged as excess over the same layer in the control, the planted layer is no worse than any other
    planted = next(r for r in d.layer_ranking if r.layer == PLANTED)
    assert all(r.excess for r in d.layer_ranking)
    assert planted.score < 3.0 and planted.stats["activation"]["underflow_pct"] == pytest.approx(
        18.0, abs=0.5
    )
    assert d.kinds() == ["healthy"]  # the model's own property, not FP8's
    # without the control the same rows make it the clear outlier (the peer comparison alone)
    from fp8track.analysis.ranking import rank_layers

    alone = rank_layers(run.tensor_rows)
    assert alone[0].layer == PLANTED and alone[0].score > 10 * alone[1].score


def test_gap_is_judged_in_the_controls_noise_unit():
    rng = np.random.default_rng(0)
    trend = 3.0 + 2.0 * np.exp(-np.arange(4000) / 1000)
    noisy = trend * (1 + 0.01 * rng.standard_normal(4000))
    # 1% white noise, a smooth trend and one huge spike: the estimate is the 1% (+-5% sampling)
    noisy[2000] *= 3
    assert relative_noise(list(noisy)) == pytest.approx(0.01, rel=0.05)
    steps = range(400)
    # hand-worked: alternating +-1% around a constant: |d| = 2/1.01 % or 2/0.99 %, MAD-based sigma
    alt = [3.0 * (1 + (0.01 if s % 2 else -0.01)) for s in range(9)]
    d = np.diff(alt) / np.abs(np.array(alt[:-1]))
    assert relative_noise(alt) == pytest.approx(1.4826 * np.median(np.abs(d - np.median(d))) / math.sqrt(2))
    # the same 6% lasting gap on other batches: alarming against a quiet control, noise against a noisy
    # one (a gap must also end beyond the 5% seed band: loss_gap.GapConfig.seed_band; a 3% one does not)
    quiet = {s: 3.0 * (1 + 0.001 * rng.standard_normal()) for s in steps}
    assert compare_loss({s: v * 1.06 for s, v in quiet.items()}, quiet).onset_step == 0
    assert compare_loss({s: v * 1.03 for s, v in quiet.items()}, quiet).onset_step is None
    loud = {s: 3.0 * (1 + 0.1 * rng.standard_normal()) for s in steps}
    judged = compare_loss({s: v * 1.06 for s, v in loud.items()}, loud)
    assert judged.onset_step is None and judged.unit == "control_noise"
    # the same batches: the paired gap's own noise is the unit; a lasting 6% gap from step 200 stands out
    falling = {s: (3.0 + 2.0 * math.exp(-s / 100)) * (1 + 0.1 * rng.standard_normal()) for s in steps}
    paired = compare_loss({s: v * (1.06 if s >= 200 else 1.0) * (1 + 0.002 * rng.standard_normal())
                           for s, v in falling.items()}, falling, paired=True)
    assert paired.unit == "paired" and paired.phase == "mid"
    assert paired.onset_step == pytest.approx(200, abs=3)
    assert confidence(3.0, 3.0) == 0.05 and confidence(9.0, 3.0) == pytest.approx(1 - math.exp(-2))


def test_newly_enabled_and_json_is_plain(tmp_path):
    fp8 = {
        "recipe": {"name": "current"},
        "config": {
            "precision": {
                "recipe": "current",
                "torch_compile": True,
                "fused_optimizer": "fused",
                "precision": "bf16-mixed",
            }
        },
    }
    ctl = {
        "recipe": {"name": "bf16"},
        "config": {
            "precision": {
                "recipe": None,
                "torch_compile": True,
                "fused_optimizer": None,
                "precision": "bf16-mixed",
            }
        },
    }
    assert newly_enabled(fp8, ctl) == {"recipe": "current", "fused_optimizer": "fused"}
    d = diagnose(*synthetic_pair(tmp_path))
    text = json.dumps(d.to_dict(), allow_nan=False)  # no NaN/inf leaks into diagnosis.json
    assert '"layer_ranking"' in text
    with pytest.raises(ValueError, match="noise_k"):
        DiagnosisConfig(noise_k=0)


def test_a_gap_inside_the_seed_band_needs_a_layer_that_broke_just_before_it(tmp_path):
    """A lasting 3.5 % gap from step 160 ends inside the 5 % seed band: alone it is drift (healthy,
    its onset kept); with a layer whose own history breaks at step 150 it is damage, a mid-training
    gap naming that layer first (``corroborated_by``). A layer breaking long before does not count."""
    step_up = lambda c, rng: c * (1 + rng.normal(0, 0.002, N)) * np.where(np.arange(N) >= 160, 1.035, 1.0)  # noqa: E731
    alone = diagnose(*synthetic_pair(tmp_path / "a", fp8_loss=step_up))
    assert alone.kinds() == ["healthy"] and alone.loss.corroborated_by is None
    assert alone.loss.band_onset_step == pytest.approx(160, abs=6) and not alone.loss.lasting
    broke = diagnose(*synthetic_pair(
        tmp_path / "b", fp8_loss=step_up, fp8_rows=lambda rng: layer_rows(rng, planted_from=150)))
    assert broke.top.kind == "mid_training_gap" and broke.top.layers[0] == PLANTED
    assert broke.loss.corroborated_by == PLANTED and broke.loss.onset_step == pytest.approx(160, abs=6)
    assert "seed band" in broke.top.text
    early = diagnose(*synthetic_pair(
        tmp_path / "c", fp8_loss=step_up, fp8_rows=lambda rng: layer_rows(rng, planted_from=30)))
    assert early.loss.corroborated_by is None and not early.loss.lasting


def test_a_spike_the_control_took_alike_is_shared_even_when_its_detector_missed_it():
    """A batch that spikes both losses is no FP8-only spike because the control's detector (a
    thresholded event) missed its copy by a hair: the control's loss rose over the same steps.
    (A healthy GPT pair sampled every step read "fp8_only_spikes" at a 3.24 -> 3.44 batch the
    control took as 3.24 -> 3.43.)"""
    from fp8track.analysis.baseline import Baseline
    from fp8track.analysis.diagnose.evidence import classify_spikes, control_rose_alike
    from fp8track.analysis.loss_gap import GapConfig, judge_gap
    from fp8track.analysis.spike_events import SpikeEvent

    steps = range(40)
    base = {s: 4.0 - 0.02 * s for s in steps}
    fp8 = dict(base)
    ctl = dict(base)
    fp8[20] += 0.40
    ctl[20] += 0.38  # the control took the same batch alike
    event = SpikeEvent("spike", 20, 20, fp8[20], base[19], 0.01, 40.0, 1, 21, None, "recovered")
    loss = judge_gap(fp8, ctl, True, GapConfig())
    no_ctl_spikes = Baseline("ctl", ctl, ())
    assert control_rose_alike(event, fp8, ctl)
    shared, only = classify_spikes(loss, (event,), no_ctl_spikes, (), 50, fp8)
    assert [e.start_step for e, _ in shared] == [20] and only == []
    # a control that stayed calm at that step: FP8-only, as before
    calm = Baseline("ctl", base, ())
    assert not control_rose_alike(event, fp8, base)
    shared, only = classify_spikes(loss, (event,), calm, (), 50, fp8)
    assert shared == [] and [e.start_step for e, _ in only] == [20]
    # a control that rose a little (a third of the FP8 rise): still FP8-only
    third = dict(base)
    third[20] += 0.13
    assert not control_rose_alike(event, fp8, third)


def test_a_finding_names_no_layer_when_no_layer_stands_out(tmp_path):
    """An evaluation drop with every layer like the others (scores below the anomaly cut): the
    finding and the verdict name no layer rather than the best of a flat ranking. (A GPT pair whose
    planted outlier fell between the monitor's samples every 10 steps headlined blocks.1.mlp.proj,
    risk score 0.8, a layer nothing was wrong with.)"""
    ctl_evals = {s: {"val_acc": 0.60 + 0.1 * s / N} for s in range(59, N, 60)}
    fp8_evals = {s: {"val_acc": v["val_acc"] * (0.7 if s > 200 else 1.0)} for s, v in ctl_evals.items()}
    d = diagnose(*synthetic_pair(tmp_path, fp8_evals=fp8_evals, ctl_evals=ctl_evals))
    assert d.top.kind == "downstream_drop_with_normal_loss"
    assert all(r.score < DiagnosisConfig().outlier_min_score for r in d.layer_ranking)
    assert d.top.layers == () and d.verdict.verdict == "fp8_problem" and d.verdict.layers == ()


def test_an_evaluation_drop_after_a_layer_was_destroyed_in_training_points_at_that_layer(tmp_path):
    """val_acc 30 % worse after step 200 with the loss like the control's, and PLANTED's activation
    flushed (97 % underflow) in training from step 150, before the drop: the first experiment is that
    layer in BF16, then the inference chain (which stays first without a destroyed layer:
    test_downstream_drop_with_normal_loss)."""
    from fp8track.monitoring.records import TensorStatsRow

    def rows(rng):
        out = []
        for r in layer_rows(rng):
            if r.layer == PLANTED and r.tensor == "activation" and r.step >= 150:
                r = TensorStatsRow(r.step, r.layer, r.tensor, {**r.stats, "underflow_pct": 97.0}, r.variant)
            out.append(r)
        return out

    ctl_evals = {s: {"val_acc": 0.60 + 0.1 * s / N} for s in range(59, N, 60)}
    fp8_evals = {s: {"val_acc": v["val_acc"] * (0.7 if s > 200 else 1.0)} for s, v in ctl_evals.items()}
    d = diagnose(*synthetic_pair(tmp_path, fp8_rows=rows, fp8_evals=fp8_evals, ctl_evals=ctl_evals))
    drop = next(f for f in d.findings if f.kind == "downstream_drop_with_normal_loss")
    assert drop.steps[0] > 200
    assert drop.evidence["destroyed_before"] == {"layer": PLANTED, "onset": 150}
    assert drop.next_experiments[0].startswith(f"rerun with {PLANTED} in BF16")
    assert "check-inference" in drop.next_experiments[1]
    assert drop.layers == (PLANTED,) and d.verdict.layers[0] == PLANTED

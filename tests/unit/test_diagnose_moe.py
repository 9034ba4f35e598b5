"""The mixture-of-experts rules on hand-made records: an expert that stands out (and one that stands
out in the control too, which is not FP8's doing), routing that departs from the control, and
healthy MoE pairs that raise neither."""

from __future__ import annotations

import numpy as np

from fp8track.analysis.baseline import RunData
from fp8track.analysis.diagnose import diagnose
from fp8track.analysis.diagnose.rules_moe import expert_outliers, router_departures
from fp8track.monitoring.records import TensorStatsRow

GROUP = "model.layers.1.mlp.experts.gate_up_proj"
STEPS = list(range(0, 200, 5))


def _rows(variant: str, seed: int, plant: dict | None = None, onset: int = 100) -> list[TensorStatsRow]:
    """8 experts' activation rows; ``plant`` overrides one expert's stats from ``onset``."""
    rng = np.random.default_rng(seed)
    out = []
    for step in STEPS:
        for e in range(8):
            stats = {"sqnr_db": 31.0 + rng.normal(0, 0.3), "underflow_pct": 0.0, "overflow_pct": 0.0,
                     "cos": 0.9996, "amax": 3.0 + rng.normal(0, 0.2), "tokens": float(rng.integers(20, 44)),
                     "scale": 140.0, "mse": 1e-3, "scale_drift_log2": 0.0, "nonfinite_pct": 0.0,
                     "current_scale": 140.0, "dynamic_range_log2": 10.0, "amin": 1e-3, "numel": 64.0}
            if plant and e == plant["expert"] and step >= onset:
                stats.update(plant["stats"])
            out.append(TensorStatsRow(step, f"{GROUP}.expert_{e}", "activation", stats, variant))
    return out


def _loss(seed: int) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    return {s: 4.0 - s / 100 + rng.normal(0, 0.01) for s in range(200)}


def _run(name: str, variant: str, rows, router: dict[str, dict[int, float]] | None = None) -> RunData:
    metrics = {"fp8/loss": _loss(0 if variant == "actual" else 1)}
    metrics.update(router or {})
    meta = {"recipe": {"name": "delayed" if variant == "actual" else "bf16"},
            "fp8_layers": ["model.layers.1.mlp.experts"] if variant == "actual" else []}
    return RunData(name, metrics, rows, meta, ())


SATURATED = {"sqnr_db": 8.0, "overflow_pct": 12.0}


def test_expert_outlier_names_the_planted_expert_with_its_onset():
    found = expert_outliers(_rows("actual", 1, {"expert": 5, "stats": SATURATED}))
    assert [(o.expert, o.onset, o.tensor) for o in found] == [(5, 100, "activation")]
    assert (found[0].signal, round(found[0].margin)) in (("error_db", 23), ("overflow_pct", 12))
    assert 0.05 < found[0].token_share < 0.25


def test_small_spread_or_small_margin_is_not_an_outlier():
    # 3 dB worse than its siblings (whose spread is 0.3 dB): z is large but the margin does not matter
    assert expert_outliers(_rows("actual", 2, {"expert": 1, "stats": {"sqnr_db": 28.0}})) == []
    # a single bad step is not an expert that stands out
    rows = _rows("actual", 3, {"expert": 2, "stats": SATURATED}, onset=195)
    assert expert_outliers(rows) == []


def test_diagnosis_raises_expert_outlier_only_when_the_control_does_not_show_it():
    fp8 = _run("fp8", "actual", _rows("actual", 4, {"expert": 3, "stats": SATURATED}))
    control = _run("control", "shadow", _rows("shadow", 5))
    d = diagnose(fp8, control)
    hit = [f for f in d.findings if f.kind == "expert_outlier"]
    assert len(hit) == 1 and hit[0].layers == (f"{GROUP}.expert_3",) and hit[0].steps == (100,)
    assert "healthy" not in d.kinds()
    # the control's same expert stands out on the same data: not an FP8 problem
    control_too = _run("control", "shadow", _rows("shadow", 5, {"expert": 3, "stats": SATURATED}))
    assert "expert_outlier" not in diagnose(fp8, control_too).kinds()


def _router(seed: int, cv_from: int | None = None) -> dict[str, dict[int, float]]:
    rng = np.random.default_rng(seed)
    aux = {s: 1.02 + rng.normal(0, 0.004) for s in STEPS}
    cv = {s: 0.2 + rng.normal(0, 0.02) for s in STEPS}
    if cv_from is not None:
        for s in STEPS:
            if s >= cv_from:
                cv[s] += 0.9
                aux[s] += 0.4
    return {"fp8/router/aux_loss": aux, "fp8/router/worst_load_cv": cv,
            "fp8/router/flip_pct": {s: 0.0 for s in STEPS}}


def test_router_divergence_found_with_onset_and_not_on_healthy_pairs():
    dep = router_departures(_router(1, cv_from=120), _router(2))
    assert {d["stat"] for d in dep} == {"aux_loss", "worst_load_cv"}
    assert all(d["onset"] == 120 for d in dep)
    assert router_departures(_router(3), _router(4)) == []
    fp8 = _run("fp8", "actual", _rows("actual", 6), _router(1, cv_from=120))
    control = _run("control", "shadow", _rows("shadow", 7), _router(2))
    kinds = diagnose(fp8, control).kinds()
    assert "router_divergence" in kinds
    healthy = _run("fp8", "actual", _rows("actual", 8), _router(5))
    assert diagnose(healthy, _run("control", "shadow", _rows("shadow", 9), _router(6))).kinds() == ["healthy"]

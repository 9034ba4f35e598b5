import math

import pytest

from fp8track.analysis.ranking import SIGNALS, outliers, rank_layers, robust_z
from fp8track.errors import ConfigError
from fp8track.monitoring.records import TensorStatsRow


def _row(layer, tensor, step, sqnr=30.0, cos=0.9995, under=1.0, over=0.0, drift=0.0, variant="actual"):
    return TensorStatsRow(step, layer, tensor, {"sqnr_db": sqnr, "cos": cos, "underflow_pct": under,
                                                "overflow_pct": over, "scale_drift_log2": drift,
                                                "mse": 1e-4, "amax": 1.0}, variant)


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


def test_planted_layer_ranks_first_and_is_the_only_outlier():
    rows = []
    for step in range(0, 50, 10):
        for i in range(8):
            for t in ("activation", "weight", "gradient"):
                rows.append(_row(f"blocks.{i}.fc", t, step, sqnr=30 + 0.3 * i, under=1.0 + 0.05 * i))
        # the planted layer: its activation loses 12% to underflow and 15 dB of SQNR
        rows.append(_row("blocks.3.fc", "activation", step + 1, sqnr=15.0, under=12.0))
    rows = [r for r in rows if not (r.layer == "blocks.3.fc" and r.tensor == "activation" and r.step % 10 == 0)]
    ranking = rank_layers(rows)
    assert [r.layer for r in ranking][0] == "blocks.3.fc"
    assert ranking[0].tensor == "activation"
    assert ranking[0].stats["activation"]["underflow_pct"] == 12.0
    assert set(ranking[0].z) == set(SIGNALS)
    assert [r.layer for r in outliers(ranking)] == ["blocks.3.fc"]
    assert len(ranking) == 8


def test_alike_layers_have_no_outlier_and_what_if_rows_are_ignored():
    rows = [_row(f"l{i}", "weight", s, sqnr=30 + 0.01 * i) for i in range(6) for s in range(3)]
    rows.append(_row("l0", "weight", 0, sqnr=-50, variant="mxfp8"))
    ranking = rank_layers(rows)
    assert outliers(ranking) == []
    assert all(r.score < 1.0 for r in ranking)

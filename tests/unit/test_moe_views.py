"""The per-expert tracker view: experts x steps of a statistic and of the load."""

from __future__ import annotations

import numpy as np

from fp8track.monitoring.records import TensorStatsRow
from fp8track.trackers.expert_views import ExpertHeatmap, figure_png, layer_rows

G = "model.layers.1.mlp.experts.gate_up_proj"


def _row(step: int, e: int | None, sqnr: float, tokens: float, tensor: str = "activation") -> TensorStatsRow:
    layer = G if e is None else f"{G}.expert_{e}"
    return TensorStatsRow(step, layer, tensor, {"sqnr_db": sqnr, "tokens": tokens})


def test_heatmap_cells_and_load_share_by_hand():
    view = ExpertHeatmap()
    view.add([
        _row(0, 0, 30.0, 6), _row(0, 1, 20.0, 2),  # expert 2 got no token at step 0: no row
        _row(2, 0, 31.0, 3), _row(2, 1, 21.0, 3), _row(2, 2, 10.0, 2),
        _row(2, None, 25.0, 8),  # the group's aggregate row: not an expert
        _row(2, 0, 99.0, 9, tensor="weight"),  # another tensor kind
        TensorStatsRow(2, f"{G}.expert_0", "activation", {"sqnr_db": 1.0, "tokens": 1}, variant="mxfp8"),
    ])
    steps, stat, load = view.matrices(G)
    assert steps == [0, 2]
    assert np.array_equal(stat, np.array([[30.0, 31.0], [20.0, 21.0], [np.nan, 10.0]]), equal_nan=True)
    assert np.allclose(load, [[75.0, 37.5], [25.0, 37.5], [0.0, 25.0]])
    png = figure_png(view.figure())
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_is_bounded_and_the_most_uneven_groups_are_shown():
    view = ExpertHeatmap(max_steps=4, max_groups=1)
    for step in range(20):
        view.add([_row(step, 0, 30.0, 1), _row(step, 1, 30.0 - step, 1)])
        view.add([TensorStatsRow(step, f"other.experts.down_proj.expert_{e}", "activation",
                                 {"sqnr_db": 30.0, "tokens": 1}) for e in range(2)])
    steps = view.matrices(G)[0]
    assert len(steps) <= 4 and steps[0] == 0 and steps[-1] >= 16
    assert all(b - a == steps[1] - steps[0] for a, b in zip(steps, steps[1:], strict=False))  # evenly thinned
    assert view.groups_shown() == [G]  # expert 1 drifts away from expert 0; the other group is flat


def test_layer_views_leave_one_experts_rows_out():
    rows = [_row(0, 3, 1.0, 1), _row(0, None, 1.0, 1),
            TensorStatsRow(0, "encoder.block.0.layer.1.mlp.experts.expert_2.wi", "activation", {}),
            TensorStatsRow(0, "model.layers.0.self_attn.q_proj", "activation", {})]
    assert [r.layer for r in layer_rows(rows)] == [G, "model.layers.0.self_attn.q_proj"]
    assert ExpertHeatmap().figure() is None

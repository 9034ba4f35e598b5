"""One heatmap: MLflow's ``fp8_heatmap.png`` and the HTML report's heatmap are built from the same
matrix with the same colour limits on the same rows (real MLflow on SQLite; the report reads the
run back from it). Step 0, the warm-up, is left out of both colour scales."""

import io

import matplotlib.image
import numpy as np
import pytest

pytest.importorskip("mlflow")

from fp8track.monitoring.records import RunMeta, StepBatch, TensorStatsRow  # noqa: E402
from fp8track.report.figures import heatmap_figure as report_heatmap  # noqa: E402
from fp8track.trackers.mlflow import HEATMAP_FILE, MLflowTracker, read_mlflow_run  # noqa: E402

LAYERS = ("blocks.0.fc", "blocks.1.fc", "head")
STEPS = (0, 10, 20, 30)
# Underflow %: 100 at the warm-up step (no amax history yet), then 1.05 ... 2.45 after it.
UNDERFLOW = {
    (s, layer): 100.0 if s == 0 else round(1.05 + 0.35 * i + 0.35 * (s - 10) / 10, 2)
    for s in STEPS
    for i, layer in enumerate(LAYERS)
}
# MSE: 1 at the warm-up step, then 1e-4 ... 1e-3 (log10: -4 ... -3).
MSE = {(s, layer): 1.0 if s == 0 else 10.0 ** (-4 + (s - 10) / 20) for s in STEPS for layer in LAYERS}


def _rows(step: int) -> list[TensorStatsRow]:
    return [
        TensorStatsRow(step, layer, "activation", {"underflow_pct": UNDERFLOW[(step, layer)],
                                                   "mse": MSE[(step, layer)]})
        for layer in LAYERS
    ]


def _png_pixels(data: bytes) -> np.ndarray:
    return matplotlib.image.imread(io.BytesIO(data), format="png")


def test_mlflow_heatmap_and_report_heatmap_share_data_and_colour_limits(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(tracking_uri=uri, experiment_name="heatmap", background=False,
                            artifact_location=(tmp_path / "artifacts").as_uri())
    tracker.start(RunMeta(run_id="heat", recipe={"name": "delayed"}, fp8_layers=LAYERS))
    for s in STEPS:
        tracker.log(StepBatch(step=s, metrics={"loss": 4.0 - s / 100}, tensor_rows=_rows(s)))
    tracker.finish()

    # The artifact is the tracker's figure (the same PNG, pixel for pixel).
    figure = tracker.heatmap_figure()
    buf = io.BytesIO()
    figure.savefig(buf, format="png")
    logged = tracker.client.download_artifacts(tracker.run_id, HEATMAP_FILE, str(tmp_path / "dl"))
    with open(logged, "rb") as f:
        np.testing.assert_array_equal(_png_pixels(f.read()), _png_pixels(buf.getvalue()))

    # The report's figure from the run read back from MLflow: same rows, same matrix, same limits.
    back = read_mlflow_run(tracker.run_id, uri).tensor_rows
    assert sorted((r.step, r.layer, r.stats["underflow_pct"]) for r in back) == sorted(
        (s, layer, v) for (s, layer), v in UNDERFLOW.items()
    )
    report = report_heatmap(back, "underflow_pct", "underflow").axes[0]
    mlflow_panel = figure.axes[0]
    assert [t.get_text() for t in mlflow_panel.get_yticklabels()] == [
        t.get_text() for t in report.get_yticklabels()
    ] == [f"{layer}/activation" for layer in LAYERS]
    np.testing.assert_array_equal(mlflow_panel.images[0].get_array(), report.images[0].get_array())
    expected = np.array([[UNDERFLOW[(s, layer)] for s in STEPS] for layer in LAYERS])
    np.testing.assert_array_equal(report.images[0].get_array(), expected)
    # Hand-worked: steps 10-30 span 1.05 (first layer, step 10) to 2.45 (last layer, step 30); the
    # 100 % of step 0 is off the scale in both.
    assert mlflow_panel.images[0].get_clim() == report.images[0].get_clim() == pytest.approx((1.05, 2.45))

    # The MSE panel (MLflow's default second panel) follows the same rule: log10, step 0 left out.
    mse_panel = figure.axes[1]
    assert mse_panel.get_title() == "log10(mse) by layer over steps"
    assert mse_panel.images[0].get_clim() == pytest.approx((-4.0, -3.0))
    np.testing.assert_allclose(mse_panel.images[0].get_array()[:, 0], [0.0, 0.0, 0.0])  # log10(1)

"""The monitor judges each FP8 layer with the scale its backend really used."""

import pytest
import torch
from torch import nn

from fp8track import Monitor, MonitorConfig
from fp8track.execution.apply import apply_fp8
from fp8track.monitoring.records import RunReader
from fp8track.numerics.nvfp4 import max_blockwise_dynamic_range
from fp8track.numerics.stats import block_quant_stats, quant_stats


def _block_row(x: torch.Tensor, layout: str, block: int) -> dict[str, float]:
    """A block row of activation ``x``: the layout's statistics plus TE's LogTensorStats
    max_blockwise_dynamic_range over 1 x ``block`` blocks, both orientations (activations)."""
    dr = max_blockwise_dynamic_range(x, block, 1, max_over_orientations=True)
    return {**block_quant_stats(x, layout), "max_blockwise_dynamic_range": dr}


def _train(recipe, tmp_path, steps=4, whatif=()):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    apply_fp8(model, recipe, backend="emulated")
    layer = model[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, MonitorConfig(every_n_steps=1, whatif=whatif), log_dir=tmp_path).attach()
    used, inputs, grads = [], [], []
    model[2].register_full_backward_hook(lambda m, gi, go: grads.append(gi[0].detach().clone()))
    for step in range(steps):
        x = torch.randn(16, 64) * (1 + step)  # growing amax: delayed scaling lags behind
        inputs.append(x)
        loss = model(x).pow(2).mean()
        loss.backward()
        used.append({k: v.clone() for k, v in layer.fp8_scales().items()})
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad()
    mon.close()
    reader = RunReader(mon.run_dir)
    meta = reader.meta()  # the recipe apply_fp8 used travels with the run
    assert meta["recipe"]["name"] == recipe.split(":")[0]
    assert sorted(meta["fp8_layers"] + meta["bf16_layers"]) == ["0", "2"]
    rows = {(r.step, r.layer, r.tensor, r.variant): r.stats for r in reader.tensor_stats()}
    return rows, used, inputs, grads


def test_delayed_scaling_reports_the_backend_scales(tmp_path):
    rows, used, inputs, _ = _train("delayed:hybrid:h2:max", tmp_path)
    for step in range(4):
        for kind in ("activation", "weight", "gradient"):
            assert rows[(step, "0", kind, "actual")]["scale"] == pytest.approx(
                used[step][kind].item(), rel=1e-7
            )
        # and the activation statistics are exactly those of the input at that scale
        expected = quant_stats(inputs[step], "e4m3", scale=used[step]["activation"])
        assert rows[(step, "0", "activation", "actual")] == pytest.approx(expected)
    # step 0 runs with TE's initial scale 1.0; amax grows each step so the delayed scale is too
    # large for today's tensor afterwards: positive drift (overflow risk) on the activation.
    assert rows[(0, "0", "activation", "actual")]["scale"] == 1.0
    assert rows[(2, "0", "activation", "actual")]["scale_drift_log2"] > 0
    assert rows[(0, "0", "gradient", "actual")]["current_scale"] == pytest.approx(
        57344 / rows[(0, "0", "gradient", "actual")]["amax"]
    )


def test_current_scaling_matches_and_whatif_variants(tmp_path):
    rows, used, inputs, _ = _train("current", tmp_path, steps=2, whatif=("mxfp8", "block"))
    for step in range(2):
        stats = rows[(step, "0", "activation", "actual")]
        assert stats["scale"] == pytest.approx(used[step]["activation"].item(), rel=1e-7)
        assert stats["scale_drift_log2"] == pytest.approx(0.0, abs=1e-6)
        want = _block_row(inputs[step], "mxfp8", 32)
        assert rows[(step, "0", "activation", "mxfp8")] == pytest.approx(want)
        assert rows[(step, "0", "activation", "block")] == pytest.approx(
            _block_row(inputs[step], "block128", 128)
        )
        assert "max_blockwise_dynamic_range" not in rows[(step, "0", "activation", "actual")]


def test_block_recipe_uses_block_scales(tmp_path):
    rows, _, inputs, _ = _train("mxfp8", tmp_path, steps=1)
    assert rows[(0, "0", "activation", "actual")] == pytest.approx(_block_row(inputs[0], "mxfp8", 32))


def test_bf16_recipe_is_shadow(tmp_path):
    rows, _, inputs, _ = _train("bf16", tmp_path, steps=1)
    assert rows[(0, "0", "activation", "shadow")] == pytest.approx(quant_stats(inputs[0], "e4m3"))
    assert not any(k[3] == "actual" for k in rows)

"""The inference chain on a small trained emulated-FP8 model: three variants on the same batches,
exact checkpoint reload (weights and amax histories), a planted wrong scale and a stale weight
detected and named."""

import copy

import pytest
import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.apply import apply_fp8
from fp8track.inference import (
    VARIANTS,
    check_inference,
    compare_states,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    variant_model,
)

LAYERS = ["0", "2", "4", "6"]


def _build(recipe="delayed:hybrid:h16:max"):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 16),
    )
    apply_fp8(model, recipe, backend="emulated")
    return model


def _batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(32, 32, generator=g)
        out.append((x, (x[:, :16].sum(1) > 0).long() + 2 * (x[:, 16:].sum(1) > 0).long()))
    return out


@pytest.fixture(scope="module")
def trained():
    model = _build()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for x, y in _batches(40, seed=2):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_checkpoint_round_trip_restores_weights_and_scaling_state_exactly(trained, tmp_path):
    path = save_checkpoint(trained, tmp_path / "m.ckpt", example="test")
    fresh = _build()
    assert compare_states(trained, fresh)  # a fresh model differs (weights and amax histories)
    ckpt = load_checkpoint(fresh, path)
    assert ckpt["build"] == {"example": "test"}
    assert compare_states(trained, fresh) == []
    hist = trained[2].delayed_scalers["activation"].amax_history
    assert hist.abs().sum() > 0 and torch.equal(fresh[2].delayed_scalers["activation"].amax_history, hist)
    with pytest.raises(ConfigError, match="not an fp8track checkpoint"):
        torch.save({"x": torch.ones(1)}, tmp_path / "other.pt")
        read_checkpoint(tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="does not exist"):
        read_checkpoint(tmp_path / "missing.pt")


def test_stale_weight_and_wrong_scale_in_the_reloaded_model_are_named(trained, tmp_path):
    path = save_checkpoint(trained, tmp_path / "m.ckpt")
    reloaded = _build()
    load_checkpoint(reloaded, path)
    with torch.no_grad():
        reloaded[4].weight.copy_(_build()[4].weight)  # a stale weight: the initial one
    reloaded[2].delayed_scalers["weight"].scale.mul_(8.0)  # a wrong scale
    res = check_inference(reloaded, _batches(), checkpoint=path)
    kinds = {(p.kind, p.layer, p.tensor) for p in res.problems}
    assert ("stale_weight", "4", None) in kinds
    assert ("scaling_state", "2", "weight") in kinds
    mism = {m.name: m for m in res.checkpoint}
    assert set(mism) == {"4.weight", "2/weight"}
    assert mism["2/weight"].kind == "scale"
    assert not res.to_dict()["checkpoint_restored_exactly"]


def test_three_variants_and_a_wrong_inference_scale(trained):
    res = check_inference(trained, _batches())
    assert set(res.metrics) == set(VARIANTS)
    assert res.problems == [] and res.checkpoint == []
    fp8 = {r.layer: r for r in res.layers if r.variant == "fp8_trained_scales"}
    assert list(fp8) == LAYERS  # execution order
    # a healthy trained model: FP8 outputs close to BF16 (e4m3 operands: 20-35 dB), and losses close
    assert all(15 < r.sqnr_db < 45 and r.cos > 0.99 for r in fp8.values())
    assert abs(res.metrics["fp8_trained_scales"] - res.metrics["bf16"]) < 0.05

    broken = copy.deepcopy(trained)
    broken[2].delayed_scalers["activation"].scale.mul_(
        2.0**-16
    )  # inference reads a wrong scale: activations flush to zero
    bad = check_inference(broken, _batches())
    first = bad.problems[0]
    assert (first.kind, first.layer, first.tensor) == ("wrong_scale", "2", "activation")
    check = next(s for s in bad.scales if (s.layer, s.tensor) == ("2", "activation"))
    assert check.drift_log2 == pytest.approx(
        next(s for s in res.scales if (s.layer, s.tensor) == ("2", "activation")).drift_log2 - 16, abs=1e-4)
    assert bad.metrics["fp8_trained_scales"] > bad.metrics["fp8_fresh_scales"] + 0.05
    assert bad.metrics["fp8_fresh_scales"] == pytest.approx(res.metrics["fp8_fresh_scales"])
    out = {r.layer: r for r in bad.layers if r.variant == "fp8_trained_scales"}
    assert out["2"].sqnr_db < fp8["2"].sqnr_db - 10  # the error starts at the planted layer
    assert out["0"].sqnr_db == pytest.approx(fp8["0"].sqnr_db)


def test_variant_models_leave_the_original_alone(trained):
    before = copy.deepcopy(trained.state_dict())
    bf16 = variant_model(trained, "bf16")
    x = _batches(1)[0][0]
    assert torch.allclose(
        bf16(x),
        nn.functional.linear(
            nn.functional.gelu(
                nn.functional.linear(
                    nn.functional.gelu(
                        nn.functional.linear(
                            nn.functional.gelu(nn.functional.linear(x, trained[0].weight, trained[0].bias)),
                            trained[2].weight,
                            trained[2].bias,
                        )
                    ),
                    trained[4].weight,
                    trained[4].bias,
                )
            ),
            trained[6].weight,
            trained[6].bias,
        ),
    )
    fresh = variant_model(trained, "fp8_fresh_scales")
    assert {m.fp8_recipe.name for m in fresh if hasattr(m, "fp8_recipe")} == {"current"}
    assert compare_states(before, trained) == []
    with pytest.raises(ConfigError, match="unknown inference variant 'fp16'"):
        variant_model(trained, "fp16")

import math

import pytest
import torch

from fp8track.errors import ConfigError
from fp8track.numerics.formats import E4M3, E5M2, e8m0_decode, e8m0_encode, get_format, get_format_pair
from fp8track.numerics.scaling import DelayedScaler, current_scale, mx_block_scales, pow2_block_scales


def test_format_limits_match_torch_finfo():
    for fmt in (E4M3, E5M2):
        fi = torch.finfo(fmt.dtype)
        assert fmt.max == fi.max
        assert fmt.smallest_normal == fi.tiny
        smallest = torch.tensor([fmt.smallest_subnormal]).to(fmt.dtype).float().item()
        assert smallest == fmt.smallest_subnormal
        half = torch.tensor([fmt.smallest_subnormal / 2]).to(fmt.dtype).float().item()
        assert half == 0.0  # round-half-to-even to zero
        assert 2.0**fmt.emax <= fmt.max < 2.0 ** (fmt.emax + 1)


def test_unknown_format_names_valid_ones():
    with pytest.raises(ConfigError, match=r"'e3m4'.*'e4m3', 'e5m2'"):
        get_format("e3m4")
    with pytest.raises(ConfigError, match=r"'e5m2'.*'hybrid', 'e4m3'"):
        get_format_pair("e5m2")


def test_hybrid_pair():
    pair = get_format_pair("hybrid")
    assert pair.for_tensor("activation") is E4M3
    assert pair.for_tensor("weight") is E4M3
    assert pair.for_tensor("gradient") is E5M2


def test_e8m0_round_trip():
    exps = torch.tensor([-127, -1, 0, 1, 127])
    codes = e8m0_encode(exps)
    assert codes.tolist() == [0, 126, 127, 128, 254]
    assert e8m0_decode(codes).tolist() == [2.0**-127, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())


def test_current_scale_guards_like_te():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45])
    s = current_scale(amax, "e4m3", margin=1, previous=3.0)
    assert s[0].item() == 448.0 / 2.0 / 2.0
    assert s[1].item() == 3.0 and s[2].item() == 3.0 and s[3].item() == 3.0
    assert s[4].item() == torch.finfo(torch.float32).max


def test_delayed_scaling_hand_worked_sequence():
    # history length 3, algo max, e4m3, margin 0; amaxes 4, 8, 2, 1, 1.
    sc = DelayedScaler("e4m3", history_len=3, algo="max")
    used = []
    for a in (4.0, 8.0, 2.0, 1.0, 1.0):
        _, s = sc.quantize(torch.tensor([a, -a / 2]))
        used.append(s.item())
    # Worked by hand: step 0 uses the initial scale 1; the scale after step k is
    # 448 / max(amax of steps k-2..k) (the window is the last 3 amaxes: TE rolls the history by -1
    # and zeroes slot 0, dropping the oldest). Histories after each update:
    # [0,0,4] [0,4,8] [0,8,2] [0,2,1] [0,1,1].
    assert used == [1.0, 448 / 4, 448 / 8, 448 / 8, 448 / 8]
    assert sc.scale.item() == 448 / 2
    assert sc.amax_history.tolist() == [0.0, 1.0, 1.0]


def test_delayed_scaling_most_recent_and_state_round_trip():
    sc = DelayedScaler("e5m2", history_len=4, algo="most_recent", margin=2)
    for a in (16.0, 4.0):
        sc.quantize(torch.tensor([a]))
    assert sc.scale.item() == 57344 / 4 / 4
    clone = DelayedScaler("e5m2", history_len=4, algo="most_recent", margin=2)
    clone.load_state_dict(sc.state_dict())
    for a in (3.0, 100.0):
        assert sc.quantize(torch.tensor([a]))[1].item() == clone.quantize(torch.tensor([a]))[1].item()


@pytest.mark.parametrize("bad", [{"history_len": 0}, {"algo": "mean"}, {"margin": -1}])
def test_delayed_scaler_rejects_bad_config(bad):
    with pytest.raises(ConfigError):
        DelayedScaler("e4m3", **bad)


def test_mx_block_scales_round_up_like_te():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0])
    scale, codes = mx_block_scales(amax, "e4m3")
    # 448/448 = 1 -> 2^0; 449/448 -> 2^1; 1/448 -> ceil(log2) = -8.
    assert scale.tolist() == [1.0, 0.5, 256.0, 2.0**127]
    assert codes.tolist() == [127, 128, 119, 0]
    assert bool(((amax * scale) <= 448).all())


def test_pow2_block_scales_round_down():
    amax = torch.tensor([1.0, 448.0, 500.0, 0.0])
    assert pow2_block_scales(amax, "e4m3").tolist() == [256.0, 1.0, 0.5, 1.0]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_to_float32_equals_torchs_cast_bit_for_bit(dtype):
    """Every one of the 256 codes (NaNs, signed zeros, subnormals, max), in a non-contiguous view
    and in a shape the emulated GEMMs pass: the same float32 bits as ``q.to(torch.float32)``."""
    from fp8track.numerics.formats import fp8_to_float32

    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    got, want = fp8_to_float32(codes), codes.to(torch.float32)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 and NaN payloads too
    grid = codes[torch.randint(0, 256, (48, 16), generator=torch.Generator().manual_seed(0))]
    for q in (grid, grid.t(), grid[::3, 1:]):
        assert torch.equal(fp8_to_float32(q).view(torch.int32), q.to(torch.float32).view(torch.int32))
        assert fp8_to_float32(q).shape == q.shape


def test_delayed_scaling_skips_nan_like_te():
    # TE's amax kernels reduce with fmaxf / __hmax, which skip NaN: a NaN element must not freeze
    # the scale for amax_history_len steps. Hand-worked, history 4, algo max, e4m3:
    # amaxes 2, 4 (the NaN skipped), 8, 1 -> scales used 1, 224, 112, 56.
    for algo in ("max", "most_recent"):
        sc = DelayedScaler("e4m3", history_len=4, algo=algo)
        used = []
        for x in ([1.0, 2.0], [4.0, float("nan")], [8.0], [1.0]):
            _, s = sc.quantize(torch.tensor(x))
            used.append(s.item())
        assert used == [1.0, 224.0, 112.0, 56.0], (algo, used)
        assert not torch.isnan(sc.amax_history).any()


def test_amax_skips_nan_keeps_inf():
    from fp8track.numerics.scaling import amax

    assert amax(torch.tensor([1.0, float("nan"), -3.0])).item() == 3.0
    assert amax(torch.tensor([float("nan")] * 3)).item() == 0.0
    assert amax(torch.tensor([1.0, -float("inf"), float("nan")])).item() == float("inf")
    assert amax(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)).item() == 1.0


def test_pow2_block_scale_of_subnormal_block_like_te():
    # TE's compute_scale_from_types: 448 / amax overflows float32 -> FLT_MAX -> mantissa cleared
    # -> 2**127 (not 1, which flushes the whole block to zero).
    from fp8track.numerics.scaling import pow2_block_scales
    from fp8track.numerics.stats import block_quant_stats

    amax_b = torch.tensor([[1e-39], [0.0], [float("inf")], [448.0]])
    assert pow2_block_scales(amax_b, "e4m3").reshape(-1).tolist() == [2.0**127, 1.0, 1.0, 1.0]
    x = torch.full((2, 128), 1e-39)
    s = block_quant_stats(x, "block128", "e4m3")
    assert s["underflow_pct"] == 0.0 and s["scale"] == 2.0**127

"""Shares of a distributed tensor (in one process; the multi-process runs are in
tests/integration/test_sharded.py)."""

import math

import pytest
import torch

from fp8track.errors import ConfigError
from fp8track.monitoring.plans import shadow_plan, tensor_partial
from fp8track.monitoring.sharding import ShardSpec, Share, share_of
from fp8track.numerics.stats import STAT_NAMES, finalize, merge_partials, quant_stats


def _tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 29, generator=g) * 5.0
    x[::4] *= 1e-5  # underflow under the whole tensor's scale, not under a slice's own
    return x


@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 7])
def test_copies_split_the_work_and_merge_to_the_whole_tensor(pieces):
    x = _tensor()
    plan = shadow_plan("layer")
    parts = [
        tensor_partial(x, plan, "activation", share=Share(x, piece=c, pieces=pieces)) for c in range(pieces)
    ]
    got = finalize(merge_partials(parts), "e4m3")
    want = quant_stats(x, "e4m3")
    assert got["numel"] == x.numel()
    for stat in STAT_NAMES:
        assert got[stat] == pytest.approx(want[stat], rel=1e-6), stat


def test_slices_use_the_whole_tensor_scale():
    # A slice judged with its own current scale differs from the whole tensor's statistics: the
    # test above would catch a slice that forgot the global scale.
    x = _tensor()
    piece = x.reshape(-1).tensor_split(4)[1]
    whole_scale = quant_stats(x, "e4m3")["scale"]
    assert quant_stats(piece, "e4m3")["scale"] != whole_scale
    share = Share(x, piece=1, pieces=4)
    assert torch.equal(share.part(), piece)
    assert share.scale("e4m3", 0).item() == pytest.approx(whole_scale, rel=0)


def test_block_recipes_take_the_first_copy_whole():
    x = _tensor()
    plan = shadow_plan("layer")
    first = tensor_partial(x, plan, "weight", "mxfp8", Share(x, piece=0, pieces=2))
    other = tensor_partial(x, plan, "weight", "mxfp8", Share(x, piece=1, pieces=2))
    assert finalize(first, "e4m3")["numel"] == x.numel()
    assert other[0].item() == 0 and other[-4].item() == -math.inf  # the empty partial


def test_single_process_share_is_the_whole_tensor():
    x = _tensor()
    share = share_of(x, "weight", None)
    assert share.trivial and share.local is x and share.scale("e4m3", 0) is None


def test_spec_validation():
    with pytest.raises(ConfigError, match="global"):
        ShardSpec(scale="per_shard")
    with pytest.raises(ConfigError, match="need a mesh"):
        ShardSpec(data_dims=("dp",))

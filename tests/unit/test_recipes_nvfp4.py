"""The ``nvfp4`` recipe in the grammar: TE's NVFP4BlockScaling defaults and switches."""

from __future__ import annotations

import pytest

from fp8track.errors import ConfigError
from fp8track.execution.recipes import Recipe, recipe_choices
from fp8track.numerics.nvfp4 import NVFP4Options, NVFP4Recipe


def test_defaults_follow_te_qparams() -> None:
    r = Recipe.from_string("nvfp4")
    assert "nvfp4" in recipe_choices()
    assert r.fp8_format == "e4m3" and r.scaling == "nvfp4" and r.gemm_mode == "fp8"
    assert r.formats.forward.name == "e2m1" and r.formats.backward.max == 6.0
    nv = r.nvfp4
    assert nv == NVFP4Recipe(rht=True, stochastic_rounding=True, tile_2d=True)
    # fp4_quant_fwd_inp: RHT on the column-wise copy only, no SR, 1-D
    assert nv.options("activation") == NVFP4Options()
    assert nv.options("activation", columnwise=True) == NVFP4Options(rht=True)
    # fp4_quant_fwd_weight: 16x16, never RHT or SR (either orientation)
    assert nv.options("weight") == nv.options("weight", columnwise=True) == NVFP4Options(tile_2d=True)
    # fp4_quant_bwd_grad: SR both ways, RHT column-wise
    assert nv.options("gradient") == NVFP4Options(stochastic=True)
    assert nv.options("gradient", columnwise=True) == NVFP4Options(stochastic=True, rht=True)
    assert Recipe("delayed").nvfp4 is None


@pytest.mark.parametrize(
    ("text", "field"),
    [("nvfp4:no_rht", "rht"), ("nvfp4:no_sr", "stochastic_rounding"), ("nvfp4:no_2d", "tile_2d")],
)
def test_each_switch_turns_one_part_off(text: str, field: str) -> None:
    r = Recipe.from_string(text)
    assert getattr(r.nvfp4, field) is False
    others = {"rht", "stochastic_rounding", "tile_2d"} - {field}
    assert all(getattr(r.nvfp4, f) for f in others)
    assert Recipe.from_string(r.to_string()) == r
    assert Recipe.from_dict(r.to_dict()) == r


def test_all_switches_and_round_trip() -> None:
    r = Recipe.from_string("nvfp4:no_rht:no_sr:no_2d")
    assert r.to_string().endswith(":no_rht:no_sr:no_2d")
    assert r.nvfp4.options("gradient", columnwise=True) == NVFP4Options()
    assert r.nvfp4.options("weight") == NVFP4Options()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("nvfp4:hybrid", "E4M3 block scales only"),
        ("delayed:no_rht", r"disable_rht=True \(no_rht\) does not apply to recipe 'delayed'"),
        ("mxfp8:no_2d", "does not apply to recipe 'mxfp8'"),
        ("nvfp4:no_sr:no_sr", "gives disable_stochastic_rounding twice"),
        ("nvfp4:h16", "does not apply to recipe 'nvfp4'"),
        ("nvfp4:rht", "cannot parse token 'rht'.*no_rht"),
    ],
)
def test_bad_nvfp4_strings_name_the_value(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Recipe.from_string(text)


def test_switch_must_be_bool() -> None:
    with pytest.raises(ConfigError, match="disable_rht must be True or False"):
        Recipe("nvfp4", disable_rht="yes")

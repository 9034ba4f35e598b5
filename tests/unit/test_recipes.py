import pytest

from fp8track.errors import ConfigError
from fp8track.execution.recipes import RECIPE_NAMES, RECIPE_OPTIONS, Recipe


def test_defaults_match_transformer_engine_delayed_scaling():
    r = Recipe()
    assert (r.name, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin) == (
        "delayed",
        "hybrid",
        1024,
        "max",
        0,
    )
    assert r.formats.forward.name == "e4m3" and r.formats.backward.name == "e5m2"


@pytest.mark.parametrize(
    ("name", "te_format", "gradient_format"),
    [
        # transformer_engine/common/recipe/__init__.py: each class's fp8_format default
        ("delayed", "hybrid", "e5m2"),  # DelayedScaling: Format.HYBRID
        ("current", "hybrid", "e5m2"),  # Float8CurrentScaling: Format.HYBRID
        ("mxfp8", "e4m3", "e4m3"),  # MXFP8BlockScaling: Format.E4M3
        ("block", "e4m3", "e4m3"),  # Float8BlockScaling: Format.E4M3
        ("fp8_input_bf16_gemm", "hybrid", "e5m2"),  # current scaling
    ],
)
def test_each_recipe_defaults_to_its_transformer_engine_format(name, te_format, gradient_format):
    r = Recipe(name)
    assert r.fp8_format == te_format
    assert r.formats.for_tensor("gradient").name == gradient_format
    assert Recipe.from_string(name) == r == Recipe(name, te_format)
    assert Recipe.from_string(f"{name}:hybrid").fp8_format == "hybrid"  # still selectable
    assert Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    "kwargs, bad, valid",
    [
        ({"name": "fp4"}, "'fp4'", "'mxfp8'"),
        ({"fp8_format": "e5m2"}, "'e5m2'", "'hybrid'"),
        ({"amax_compute_algo": "mean"}, "'mean'", "'most_recent'"),
        ({"amax_history_len": 0}, "0", ">= 1"),
        ({"amax_history_len": 2.5}, "2.5", ">= 1"),
        ({"margin": -1}, "-1", ">= 0"),
        ({"gemm": "fp16"}, "'fp16'", "'bf16'"),
    ],
)
def test_bad_values_fail_at_construction_naming_valid_ones(kwargs, bad, valid):
    with pytest.raises(ConfigError) as err:
        Recipe(**kwargs)
    assert bad in str(err.value) and valid in str(err.value)


def test_contradictions_are_rejected():
    with pytest.raises(ConfigError, match="BF16 GEMM"):
        Recipe("fp8_input_bf16_gemm", gemm="fp8")
    with pytest.raises(ConfigError, match="e4m3"):
        Recipe("current", variant="rowwise")
    with pytest.raises(ConfigError, match="only exists for recipe 'current'"):
        Recipe("delayed", fp8_format="e4m3", variant="rowwise")


def test_from_string_grammar():
    r = Recipe.from_string("delayed:hybrid:h16:max")
    assert r == Recipe("delayed", "hybrid", 16, "max", 0)
    r = Recipe.from_string("delayed:e4m3:most_recent:h1:m2:gemm=bf16")
    assert (r.fp8_format, r.amax_compute_algo, r.amax_history_len, r.margin, r.gemm) == (
        "e4m3",
        "most_recent",
        1,
        2,
        "bf16",
    )
    assert r.gemm_mode == "bf16"
    with pytest.raises(ConfigError, match="cannot parse token 'x16'"):
        Recipe.from_string("delayed:x16")
    with pytest.raises(ConfigError, match="valid values"):
        Recipe.from_string("fancy")


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_round_trips(name):
    options = {
        "amax_history_len": 7,
        "margin": 1,
        "amax_compute_algo": "most_recent",
        "gemm": "bf16",
        "fp8_format": "e4m3",
    }
    r = Recipe(name, **{k: v for k, v in options.items() if k in RECIPE_OPTIONS[name]})
    assert Recipe.from_string(r.to_string()) == r
    assert Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    ("text", "field", "valid"),
    [
        ("mxfp8:m2", "margin=2", "hybrid|e4m3, gemm=fp8|bf16"),
        ("block:most_recent", "amax_compute_algo='most_recent'", "hybrid|e4m3, gemm=fp8|bf16"),
        ("current:h16", "amax_history_len=16", "hybrid|e4m3, m<N>, gemm=fp8|bf16, variant=<torchao variant>"),
        ("bf16:gemm=fp8", "gemm='fp8'", "its options are: hybrid|e4m3"),
        ("fp8_input_bf16_gemm:h4", "amax_history_len=4", "hybrid|e4m3, m<N>, gemm=fp8|bf16"),
    ],
)
def test_an_option_that_does_not_apply_to_the_recipe_is_refused(text, field, valid):
    with pytest.raises(ConfigError) as info:
        Recipe.from_string(text)
    msg = str(info.value)
    assert field in msg and repr(text.split(":")[0]) in msg and valid in msg
    with pytest.raises(ConfigError, match="does not apply"):  # the same through keywords
        Recipe.from_dict(
            dict([("name", text.split(":")[0]), ("margin", 3)])
            if "m2" in text
            else {"name": "current", "amax_history_len": 16}
        )


@pytest.mark.parametrize(
    ("text", "twice"),
    [
        ("delayed:hybrid:e4m3", "fp8_format"),
        ("delayed:h16:h8", "amax_history_len"),
        ("current:m1:m2", "margin"),
        ("delayed:max:most_recent", "amax_compute_algo"),
    ],
)
def test_an_option_given_twice_is_refused(text, twice):
    with pytest.raises(ConfigError, match=f"gives {twice} twice"):
        Recipe.from_string(text)


def test_canonical_strings_of_every_recipe_still_parse():
    # to_string writes every field; the inapplicable ones at their defaults are accepted.
    for name in RECIPE_NAMES:
        assert Recipe.from_string(f"{name}:h1024:max:m0") == Recipe(name)


def test_aliases_and_megatron_keys():
    assert Recipe.from_string("tensorwise").name == "current"
    assert Recipe.from_string("blockwise").name == "block"
    rw = Recipe.from_string("rowwise")
    assert (rw.name, rw.variant, rw.fp8_format) == ("current", "rowwise", "e4m3")
    r = Recipe.from_dict(
        {
            "--fp8-recipe": "delayed",
            "fp8_amax_history_len": 1,
            "fp8-amax-compute-algo": "most_recent",
            "fp8_margin": 0,
        }
    )
    assert r == Recipe("delayed", amax_history_len=1, amax_compute_algo="most_recent")
    with pytest.raises(ConfigError, match="unknown recipe key 'history'"):
        Recipe.from_dict({"history": 3})


def test_derived_properties():
    assert Recipe("bf16").quantizes is False and Recipe("bf16").gemm_mode == "none"
    assert Recipe("fp8_input_bf16_gemm").scaling == "current"
    assert Recipe("fp8_input_bf16_gemm").gemm_mode == "bf16"
    assert Recipe("mxfp8").gemm_mode == "fp8"
    assert Recipe.parse("current:e4m3") == Recipe("current", "e4m3")
    with pytest.raises(ConfigError):
        Recipe.parse(3)


def test_scale_warmup_steps_follow_the_recipe():
    from fp8track.execution.recipes import Recipe, scale_warmup_steps

    assert scale_warmup_steps(Recipe("delayed").to_dict()) == 1024  # TE's DelayedScaling default
    assert scale_warmup_steps(Recipe.parse("delayed:h16").to_dict()) == 16
    assert scale_warmup_steps({"name": "delayed"}) == 1024
    for name in ("current", "mxfp8", "block", "nvfp4", "bf16"):
        assert scale_warmup_steps(Recipe(name).to_dict()) == 0
    assert scale_warmup_steps(None) == 0

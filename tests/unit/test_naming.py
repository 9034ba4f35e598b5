import re

import pytest

from fp8track.errors import ConfigError
from fp8track.monitoring.naming import MAX_NAME_LEN, metric_name, run_metric, sanitize_segment, worst_metric

MLFLOW_OK = re.compile(r"^[A-Za-z0-9_\-. /]+$")


def test_exact_names():
    assert (
        metric_name("blocks.0.attn.qkv", "activation", "underflow_pct")
        == "fp8/blocks.0.attn.qkv/activation/underflow_pct"
    )
    assert metric_name("lm_head", "gradient", "underflows%") == "fp8/lm_head/gradient/underflows_pct"
    assert metric_name("", "weight", "mse") == "fp8/model/weight/mse"
    assert run_metric("spikes", "count") == "fp8/spikes/count"
    assert run_metric("loss_gap_vs_baseline") == "fp8/loss_gap_vs_baseline"
    assert worst_metric("mse") == "fp8/worst/mse"


def test_bad_characters_and_empty_segments():
    assert sanitize_segment("a:b[c]") == "a_b_c_"
    assert sanitize_segment("") == "_"
    assert "//" not in metric_name("x", "weight", "")
    with pytest.raises(ConfigError, match="'grad'.*'activation', 'weight', 'gradient'"):
        metric_name("x", "grad", "mse")


def test_long_names_are_bounded_and_distinct():
    a = metric_name("layer" * 80 + ".a", "weight", "mse")
    b = metric_name("layer" * 80 + ".b", "weight", "mse")
    assert len(a) <= MAX_NAME_LEN and len(b) <= MAX_NAME_LEN
    assert a != b
    assert MLFLOW_OK.match(a) and a.startswith("fp8/") and a.endswith("/weight/mse")


# --- canonical layer names -----------------------------------------------------------------------

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from fp8track.monitoring.naming import (  # noqa: E402
    WRAPPER_SEGMENTS,
    canonical_layer_name,
    canonical_layer_names,
    holder_prefix,
)

WRAPPED = [
    ("blocks.0.attn.qkv", "blocks.0.attn.qkv"),
    ("_orig_mod.blocks.0.attn.qkv", "blocks.0.attn.qkv"),  # torch.compile(model)
    ("blocks.0._orig_mod.attn.qkv", "blocks.0.attn.qkv"),  # a compiled submodule
    ("module.blocks.0.attn.qkv", "blocks.0.attn.qkv"),  # DDP
    ("_orig_mod.module.blocks.0.attn.qkv", "blocks.0.attn.qkv"),  # compiled DDP
    ("module._orig_mod.blocks.0.attn.qkv", "blocks.0.attn.qkv"),  # DDP of a compiled model
    ("_forward_module.blocks.0.attn.qkv", "blocks.0.attn.qkv"),  # Fabric
    ("_forward_module.module.blocks.0.attn.qkv", "blocks.0.attn.qkv"),  # Fabric + DDP
    ("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn.qkv", "blocks.0.attn.qkv"),  # FSDP1 per block
    ("blocks.0._checkpoint_wrapped_module.attn.qkv", "blocks.0.attn.qkv"),  # checkpoint_wrapper
    (
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer",
        "model.layers.0.self_attn.q_proj",
    ),  # peft LoRA
    (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default",
        "model.layers.0.self_attn.q_proj.lora_A.default",
    ),
    ("_orig_mod", ""),  # a compiled single Linear: the root's own name
    ("", ""),
]


@pytest.mark.parametrize(("name", "want"), WRAPPED)
def test_canonical_layer_name_drops_wrappers_and_is_idempotent(name, want):
    assert canonical_layer_name(name) == want
    assert canonical_layer_name(want) == want
    assert canonical_layer_name(canonical_layer_name(name)) == want


def test_user_names_that_look_like_wrappers_inside_a_model_are_kept():
    # "module" and "base_model.model" are wrappers only at the start; inside a model they are the user's
    assert canonical_layer_name("encoder.module.fc") == "encoder.module.fc"
    assert canonical_layer_name("heads.base_model.model.fc") == "heads.base_model.model.fc"
    assert canonical_layer_name("module") == "module"  # a layer registered as `self.module`
    # model. is a holder only when the caller says so (HF models name their own `model.` child)
    assert canonical_layer_name("model.layers.0.mlp.up_proj") == "model.layers.0.mlp.up_proj"
    assert (
        canonical_layer_name("model.model.layers.0.mlp.up_proj", holder="model")
        == "model.layers.0.mlp.up_proj"
    )
    assert canonical_layer_name("model", holder="model") == "model"  # never to an empty name
    assert set(WRAPPER_SEGMENTS) >= {
        "_orig_mod",
        "_forward_module",
        "_fsdp_wrapped_module",
        "_checkpoint_wrapped_module",
    }


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


class _Holder(pl.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.model = net


class _OwnLayers(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = _Net()
        self.extra = nn.Linear(2, 2)  # a layer outside the held model: names stay whole


def _gemm_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_lightning_holder_and_plain_loop_give_the_same_names():
    net = _Net()
    plain = canonical_layer_names(net, _gemm_names(net))
    assert plain == ["blocks.0", "blocks.2", "head"]
    held = _Holder(_Net())
    assert _gemm_names(held)[0] == "model.blocks.0" and holder_prefix(held, _gemm_names(held)) == "model"
    assert canonical_layer_names(held, _gemm_names(held)) == plain
    compiled = torch.compile(_Holder(_Net()))  # the LightningModule compiled: found through _orig_mod
    assert _gemm_names(compiled)[0] == "_orig_mod.model.blocks.0"
    assert canonical_layer_names(compiled, _gemm_names(compiled)) == plain
    assert canonical_layer_names(torch.compile(net), _gemm_names(torch.compile(net))) == plain
    own = _OwnLayers()
    assert holder_prefix(own, _gemm_names(own)) == ""
    assert canonical_layer_names(own, _gemm_names(own)) == [
        "model.blocks.0",
        "model.blocks.2",
        "model.head",
        "extra",
    ]
    # a plain (non-Lightning) module holding a model keeps its names: only Lightning's holder is known
    wrapper = nn.ModuleDict({"model": _Net()})
    assert canonical_layer_names(wrapper, _gemm_names(wrapper))[0] == "model.blocks.0"


def test_select_layers_records_canonical_names_and_accepts_either_name():
    from fp8track.monitoring.selection import select_layers

    held = torch.compile(_Holder(_Net()))
    assert [n for n, _ in select_layers(held)] == ["blocks.0", "blocks.2", "head"]
    assert [n for n, _ in select_layers(held, "head")] == ["head"]
    assert [n for n, _ in select_layers(held, "_orig_mod.model.blocks")] == ["blocks.0", "blocks.2"]
    assert [n for n, _ in select_layers(held, "re:^blocks")] == ["blocks.0", "blocks.2"]
    with pytest.raises(ConfigError, match="blocks.0, blocks.2, head"):
        select_layers(held, "nothere")


def test_a_lightning_module_whose_layers_sit_in_a_sequential_keeps_its_names():
    class Body(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))

    m = Body()
    assert holder_prefix(m, _gemm_names(m)) == ""
    assert canonical_layer_names(m, _gemm_names(m)) == ["body.0", "body.2"]

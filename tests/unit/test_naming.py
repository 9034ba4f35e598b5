import re

import pytest

from fp8track.errors import ConfigError
from fp8track.monitoring.naming import MAX_NAME_LEN, metric_name, run_metric, sanitize_segment, worst_metric

MLFLOW_OK = re.compile(r"^[A-Za-z0-9_\-. /]+$")


def test_exact_names():
    assert metric_name("blocks.0.attn.qkv", "activation", "underflow_pct") == "fp8/blocks.0.attn.qkv/activation/underflow_pct"
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

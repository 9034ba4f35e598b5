"""Guarantee 8: fuzzing with hypothesis. Statistics over random shapes, dtypes and scales (0,
subnormal, huge, inf, NaN) never raise and count exactly; the recipe and fallback parsers accept
or refuse with a ConfigError, never crash; the run-directory reader survives truncated and
corrupted files and accounts for every line."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fp8track.errors import ConfigError  # noqa: E402
from fp8track.execution.fallback import FallbackSpec  # noqa: E402
from fp8track.execution.recipes import Recipe  # noqa: E402
from fp8track.monitoring.records import (  # noqa: E402
    EVENTS_FILE,
    METRICS_FILE,
    TENSOR_STATS_FILE,
    EventRecord,
    MetricsRecord,
    RunMeta,
    RunReader,
    RunWriter,
    TensorStatsRow,
)
from fp8track.numerics.stats import finalize, partial_stats  # noqa: E402

FUZZ = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

SPECIAL = [
    0.0,
    -0.0,
    1e-45,
    -1e-42,
    1e-39,
    3e38,
    -3e38,
    1e300,
    math.inf,
    -math.inf,
    math.nan,
    1.0,
    -448.0,
    57344.0,
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    n = math.prod(shape)
    scale = draw(st.sampled_from([0.0, 1e-40, 1e-20, 1e-3, 1.0, 1e4, 1e30]))
    values = draw(
        st.lists(
            st.one_of(st.sampled_from(SPECIAL), st.floats(-4, 4).map(lambda v: v * scale)),
            min_size=n,
            max_size=n,
        )
    )
    dtype = draw(st.sampled_from(DTYPES))
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)


@FUZZ
@given(x=tensors(), fmt=st.sampled_from(["e4m3", "e5m2"]))
def test_statistics_never_raise_and_count_exactly(x, fmt):
    stats = finalize(partial_stats(x, fmt), fmt)
    ref = x.to(torch.float32).double()  # statistics are defined on the float32 upcast
    finite = ref[torch.isfinite(ref)]
    assert stats["numel"] == x.numel()
    assert stats["nonfinite_pct"] == pytest.approx(100 * (x.numel() - finite.numel()) / x.numel())
    assert stats["amax"] == pytest.approx(finite.abs().max().item() if finite.numel() else 0.0, rel=1e-6)
    for name in ("underflow_pct", "overflow_pct"):
        assert 0.0 <= stats[name] <= 100.0, (name, stats)
    assert -1.0 <= stats["cos"] <= 1.0 and not math.isnan(stats["mse"]) and stats["mse"] >= 0, stats


RECIPE_TOKENS = [
    "delayed",
    "current",
    "mxfp8",
    "block",
    "bf16",
    "hybrid",
    "e4m3",
    "e5m2",
    "h0",
    "h16",
    "h1024",
    "max",
    "most_recent",
    "m0",
    "m3",
    "gemm=fp8",
    "gemm=bf16",
    "variant=rowwise",
    "x",
    "",
    "::",
    "h-1",
]


@FUZZ
@given(
    spec=st.one_of(st.lists(st.sampled_from(RECIPE_TOKENS), max_size=6).map(":".join), st.text(max_size=30))
)
def test_recipe_parser_accepts_or_refuses_cleanly(spec):
    try:
        recipe = Recipe.parse(spec)
    except ConfigError as exc:
        assert str(exc)
        return
    assert Recipe.parse(recipe.to_string()) == recipe  # what it accepts round-trips


FALLBACK_TERMS = [
    "none",
    "first",
    "last",
    "first_last",
    "first:2",
    "last:0",
    "first_last:x",
    "auto:3",
    "re:fc.*",
    "re:(",
    "lm_head",
    "blocks.0.fc1",
    "",
    " ",
    "auto:",
]


@FUZZ
@given(
    spec=st.one_of(st.lists(st.sampled_from(FALLBACK_TERMS), max_size=5).map(",".join), st.text(max_size=30))
)
def test_fallback_parser_accepts_or_refuses_cleanly(spec):
    try:
        parsed = FallbackSpec.parse(spec)
    except ConfigError as exc:
        assert str(exc)
        return
    assert FallbackSpec.parse(list(parsed.terms)) == parsed


def _write_run(root) -> int:
    writer = RunWriter(root, RunMeta(run_id="fuzz"))
    for s in range(12):
        writer.write_metrics(MetricsRecord(s, {"loss": 1.0 / (s + 1)}))
        writer.write_tensor_stats([TensorStatsRow(s, "fc", "weight", {"mse": 0.1 * s, "amax": math.inf})])
        writer.write_events([EventRecord("spike", s, {"severity": s})])
    writer.close()
    return 12


@FUZZ
@given(
    file=st.sampled_from([METRICS_FILE, TENSOR_STATS_FILE, EVENTS_FILE]),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=6),
    garbage=st.lists(st.binary(max_size=40), max_size=3),
)
def test_reader_survives_truncated_and_corrupted_files(tmp_path_factory, file, cut, flips, garbage):
    root = tmp_path_factory.mktemp("run")
    n = _write_run(root)
    path = root / file
    data = bytearray(path.read_bytes())
    for pos, byte in flips:
        data[int(pos * (len(data) - 1))] = byte
    data = data[: int(cut * len(data))] if cut < 0.95 else data
    data += b"".join(g.replace(b"\n", b"") + b"\n" for g in garbage)
    path.write_bytes(bytes(data))
    reader = RunReader(root)
    read = {METRICS_FILE: reader.metrics, TENSOR_STATS_FILE: reader.tensor_stats, EVENTS_FILE: reader.events}[
        file
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = list(read())
        list(reader.series("loss"))
    lines = [ln for ln in bytes(data).split(b"\n")]
    non_empty = sum(1 for ln in lines[:-1] if ln.strip()) + (1 if lines[-1] else 0)
    # every line is a record or a reported problem; nothing else
    assert len(records) + len(reader.problems) == non_empty
    if not flips and not garbage:  # pure truncation: a prefix of what was written, torn tail reported
        assert [r.step for r in records] == list(range(len(records))) and len(records) <= n
        assert all(p.kind == "torn_last_line" for p in reader.problems)


def test_reader_reports_a_half_written_last_line_once(tmp_path):
    _write_run(tmp_path)
    with open(tmp_path / METRICS_FILE, "ab") as f:
        f.write(json.dumps({"step": 12, "metrics": {"loss": 0.07}}).encode()[:17])
    reader = RunReader(tmp_path)
    with pytest.warns(RuntimeWarning, match="torn_last_line"):
        assert sorted(reader.series("loss")) == list(range(12))
    list(reader.metrics())
    assert [(p.file, p.line, p.kind) for p in reader.problems] == [(METRICS_FILE, 13, "torn_last_line")]

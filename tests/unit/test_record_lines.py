"""The run directory's JSON lines (:func:`fp8track.monitoring.records._dumps`): orjson writes plain
data, ``json`` the rest; either way a line parses to what ``json.dumps(obj, default=str)`` holds,
non-finite floats included (orjson alone would write them as ``null``)."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import pathlib
import struct

import pytest

from fp8track.monitoring.records import _ENCODER, RunMeta, RunReader, RunWriter, TensorStatsRow, _dumps

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _parsed(line: str):
    # NaN != NaN: compare non-finite constants by their spelling
    return json.loads(line, parse_constant=lambda c: f"<{c}>")


_leaf = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(2**80), max_value=2**80)  # past 64 bits orjson refuses: json writes it
    | st.text(max_size=8)
    | st.booleans()
    | st.none()
)
_data = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    | st.dictionaries(st.integers(-5, 5), kids, max_size=2),  # non-string keys: json's str() of them
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_data)
def test_a_line_holds_what_json_dumps_holds(obj):
    assert _parsed(_dumps(obj)) == _parsed(_ENCODER.encode(obj))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=13))
def test_finite_floats_come_back_bit_for_bit(values):
    row = {"step": 3, "layer": "blocks.0.mlp.fc", "stats": {f"s{i}": v for i, v in enumerate(values)}}
    back = json.loads(_dumps(row))["stats"]
    bits = [struct.pack("<d", back[f"s{i}"]) for i in range(len(values))]
    assert bits == [struct.pack("<d", v) for v in values]


def test_what_orjson_would_write_otherwise_is_written_as_json_writes_it():
    @dataclasses.dataclass
    class Point:
        x: int = 1

    class Half(float):
        pass

    Pair = collections.namedtuple("Pair", "x y")
    for obj, want in [
        ({"a": math.nan, "b": math.inf, "c": -math.inf}, '{"a":NaN,"b":Infinity,"c":-Infinity}'),
        ({"a": [1.5, (math.nan, None)], "b": "null", "c": {"d": -math.inf}},
         '{"a":[1.5,[NaN,null]],"b":"null","c":{"d":-Infinity}}'),
        ({"a": Pair(1, 2.5)}, '{"a":[1,2.5]}'),
        ({"a": Point()}, '{"a":"' + str(Point()) + '"}'),  # default=str, not {"x":1}
        ({"a": pathlib.Path("/tmp/x")}, '{"a":"/tmp/x"}'),
        ({"a": Half(0.5)}, '{"a":0.5}'),
        ({1: 2.5}, '{"1":2.5}'),
        ({"a": 2**70}, '{"a":1180591620717411303424}'),
    ]:
        assert _dumps(obj) == want


def test_rows_with_non_finite_statistics_read_back_as_written(tmp_path):
    meta = RunMeta(run_id="r")
    writer = RunWriter.create(tmp_path, meta)
    rows = [
        TensorStatsRow(0, "fc", "activation", {"amax": 3.25, "sqnr_db": math.inf, "cos": math.nan}, "actual"),
        TensorStatsRow(0, "fc", "weight", {"amax": 0.125, "sqnr_db": 31.5, "cos": 0.999}, "actual"),
    ]
    writer.write_tensor_stats(rows)
    writer.close()
    back = list(RunReader(tmp_path / "r").tensor_stats())
    assert [r.stats["amax"] for r in back] == [3.25, 0.125]
    assert back[0].stats["sqnr_db"] == math.inf and math.isnan(back[0].stats["cos"])
    assert back[1].stats == {"amax": 0.125, "sqnr_db": 31.5, "cos": 0.999}

"""Transformer Engine on a GPU: `make test-gpu` (< 5 minutes on one H200).

Skipped, at module level only, where CUDA or a working Transformer Engine is missing. Anywhere
else an error is a failure: no check turns an exception into a skip. Each check runs
tests/gpu/te_checks.py in its own process (TE's debug API must be initialised before the first TE
module exists, and nvdlfw_inspect's state is process-global) and the assertions live here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from fp8track.execution.backends import te as te_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_backend.available(), reason="needs CUDA and Transformer Engine"),
]

SCRIPT = Path(__file__).with_name("te_checks.py")
REL = 1e-5


def run_check(name: str, tmp_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), name, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads((tmp_path / "result.json").read_text())


def _index(rows: list[dict]) -> dict:
    return {(r["step"], r["layer"], r["tensor"], r["variant"]): r["stats"] for r in rows}


def _close(a: float, b: float, rel: float = REL, abs_: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8track_matches_te_log_fp8_tensor_stats(recipe, tmp_path):
    res = run_check(recipe, tmp_path)
    assert res["fp8_layers"] == ["0", "2"] and res["bf16_layers"] == ["4"]
    ours, te = _index(res["ours"]), _index(res["te"])
    pairs = [("underflow_pct", "underflow_pct"), ("mse", "mse")]
    if recipe == "delayed":
        pairs.append(("overflow_pct", "overflow_pct"))
    compared = 0
    for step in range(3):
        for layer in res["fp8_layers"]:
            for tensor in ("activation", "weight", "gradient"):
                mine, theirs = ours[(step, layer, tensor, "actual")], te[(step, layer, tensor, "actual")]
                for a, b in pairs:
                    assert _close(mine[a], theirs[b], abs_=1e-6 if a.endswith("pct") else 1e-12), (
                        step,
                        layer,
                        tensor,
                        a,
                        mine[a],
                        theirs[b],
                    )
                    compared += 1
    assert compared == 3 * 2 * 3 * len(pairs)
    # The fallback layer: shadow rows from fp8track, nothing from TE (no quantizer there).
    assert all((s, "4", t, "shadow") in ours for s in range(3) for t in ("activation", "weight", "gradient"))
    assert not any(k[1] == "4" for k in te)


def test_te_fp8_differs_from_the_unquantised_model_as_fp8track_emulates_it(tmp_path):
    res = run_check("reference", tmp_path)
    for recipe, r in res.items():
        # FP8 changes the output (E4M3 has 3 mantissa bits: ~1-10 % relative error here)...
        assert 1e-3 < r["te_vs_ref"] < 0.15, (recipe, r)
    # ...and, under current scaling (no history to differ in), fp8track's emulation quantises the
    # same operands the same way: much closer to TE than either is to the unquantised model.
    r = res["current"]
    assert r["em_vs_ref"] == pytest.approx(r["te_vs_ref"], rel=0.1), r
    assert r["te_vs_em"] < 0.25 * r["te_vs_ref"], r


def test_transformer_layer_has_rows_for_qkv_proj_fc1_fc2(tmp_path):
    res = run_check("transformer_layer", tmp_path)
    gemms = ["layernorm_mlp.fc1", "layernorm_mlp.fc2", "self_attention.layernorm_qkv", "self_attention.proj"]
    assert res["captures"] == gemms
    ours, te = _index(res["ours"]), _index(res["te"])
    for step in range(2):
        for g in gemms:
            for t in ("activation", "weight", "gradient"):
                stats = ours[(step, g, t, "actual")]
                assert stats["numel"] > 0 and math.isfinite(stats["mse"]), (step, g, t)
        # qkv's activation is ln_out, the tensor TE quantises: same amax as TE's own LogTensorStats.
        mine = ours[(step, "self_attention.layernorm_qkv", "activation", "actual")]["amax"]
        theirs = te[(step, "self_attention.layernorm_qkv", "activation", "actual")]["amax"]
        assert _close(mine, theirs), (mine, theirs)


def test_native_te_model_is_planned_after_its_first_forward(tmp_path):
    res = run_check("native", tmp_path)
    assert res["scaling"] == "per_tensor" and res["has_scale_fns"] == ["activation", "gradient", "weight"]
    ours = _index(res["ours"])
    for step in range(3):
        assert ours[(step, "0", "activation", "actual")]["scale"] == pytest.approx(
            res["used"][step], rel=1e-7
        )


@pytest.mark.parametrize("kind", ["fit_fp8track", "fit_lightning"])
def test_trainer_fit_logs_rows_for_every_linear(kind, tmp_path):
    res = run_check(kind, tmp_path)
    assert len(res["linears"]) == 3
    assert all(mod.startswith(("transformer_engine", "fp8track")) for mod in res["module_kinds"].values())
    seen = defaultdict(set)
    for r in res["ours"]:
        if r["stats"]["numel"] > 0:
            seen[r["step"]].add((r["layer"], r["tensor"]))
    want = {(n, t) for n in res["linears"] for t in ("activation", "weight", "gradient")}
    assert sorted(seen) == [0, 5, 10, 15]
    assert all(seen[s] == want for s in seen), {s: want - seen[s] for s in seen}

"""Diagnosis benchmark: planted FP8 faults with checked ground truth, scored like a paper would.

    python bench/diagnosis_bench.py                    # full set, writes bench/results_diagnosis.json
    python bench/diagnosis_bench.py --subset ci        # the CI handful
    python bench/diagnosis_bench.py --families gpt,llama --out /tmp/r.json

Every scenario (bench/diagnosis_scenarios.py) trains an FP8 run and its BF16 control with the real
:class:`fp8track.Monitor`, checks that the planted phenomenon really happened (from the training
loop's own losses and evaluations; the BF16 model untouched by the plant), then calls the public
diagnosis, ``fp8track.analysis.diagnose.diagnose(load_run(fp8), load_run(control))``, and scores:

* finding kind: the top finding's kind is the expected one; the expected kind is among the findings;
* planted layer top-1 / top-3 in the diagnosis's layer ranking (and the first layer the top
  finding names), for scenarios whose fault sits in one layer;
* false alarms: healthy pairs with any non-healthy finding of severity high or medium;
* the naive rules "highest max underflow" and "highest max MSE" over the FP8 run's tensor-stats
  rows, scored on the same layers.

Two ground truths, both measured in the training loop, never by the diagnosis: the loss phenomenon
(``verified``; kind accuracy and false alarms are scored on these) and, for single-layer plants, the
planted layer's broken GEMM (``layer_verified``: its error against float32 at least 0.3 and 3x any
other layer's; layer rankings are scored on these, since one broken layer of a small model need not
move the loss). Scenarios verified neither way are reported and excluded from the scores. Run
directories are cached under ``--cache-dir`` by a hash of each run's configuration, so a rerun only
re-diagnoses (docs/diagnosis.md, "Diagnosis benchmark").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import diagnosis_scenarios as ds  # noqa: E402

DEFAULT_OUT = HERE / "results_diagnosis.json"
DEFAULT_CACHE = HERE / ".diagnosis_cache"
ALARM_SEVERITIES = ("high", "medium")
PREFIXES = ("base_model.model.", "_forward_module.", "_orig_mod.", "module.", "model.")
"""Wrapper prefixes stripped before layer names are compared (Lightning, DDP, compile, PEFT, HF)."""


# --- scoring (pure) --------------------------------------------------------------------------------


def canonical(name: str) -> str:
    """``name`` without leading wrapper prefixes (:data:`PREFIXES`), repeatedly."""
    changed = True
    while changed:
        changed = False
        for p in PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def rank_of(layers: Sequence[str], planted: str) -> int | None:
    """1-based position of ``planted`` in ``layers`` (names compared canonically), None if absent."""
    target = canonical(planted)
    seen: list[str] = []
    for name in layers:
        c = canonical(name)
        if c in seen:
            continue
        seen.append(c)
        if c == target:
            return len(seen)
    return None


def naive_ranking(rows: Iterable[Any], stat: str) -> list[str]:
    """Layers by the largest value of ``stat`` over all their ``actual`` rows (every step and tensor
    kind), highest first; ties keep name order. Rows need ``layer``, ``variant`` and ``stats``."""
    best: dict[str, float] = {}
    for r in rows:
        if getattr(r, "variant", "actual") != "actual":
            continue
        v = r.stats.get(stat)
        if v is None or not math.isfinite(float(v)):
            continue
        best[r.layer] = max(best.get(r.layer, -math.inf), float(v))
    return sorted(best, key=lambda k: (-best[k], k))


def diagnosis_layers(diag: Any) -> list[str]:
    """The diagnosis's layer ranking, riskiest first (``Diagnosis.ranking`` or ``layer_ranking``)."""
    ranking = getattr(diag, "ranking", None)
    if ranking is None:
        ranking = getattr(diag, "layer_ranking", ())
    return [r.layer for r in ranking]


def finding_layers(findings: Sequence[Any]) -> list[str]:
    """Layers named by the first non-healthy finding that names any."""
    for f in findings:
        if f.kind != "healthy" and f.layers:
            return list(f.layers)
    return []


def false_alarm(findings: Sequence[Any]) -> bool:
    """Any non-healthy finding of severity high or medium."""
    return any(f.kind != "healthy" and f.severity in ALARM_SEVERITIES for f in findings)


def score_row(expected: str, kinds: Sequence[str], layers: Mapping[str, Sequence[str]] | None,
              planted: str | None, alarm: bool, accepted: Sequence[str] = ()) -> dict[str, Any]:
    """Scores of one verified scenario: ``kind_top`` (the top finding's kind is ``expected`` or one
    of ``accepted``, the kinds the ground truth found), ``kind_among`` (``expected`` is among the
    findings); per layer answer in ``layers`` (``diagnosis``, ``finding``, ``naive_underflow``,
    ``naive_mse``) its rank and top-1/top-3; and ``false_alarm`` for healthy pairs."""
    ok = {expected, *accepted}
    out: dict[str, Any] = {"kind_top": bool(kinds) and kinds[0] in ok, "kind_among": expected in kinds}
    if planted is not None and layers is not None:
        for key, names in layers.items():
            r = rank_of(names, planted)
            out[f"{key}_rank"] = r
            out[f"{key}_top1"] = r == 1
            out[f"{key}_top3"] = r is not None and r <= 3
    if expected == "healthy":
        out["false_alarm"] = alarm
    return out


HEALTHY_KINDS = ("healthy", "shared_spikes")
"""Scenarios whose right verdict is ``healthy`` (FP8 caused nothing; shared spikes are notes)."""
LAYER_FINDINGS = ("layer_outlier", "latent_damage", "expert_outlier")
CALIBRATION_BINS = ((0.0, 0.7), (0.7, 0.9), (0.9, 1.0))
"""Confidence bins of the reliability table (the last one closed: confidence 1.0 belongs to it)."""


def expected_verdict(kind: str) -> str:
    return "healthy" if kind in HEALTHY_KINDS else "fp8_problem"


def verdict_scores(expected_kind: str, verdict: str, verdict_layers: Sequence[str], planted: str | None,
                   layer_verified: bool) -> dict[str, Any]:
    """``verdict_right``; for a verified single-layer plant: ``causal_top1`` (the verdict names the
    planted layer first), ``headline_not_cause`` (the verdict names another layer first: a
    consequence or a bystander as the headline) and ``destroyed_called_healthy``."""
    out: dict[str, Any] = {"verdict": verdict, "verdict_right": verdict == expected_verdict(expected_kind)}
    if planted is not None and layer_verified:
        first = canonical(verdict_layers[0]) if verdict_layers else None
        out["causal_top1"] = verdict == "fp8_problem" and first == canonical(planted)
        out["headline_not_cause"] = first is not None and first != canonical(planted)
        out["destroyed_called_healthy"] = verdict == "healthy"
    return out


def finding_right(kind: str, layers: Sequence[str], expected_kind: str, accepted: Sequence[str],
                  planted: str | None, layer_verified: bool) -> bool:
    """Whether one finding is right, for the calibration table: ``healthy`` on a pair whose FP8 run
    caused nothing; any other kind among the truth's accepted kinds, or a layer finding on a pair
    with an FP8 problem; and, where it names layers and the plant's layer is verified, the planted
    layer first."""
    if kind == "healthy":
        return expected_kind in HEALTHY_KINDS
    ok_kind = kind in {expected_kind, *accepted} or (
        kind in LAYER_FINDINGS and expected_kind not in HEALTHY_KINDS)
    if not ok_kind:
        return False
    if layers and planted is not None and layer_verified:
        return canonical(layers[0]) == canonical(planted)
    return True


def calibration(findings: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The reliability table: per confidence bin (:data:`CALIBRATION_BINS`), how many findings and
    the share that were right (``findings``: dicts with ``confidence`` and ``right``)."""
    out = []
    for i, (lo, hi) in enumerate(CALIBRATION_BINS):
        last = i == len(CALIBRATION_BINS) - 1
        inside = [f for f in findings if lo <= f["confidence"] < hi or (last and f["confidence"] == hi)]
        right = sum(bool(f["right"]) for f in inside)
        out.append({"confidence": [lo, hi], "n": len(inside), "right": right,
                    "share_right": round(right / len(inside), 3) if inside else None})
    return out


LAYER_KEYS = ("diagnosis", "finding", "top_finding", "naive_underflow", "naive_mse")
"""The layer answers scored: the diagnosis's ranking; the layers the first non-healthy finding
names; the layers the top finding names, whatever its kind (``healthy`` names its layers to
watch); the naive rules."""


def totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts and shares: kind accuracy and false alarms over the rows whose loss phenomenon is
    verified (``verified``); layer top-1/top-3 per answer over the single-layer plants whose damage
    to the planted layer is verified (``layer_verified``: its GEMM error, measured in the training
    loop), whether or not that one layer moved the loss; and the same layer scores over the rows
    verified both ways (``..._loss_verified``)."""
    ok = [r for r in rows if r["verified"]]
    planted = [r for r in rows if "diagnosis_rank" in r["score"]]
    layer_rows = [r for r in planted if r.get("layer_verified")]
    healthy = [r for r in ok if r["expected_kind"] == "healthy"]

    def share(k: int, n: int) -> dict[str, Any]:
        return {"n": n, "hits": k, "share": round(k / n, 3) if n else None}

    out: dict[str, Any] = {
        "scenarios": len(rows),
        "verified": len(ok),
        "not_materialised": [r["name"] for r in rows if not r["verified"]],
        "kind_top": share(sum(r["score"]["kind_top"] for r in ok), len(ok)),
        "kind_among": share(sum(r["score"]["kind_among"] for r in ok), len(ok)),
        "false_alarms": share(sum(r["score"]["false_alarm"] for r in healthy), len(healthy)),
    }
    out["layer_scored"] = [r["name"] for r in layer_rows]
    out["layer_not_verified"] = [r["name"] for r in planted if not r.get("layer_verified")]
    both = [r for r in layer_rows if r["verified"]]
    for key in LAYER_KEYS:
        for k in ("top1", "top3"):
            out[f"{key}_{k}"] = share(sum(r["score"][f"{key}_{k}"] for r in layer_rows), len(layer_rows))
            out[f"{key}_{k}_loss_verified"] = share(sum(r["score"][f"{key}_{k}"] for r in both), len(both))
    out["verdict_right"] = share(sum(r["score"]["verdict_right"] for r in ok), len(ok))
    causal = [r for r in layer_rows if "causal_top1" in r["score"]]
    out["causal_top1"] = share(sum(r["score"]["causal_top1"] for r in causal), len(causal))
    out["headline_not_cause"] = [r["name"] for r in causal if r["score"]["headline_not_cause"]]
    out["destroyed_called_healthy"] = [r["name"] for r in causal if r["score"]["destroyed_called_healthy"]]
    out["calibration"] = calibration([f for r in ok for f in r["diagnosis"]["findings"]])
    by_kind: dict[str, Any] = {}
    for r in ok:
        d = by_kind.setdefault(r["expected_kind"], {"n": 0, "kind_top": 0})
        d["n"] += 1
        d["kind_top"] += int(r["score"]["kind_top"])
    out["by_kind"] = by_kind
    return out


# --- running -----------------------------------------------------------------------------------------


def _worker_init(stats_kernel: str) -> None:
    import torch

    from fp8track.numerics.kernel_policy import set_compile

    torch.set_num_threads(1)
    set_compile(stats_kernel)  # the training processes run the statistics kernel their caller runs
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _run_cached(spec: ds.RunSpec, cache: Path) -> dict[str, Any]:
    """Train ``spec`` unless its cache entry (``<cache>/<key>/result.json``) exists."""
    d = cache / spec.key()
    res = d / "result.json"
    if res.is_file():
        data = json.loads(res.read_text())
        if Path(data["run_dir"]).is_dir():
            return data
    data = ds.train_run(spec, d / "runs")
    d.mkdir(parents=True, exist_ok=True)
    res.write_text(json.dumps(data))
    return data


def _bf16_cached(spec: ds.RunSpec, cache: Path) -> dict[str, Any]:
    f = cache / spec.key() / "bf16_check.json"
    if f.is_file():
        return json.loads(f.read_text())
    out = ds.bf16_unaffected(spec)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(out))
    return out


def train_all(specs: Sequence[ds.RunSpec], cache: Path, jobs: int) -> dict[str, dict[str, Any]]:
    """Every distinct run, in ``jobs`` processes; cached ones are read back."""
    unique = {s.key(): s for s in specs}
    if jobs <= 1:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny GEMMs run best on one thread
        try:
            return {k: _run_cached(s, cache) for k, s in unique.items()}
        finally:
            torch.set_num_threads(threads)
    import multiprocessing as mp

    from fp8track.numerics.kernel_policy import get_compile

    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                             initargs=(get_compile(),)) as pool:
        futs = {k: pool.submit(_run_cached, s, cache) for k, s in unique.items()}
        return {k: f.result() for k, f in futs.items()}


def evaluate_scenario(sc: ds.Scenario, fp8: Mapping[str, Any], ctl: Mapping[str, Any],
                      bf16_check: Mapping[str, Any]) -> dict[str, Any]:
    """Ground truth, the diagnosis through its public entry, naive rules and scores of one scenario."""
    from fp8track.analysis.baseline import load_run
    from fp8track.analysis.diagnose import diagnose
    from fp8track.monitoring.records import RunReader

    truth = ds.ground_truth(sc, fp8, ctl, bf16_check)
    t0 = time.perf_counter()
    diag = diagnose(load_run(fp8["run_dir"]), load_run(ctl["run_dir"]))
    seconds = time.perf_counter() - t0
    findings = list(diag.findings)
    kinds = [f.kind for f in findings]
    planted = fp8["planted_layers"][0] if sc.scores_layer else None
    rows = list(RunReader(fp8["run_dir"]).tensor_stats())
    answers = {
        "diagnosis": diagnosis_layers(diag),
        "finding": finding_layers(findings),
        "top_finding": list(findings[0].layers) if findings else [],
        "naive_underflow": naive_ranking(rows, "underflow_pct"),
        "naive_mse": naive_ranking(rows, "mse"),
    }
    plant = sc.fp8.plant
    return {
        "name": sc.name,
        "family": sc.fp8.family,
        "recipe": sc.fp8.recipe,
        "seed": sc.fp8.seed,
        "expected_kind": sc.expected_kind,
        "tags": list(sc.tags),
        "plant": None
        if plant is None
        else {
            "mechanism": plant.mechanism,
            "tensor": plant.tensor,
            "position": plant.position,
            "windows": [list(w) for w in plant.windows],
            "log2": plant.log2,
            "layers": fp8["planted_layers"],
        },
        "data_spikes": list(sc.fp8.data_spikes),
        "eval_fault_log2": sc.fp8.eval_fault_log2,
        "verified": truth["materialised"],
        "layer_verified": truth["layer_verified"],
        "ground_truth": truth,
        "diagnosis": {
            "findings": [
                {
                    "kind": f.kind,
                    "severity": f.severity,
                    "confidence": round(f.confidence, 3),
                    "layers": list(f.layers)[:3],
                    "right": finding_right(f.kind, f.layers, sc.expected_kind, truth["accepted_kinds"],
                                           planted, truth["layer_verified"]),
                }
                for f in findings
            ],
            "verdict": {"verdict": diag.verdict.verdict, "reason": diag.verdict.reason,
                        "layers": list(diag.verdict.layers)[:3]},
            "ranking_top5": answers["diagnosis"][:5],
            "seconds": round(seconds, 3),
        },
        "naive_top3": {k: answers[k][:3] for k in ("naive_underflow", "naive_mse")},
        "score": {
            **score_row(
                sc.expected_kind,
                kinds,
                answers if planted else None,
                planted,
                false_alarm(findings),
                truth["accepted_kinds"],
            ),
            **verdict_scores(sc.expected_kind, diag.verdict.verdict, diag.verdict.layers, planted,
                             truth["layer_verified"]),
        },
        "train_seconds": {"fp8": round(fp8["seconds"], 1), "control": round(ctl["seconds"], 1)},
    }


def run(subset: str = "full", families: Sequence[str] | None = None, cache: Path = DEFAULT_CACHE,
        jobs: int = 2) -> dict[str, Any]:
    """Train (or read back), check, diagnose and score every selected scenario."""
    t0 = time.perf_counter()
    scs = ds.select(subset, families)
    runs = train_all([s.fp8 for s in scs] + [s.control() for s in scs], cache, jobs)
    t_train = time.perf_counter() - t0
    rows = []
    for sc in scs:
        rows.append(
            evaluate_scenario(sc, runs[sc.fp8.key()], runs[sc.control().key()], _bf16_cached(sc.fp8, cache))
        )
    import fp8track

    return {
        "benchmark": "fp8track diagnosis",
        "subset": subset,
        "families": sorted({s.fp8.family for s in scs}),
        "fp8track_version": fp8track.__version__,
        "entry": "fp8track.analysis.diagnose.diagnose(load_run(fp8), load_run(control))",
        "thresholds": {
            "gap_min": ds.GAP_MIN,
            "track_max": ds.TRACK_MAX,
            "spike_min": ds.SPIKE_MIN,
            "data_spike_min": ds.DATA_SPIKE_MIN,
            "eval_drop_min": ds.EVAL_DROP_MIN,
        },
        "totals": totals(rows),
        "scenarios": rows,
        "seconds": {"train_or_cache": round(t_train, 1), "total": round(time.perf_counter() - t0, 1)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/diagnosis_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subset", choices=("full", "ci"), default="full")
    p.add_argument(
        "--families", default=",".join(ds.FAMILIES), help=f"comma list of {', '.join(ds.FAMILIES)}"
    )
    p.add_argument(
        "--out", default=None, help=f"JSON output (default {DEFAULT_OUT} for the full set, none for ci)"
    )
    p.add_argument(
        "--cache-dir", default=str(DEFAULT_CACHE), help="run-directory cache (keyed by run config hash)"
    )
    p.add_argument("--jobs", type=int, default=2, help="training processes")
    args = p.parse_args(argv)
    fams = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in fams if f not in ds.FAMILIES]
    if bad or args.jobs < 1:
        print(
            f"error: unknown families {bad}; valid: {', '.join(ds.FAMILIES)}"
            if bad
            else "error: --jobs must be >= 1",
            file=sys.stderr,
        )
        return 2
    warnings.filterwarnings("ignore")  # library chatter of transformers/torchao; the JSON is the output
    result = run(args.subset, fams, Path(args.cache_dir).resolve(), args.jobs)
    text = json.dumps(result, indent=1, default=str)
    out = args.out or (str(DEFAULT_OUT) if args.subset == "full" and set(fams) == set(ds.FAMILIES) else None)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Diagnosis benchmark on mixture-of-experts models: planted expert and routing faults, healthy pairs.

A tiny Hugging Face Mixtral (8 experts, top-2, 2 layers, 64 wide) is trained on the byte data of
the dense benchmark (``diagnosis_scenarios.batches``) twice per scenario, FP8 (emulated, experts run
as FP8 grouped GEMMs with one quantizer per expert) and its BF16 control on the same batches, each
recorded by the real ``fp8track.Monitor``; then ``fp8track.analysis.diagnose.diagnose`` judges them.

Plants, all in the FP8 run only:

* ``expert_scale``: delayed scaling; from step ``PLANT_AT`` one expert's scale of one tensor of the
  ``gate_up_proj`` grouped GEMM is multiplied by ``2**8`` before each step (a corrupted restore of
  that expert's quantizer), so its elements above ``amax / 256`` clip: that expert's activations
  (or weight) saturate, its siblings are untouched.
* ``router_underflow``: from ``PLANT_AT`` the router's input is quantised to E4M3 with a scale
  ``2**-20`` too small (an FP8 router whose scale underflows): most of it flushes to zero, the router
  logits collapse towards ties, routing concentrates on few experts.

Ground truth, measured by this script with plain torch, never by the monitor:

* an expert plant is *verified* when, over the plant's steps, the planted expert's GEMM relative
  error (``||q(x) q(W)^T - x W^T|| / ||x W^T||`` with the quantizer's real per-expert scales, cast by
  hand) is at least ``DAMAGE_MIN`` and ``DAMAGE_RATIO`` times every other expert's of that group;
* a routing plant when the FP8 run's load coefficient of variation (from the routing the experts
  really received) exceeds the control's median by at least ``COLLAPSE_MIN``;
* a healthy pair when the smoothed FP8/control loss ratio stays within 3 %.

Scoring: the expert plants' ``expert_outlier`` finding names the planted expert (top-1 among expert
findings) beside two naive rules over the expert rows (highest max overflow share, lowest min
SQNR); the routing plants raise ``router_divergence``; healthy pairs raise no MoE finding and get the
healthy verdict. Prints JSON; ``--out`` writes it (bench/results_moe_diagnosis.json).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import diagnosis_scenarios as ds  # noqa: E402

ds.BATCH = 8  # 512 tokens a step: 8 experts x top-2 still see ~128 rows each
import fp8track  # noqa: E402
from fp8track.analysis.baseline import load_run  # noqa: E402
from fp8track.analysis.diagnose import diagnose  # noqa: E402

STEPS = 120
EVERY = 4
PLANT_AT = 48
E, K = 8, 2
DAMAGE_MIN, DAMAGE_RATIO, COLLAPSE_MIN = 0.3, 3.0, 0.3
MOE_KINDS = ("expert_outlier", "router_divergence")


@dataclass(frozen=True)
class Scenario:
    name: str
    recipe: str
    seed: int = 0
    plant: str | None = None  # "expert_scale" | "router_underflow"
    layer: int = 0
    expert: int = 0
    tensor: str = "activation"


def scenarios() -> list[Scenario]:
    return [
        Scenario("healthy_current_s0", "current", 0),
        Scenario("healthy_current_s1", "current", 1),
        Scenario("healthy_delayed_s0", "delayed:hybrid:h16:max", 0),
        Scenario("expert_activation_L0_e2", "delayed:hybrid:h16:max", 0, "expert_scale", 0, 2, "activation"),
        Scenario("expert_activation_L1_e5", "delayed:hybrid:h16:max", 1, "expert_scale", 1, 5, "activation"),
        Scenario("expert_weight_L1_e1", "delayed:hybrid:h16:max", 0, "expert_scale", 1, 1, "weight"),
        Scenario("router_underflow_L1", "current", 0, "router_underflow", 1),
        Scenario("router_underflow_L0", "current", 1, "router_underflow", 0),
    ]


def build(seed: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.MixtralConfig(vocab_size=ds.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ds.BLOCK,
                           num_local_experts=E, num_experts_per_tok=K)
    return tf.MixtralForCausalLM(cfg).float().train()


def _fq(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    return (x.float() * s).clamp(-fmax, fmax).to(dtype).float() / s


class Truth:
    """What this script measures itself: per-expert GEMM errors of the planted group, and the load CV."""

    def __init__(self, model: torch.nn.Module, sc: Scenario, fp8: bool) -> None:
        self.sc, self.fp8 = sc, fp8
        self.errors: dict[int, list[list[float]]] = {}
        self.load_cv: dict[int, float] = {}
        self.step = 0
        layer = model.model.layers[sc.layer].mlp
        self.experts = layer.experts
        for i, blk in enumerate(model.model.layers):
            blk.mlp.experts.register_forward_pre_hook(self._routing(i))
        self.experts.register_forward_pre_hook(self._gemm)

    def _routing(self, i: int):
        def hook(module, args):
            if i == self.sc.layer and torch.is_grad_enabled():
                counts = torch.bincount(args[1].reshape(-1), minlength=E).double()
                self.load_cv[self.step] = float(counts.std(unbiased=False) / counts.mean())
        return hook

    def _gemm(self, module, args):
        if self.fp8 and torch.is_grad_enabled() and self.step % EVERY == 0:
            with torch.no_grad():
                self._errors(module, args[0], args[1])

    def _errors(self, module, hidden, idx):
        quant = module.fp8_quantizers("gate_up_proj")
        sx = quant.delayed["activation"].scale if quant.delayed else None
        sw = quant.delayed["weight"].scale if quant.delayed else None
        errs = []
        for e in range(E):
            tok = torch.where((idx == e).any(-1))[0]
            if tok.numel() == 0:
                errs.append(math.nan)
                continue
            x, w = hidden[tok].float(), module.gate_up_proj[e].float()
            ref = x @ w.t()
            sxe = sx[e] if sx is not None else 448.0 / x.abs().max()
            swe = sw[e] if sw is not None else 448.0 / w.abs().max()
            got = _fq(x, sxe, torch.float8_e4m3fn, 448.0) @ _fq(w, swe, torch.float8_e4m3fn, 448.0).t()
            errs.append(float((got - ref).norm() / ref.norm()))
        self.errors.setdefault(self.step, []).append(errs)


def _plant(model: torch.nn.Module, sc: Scenario, step: int) -> None:
    if sc.plant == "expert_scale" and step >= PLANT_AT:
        quant = model.model.layers[sc.layer].mlp.experts.fp8_quantizers("gate_up_proj")
        quant.delayed[sc.tensor].scale[sc.expert] *= 2.0**8


def _router_hook(sc: Scenario):
    state = {"on": False}

    def hook(module, args):
        if not state["on"]:
            return None
        h = args[0]
        s = 448.0 / h.detach().abs().amax().clamp_min(1e-30) * 2.0**-20
        return ((h * s).clamp(-448, 448).to(torch.float8_e4m3fn).to(h.dtype) / s,)

    return hook, state


def train(sc: Scenario, fp8: bool, log_dir: Path) -> dict[str, Any]:
    model = build(sc.seed)
    report = fp8track.apply_fp8(model, sc.recipe, backend="emulated") if fp8 else None
    truth = Truth(model, sc, fp8)
    state = {"on": False}
    if fp8 and sc.plant == "router_underflow":
        hook, state = _router_hook(sc)
        model.model.layers[sc.layer].mlp.gate.register_forward_pre_hook(hook)
    opt = torch.optim.AdamW(model.parameters(), lr=ds.LR)
    losses = []
    mon = fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=EVERY), log_dir=log_dir,
                           apply_report=report)
    with mon:
        for step, (x, y) in enumerate(ds.batches(sc.seed, STEPS)):
            truth.step = step
            if fp8:
                _plant(model, sc, step)
                state["on"] = step >= PLANT_AT
            loss = torch.nn.functional.cross_entropy(model(x).logits.reshape(-1, ds.VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            mon.step(loss=loss)
            opt.zero_grad()
            losses.append(float(loss))
    return {"dir": str(mon.run_dir), "losses": losses, "errors": truth.errors, "load_cv": truth.load_cv}


def verify(sc: Scenario, fp8: dict, control: dict) -> dict[str, Any]:
    ratio = ds._running_median(ds.loss_ratio(fp8["losses"], control["losses"]), ds.RATIO_SMOOTH)
    if sc.plant is None:
        return {"verified": max(abs(r - 1) for r in ratio[10:]) <= 0.03, "max_ratio": max(ratio[10:])}
    if sc.plant == "expert_scale":
        after = [errs for s, per in fp8["errors"].items() if s >= PLANT_AT for errs in per]
        med = [ds._median([e[i] for e in after if math.isfinite(e[i])]) for i in range(E)]
        planted = med[sc.expert]
        others = max(m for i, m in enumerate(med) if i != sc.expert and math.isfinite(m))
        return {"verified": planted >= DAMAGE_MIN and planted >= DAMAGE_RATIO * others,
                "planted_error": planted, "max_other_error": others}
    cv_f = ds._median([v for s, v in fp8["load_cv"].items() if s >= PLANT_AT])
    cv_c = ds._median([v for s, v in control["load_cv"].items() if s >= PLANT_AT])
    return {"verified": cv_f - cv_c >= COLLAPSE_MIN, "fp8_load_cv": cv_f, "control_load_cv": cv_c}


def _naive(rows, stat: str, worst) -> str | None:
    vals: dict[str, float] = {}
    for r in rows:
        if ".expert_" in r.layer and r.variant == "actual" and math.isfinite(r.stats.get(stat, math.nan)):
            v = r.stats[stat]
            vals[r.layer] = worst(vals.get(r.layer, v), v)
    if not vals:
        return None
    return (max if worst is max else min)(vals, key=vals.get)


def score(sc: Scenario, fp8_ref: str, control_ref: str) -> dict[str, Any]:
    f, c = load_run(fp8_ref), load_run(control_ref)
    d = diagnose(f, c)
    kinds = d.kinds()
    out: dict[str, Any] = {"kinds": kinds, "top": kinds[0], "verdict": d.verdict.verdict,
                           "verdict_layers": list(d.verdict.layers)[:2]}
    if sc.plant == "expert_scale":
        target = f"model.layers.{sc.layer}.mlp.experts.gate_up_proj.expert_{sc.expert}"
        experts = [x for x in d.findings if x.kind == "expert_outlier"]
        out["expert_first"] = bool(experts) and experts[0].layers[0] == target
        out["naive_overflow_first"] = _naive(f.tensor_rows, "overflow_pct", max) == target
        out["naive_sqnr_first"] = _naive(f.tensor_rows, "sqnr_db", min) == target
        out["expert_onset"] = experts[0].steps[0] if experts else None
        out["verdict_names_expert"] = d.verdict.verdict == "fp8_problem" and d.verdict.layers[:1] == (target,)
    elif sc.plant == "router_underflow":
        out["router_divergence"] = "router_divergence" in kinds
    else:
        # a false alarm is an MoE finding the verdict acts on (medium or high); low ones are notes
        out["false_alarm_moe"] = any(x.kind in MOE_KINDS and x.severity in ("high", "medium")
                                     for x in d.findings)
        out["healthy_verdict"] = d.verdict.verdict == "healthy"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default=None, help="comma-separated scenario names")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    chosen = [s for s in scenarios() if not args.only or s.name in args.only.split(",")]
    t0 = time.time()
    results = []
    controls: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sc in chosen:
            if sc.seed not in controls:
                controls[sc.seed] = train(
                    Scenario("control", "bf16", sc.seed), False, Path(tmp) / f"c{sc.seed}"
                )
            control = controls[sc.seed]
            fp8 = train(sc, True, Path(tmp) / sc.name)
            truth = verify(sc, fp8, control)
            res = {"scenario": sc.name, "truth": truth, **score(sc, fp8["dir"], control["dir"])}
            results.append(res)
            print(json.dumps(res), flush=True)
    expert = [r for r in results if "expert_first" in r and r["truth"]["verified"]]
    router = [r for r in results if "router_divergence" in r and r["truth"]["verified"]]
    healthy = [r for r in results if "false_alarm_moe" in r and r["truth"]["verified"]]
    summary = {
        "expert plants verified": f"{len(expert)}/{sum('expert_first' in r for r in results)}",
        "planted expert named first": f"{sum(r['expert_first'] for r in expert)}/{len(expert)}",
        "naive highest overflow first": f"{sum(r['naive_overflow_first'] for r in expert)}/{len(expert)}",
        "naive lowest SQNR first": f"{sum(r['naive_sqnr_first'] for r in expert)}/{len(expert)}",
        "routing plants verified": f"{len(router)}/{sum('router_divergence' in r for r in results)}",
        "router_divergence raised": f"{sum(r['router_divergence'] for r in router)}/{len(router)}",
        "healthy pairs verified": f"{len(healthy)}/{sum('false_alarm_moe' in r for r in results)}",
        "verdict names the planted expert":
            f"{sum(r.get('verdict_names_expert', False) for r in expert)}/{len(expert)}",
        "MoE false alarms on healthy pairs": f"{sum(r['false_alarm_moe'] for r in healthy)}/{len(healthy)}",
        "healthy verdicts": f"{sum(r['healthy_verdict'] for r in healthy)}/{len(healthy)}",
        "wall_s": round(time.time() - t0, 1),
    }
    doc = {"summary": summary, "scenarios": results, "steps": STEPS, "every": EVERY, "plant_at": PLANT_AT}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

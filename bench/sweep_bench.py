"""The sweep acceptance run: ``fp8track sweep integrations/wandb/fp8_sweep.yaml --trials 6`` timed,
then read back from MLflow. Prints JSON.

    python bench/sweep_bench.py [--trials 6] [--out /tmp/fp8-sweep-bench]
    python bench/sweep_bench.py --read-only --out DIR     # only read back an earlier run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--out", default="/tmp/fp8-sweep-bench")
    p.add_argument("--yaml", default=str(ROOT / "integrations" / "wandb" / "fp8_sweep.yaml"))
    p.add_argument("--read-only", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    result: dict = {"cpus": os.cpu_count(), "load_before": os.getloadavg()}
    if not args.read_only:
        from fp8track.cli import main as cli

        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        cli(["sweep", args.yaml, "--trials", str(args.trials), "--out", str(out), "--no-progress"])
        result["seconds"] = round(time.perf_counter() - t0, 1)
        result["load_after"] = os.getloadavg()

    import mlflow
    from mlflow.tracking import MlflowClient

    from fp8track.sweep.mlflow_runs import find_parent
    from fp8track.sweep.spec import load_sweep

    uri = f"sqlite:///{out / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id, parent = find_parent(client, load_sweep(args.yaml).name)
    mlflow.set_tracking_uri(uri)
    df = mlflow.search_runs(experiment_ids=[exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}' "
                            "and tags.`fp8track.role` = 'trial'")
    every = mlflow.search_runs(experiment_ids=[exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    run = client.get_run(parent)
    result.update(
        {
            "parent_run_id": parent,
            "trial_children": len(df),
            "program_runs_by_role": every["tags.fp8track.role"].value_counts().to_dict(),
            "states": df["tags.fp8track.state"].value_counts().to_dict(),
            "trials": [
                {
                    "trial": int(r["tags.fp8track.trial"]),
                    "recipe": r["params.recipe"],
                    "bf16_layers": r["params.bf16_layers"],
                    "fp8_flop_share": r.get("metrics.fp8_flop_share"),
                    "gap": r.get("metrics.gap_vs_bf16"),
                    "state": r["tags.fp8track.state"],
                    "reused": bool(r.get("tags.fp8track.reused_from")),
                }
                for _, r in df.sort_values("tags.fp8track.trial").iterrows()
            ],
            "control_spread": run.data.metrics.get("control/spread"),
            "recommendation": {
                k: v for k, v in run.data.tags.items() if k.startswith("fp8track.recommendation")
            },
            "noise_band": run.data.metrics.get("recommendation/band"),
            "mean_gap": run.data.metrics.get("recommendation/mean_gap"),
            "parent_artifacts": sorted(a.path for a in client.list_artifacts(parent)),
            # parent start (before the control) to the last child's end
            "parent_to_last_child_s": round(
                every["end_time"].max().timestamp() - run.info.start_time / 1000, 1
            ),
        }
    )
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

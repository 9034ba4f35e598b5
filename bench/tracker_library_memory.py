"""What wandb and MLflow themselves keep in memory over a long run, without fp8track.

Two minimal reproductions of the growth fp8track's adapters work around (docs/reliability.md,
section 5). Prints one JSON object:

* ``wandb``: an ``INCREMENTAL`` ``wandb.Table`` (offline run) gets 6 rows a step and is logged
  every ``--log-every`` steps; ``len(table.data)`` and the traced Python memory at each point.
  wandb keeps every row ever added.
* ``mlflow``: ``MlflowClient.log_table`` appends 6,000 rows to one table file ``--writes`` times
  (SQLite store); RSS and peak RSS after each write. Each append downloads, concatenates and
  rewrites the whole table in pandas.

    python bench/tracker_library_memory.py [--steps 4000] [--log-every 500] [--writes 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wandb_table(out: Path, steps: int, log_every: int) -> list[dict[str, Any]]:
    import wandb

    run = wandb.init(project="table-memory", dir=str(out), mode="offline", reinit="create_new")
    table = wandb.Table(columns=["step", "layer", *(f"s{i}" for i in range(14))], log_mode="INCREMENTAL")
    points = []
    tracemalloc.start()
    for step in range(steps):
        for layer in range(6):
            table.add_data(step, f"l{layer}", *(float(step + i) for i in range(14)))
        data: dict[str, Any] = {"x": float(step)}
        if (step + 1) % log_every == 0:
            data["t"] = table
        run.log(data)
        if (step + 1) % log_every == 0:
            gc.collect()
            mib = tracemalloc.get_traced_memory()[0] / 2**20
            points.append(
                {"step": step + 1, "rows_in_table_data": len(table.data), "traced_mib": round(mib, 2)}
            )
    tracemalloc.stop()
    run.finish()
    return points


def mlflow_log_table(out: Path, writes: int) -> list[dict[str, Any]]:
    import mlflow
    import pandas as pd

    client = mlflow.MlflowClient(f"sqlite:///{out}/mlflow.db")
    exp = client.create_experiment("table-memory", artifact_location=(out / "artifacts").as_uri())
    run_id = client.create_run(exp).info.run_id
    columns = ["step", "layer", "tensor", "variant", *(f"s{i}" for i in range(16))]
    points = []
    for w in range(writes):
        rows = [
            [
                w * 1000 + s,
                f"l{layer}",
                "activation",
                "actual",
                *(float(s * layer + i) + 0.123456789 for i in range(16)),
            ]
            for s in range(1000)
            for layer in range(6)
        ]
        client.log_table(run_id, data=pd.DataFrame(rows, columns=columns), artifact_file="t.json")
        del rows
        gc.collect()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        points.append(
            {
                "write": w + 1,
                "table_rows": (w + 1) * 6000,
                "rss_mib": round(rss_mib(), 1),
                "peak_rss_mib": round(peak, 1),
            }
        )
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument("--writes", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        result = {
            "wandb": wandb_table(Path(tmp), args.steps, args.log_every),
            "mlflow": mlflow_log_table(Path(tmp), args.writes),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The run directory's writes of one sampled step, by its line encoder and by ``json`` side by side.

The rows and the metrics record are those a real monitor wrote: a stack of ``--layers``
``nn.Linear(16, 16)`` under the BF16 control's shadow statistics, sampled every step (activation,
weight and gradient rows, the per-layer scalars). Each repetition writes them through
``RunWriter.write_tensor_stats`` / ``write_metrics`` twice, once with the encoder the run directory
uses (``records._dumps``: orjson for plain data) and once with ``json`` (what it used before), the
order alternating; medians of thread CPU time, in us per statistics row (both files together).

    python bench/record_lines_bench.py [--layers 32] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fp8track import Monitor, MonitorConfig
from fp8track.monitoring import records
from fp8track.monitoring.records import RunMeta, RunReader, RunWriter


def one_step_records(layers: int) -> tuple[list, list]:
    """The tensor rows and metrics records of a few sampled steps of a ``layers``-deep linear stack."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
    log_dir = tempfile.mkdtemp()
    mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=log_dir)
    x = torch.randn(16, 16)
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        mon.step(loss=loss)
        model.zero_grad(set_to_none=True)
    mon.close()
    reader = RunReader(mon.run_dir)
    rows = [r for r in reader.tensor_stats() if r.step == 2]
    metrics = [m for m in reader.metrics() if m.step == 2]
    return rows, metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    rows, metrics = one_step_records(args.layers)
    encoders = {"run_directory": records._dumps, "json": records._ENCODER.encode}
    times: dict[str, list[float]] = {k: [] for k in encoders}
    writer = RunWriter.create(Path(tempfile.mkdtemp()), RunMeta(run_id="bench"))
    names = list(encoders)
    try:
        for i in range(args.repeats):
            for name in names[i % 2 :] + names[: i % 2]:
                records._dumps = encoders[name]
                t = time.thread_time()
                writer.write_tensor_stats(rows)
                writer.write_metrics(metrics[0])
                times[name].append(time.thread_time() - t)
    finally:
        records._dumps = encoders["run_directory"]
        writer.close()
    n = len(rows)
    out = {
        "rows_per_step": n,
        "metrics_per_record": len(metrics[0].metrics),
        **{f"{k}_us_per_row": 1e6 * statistics.median(v) / n for k, v in times.items()},
    }
    out["json_over_run_directory"] = out["json_us_per_row"] / out["run_directory_us_per_row"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

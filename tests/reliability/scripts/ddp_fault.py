"""One rank of a 2-process gloo run with fp8track's monitor; rank 1 fails at step 3.

Usage: python ddp_fault.py OUT_DIR RANK MODE   (MODE: raise | die | hang | tp_hang)
``tp_hang``: the linear is tensor parallel (column-wise over both ranks, one global scale), so the
first fp8track collective rank 0 meets is the weight's amax all-reduce inside the forward hook.
Rank 0 writes OUT_DIR/rank0.json: the steps it finished and the error that ended it.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from fp8track import MonitorConfig
from fp8track.errors import RankFailure
from fp8track.frontend import Monitor

out, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
if mode == "tp_hang":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    parallelize_module(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), {"0": ColwiseParallel()})
monitor = Monitor(
    model, MonitorConfig(every_n_steps=1, collective_timeout_s=5.0), log_dir=f"{out}/runs"
).attach()
done, error, t0 = [], None, time.monotonic()
try:
    for step in range(8):
        if rank == 1 and step == 3:
            if mode == "raise":
                raise RuntimeError("rank 1: out of memory (planted)")
            if mode == "die":
                os._exit(9)
            time.sleep(120)  # hang: alive, never joins the collective
        if mode == "tp_hang":
            t0 = time.monotonic()
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        if mode != "tp_hang":
            t0 = time.monotonic()
        monitor.step(loss=loss)
        model.zero_grad()
        done.append(step)
except RankFailure as exc:
    error = {"type": type(exc).__name__, "message": str(exc), "waited_s": time.monotonic() - t0}
if rank == 0:
    with open(f"{out}/rank0.json", "w") as f:
        json.dump({"done": done, "error": error}, f)
os._exit(3 if error else 0)  # skip gloo's teardown, which would wait for the dead peer
